// Each row's k best entries, the selection every eviction keeps by, in one
// call instead of a dozen tensor ops (each costs a few microseconds on a CPU
// worker; a layer's selection runs three of them):
//
//   * top_k_mask: [R, N] bool, row r's first k[r] entries in a stable
//     descending order (the higher score first, ties to the lower index);
//   * top_k_indices: the same entries as indices, ascending, -1 padded to
//     [R, max k] (what select_top returns).
//
// Semantics: vllm_kvevict/top_k.py (top_k_mask, select_top),
// whose torch path is the reference these are tested against. Per row, one
// nth_element under the strict order (score descending, index ascending)
// finds the k entries; a NaN ranks with -inf (the callers reject NaN first).

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/full.h>
#include <ATen/ops/zeros.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

namespace {

void check_inputs(const at::Tensor& scores, const at::Tensor& k) {
  TORCH_CHECK(scores.device().is_cpu() && scores.is_contiguous() && scores.dim() == 2,
              "scores must be a contiguous CPU [R, N] tensor");
  TORCH_CHECK(scores.scalar_type() == at::kFloat || scores.scalar_type() == at::kDouble,
              "scores must be float32 or float64, got ", scores.scalar_type());
  TORCH_CHECK(k.device().is_cpu() && k.is_contiguous() && k.dim() == 1 &&
                  k.scalar_type() == at::kLong && k.size(0) == scores.size(0),
              "k must be a contiguous CPU int64 [R] tensor");
}

// Row `row`'s first `count` entries (clamped to [0, N]) of the stable
// descending order, in no particular order, into `order[0, count)`.
template <typename T>
int64_t row_top(const T* row, int64_t width, int64_t count, std::vector<int64_t>& order) {
  count = std::max<int64_t>(0, std::min<int64_t>(count, width));
  order.resize(width);
  std::iota(order.begin(), order.end(), 0);
  if (count == 0 || count == width) return count;
  auto key = [row](int64_t i) {
    T v = row[i];
    return std::isnan(v) ? -std::numeric_limits<T>::infinity() : v;
  };
  std::nth_element(order.begin(), order.begin() + count, order.end(),
                   [&key](int64_t a, int64_t b) {
                     T ka = key(a), kb = key(b);
                     return ka > kb || (ka == kb && a < b);
                   });
  return count;
}

}  // namespace

at::Tensor top_k_mask(const at::Tensor& scores, const at::Tensor& k) {
  check_inputs(scores, k);
  const int64_t rows = scores.size(0), width = scores.size(1);
  at::Tensor mask = at::zeros({rows, width}, scores.options().dtype(at::kBool));
  bool* out = mask.data_ptr<bool>();
  const int64_t* counts = k.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "top_k_mask", [&] {
    const scalar_t* data = scores.data_ptr<scalar_t>();
    std::vector<int64_t> order;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t count = row_top(data + r * width, width, counts[r], order);
      for (int64_t j = 0; j < count; ++j) out[r * width + order[j]] = true;
    }
  });
  return mask;
}

at::Tensor top_k_indices(const at::Tensor& scores, const at::Tensor& k) {
  check_inputs(scores, k);
  const int64_t rows = scores.size(0), width = scores.size(1);
  const int64_t* counts = k.data_ptr<int64_t>();
  int64_t widest = 0;
  for (int64_t r = 0; r < rows; ++r) widest = std::max(widest, counts[r]);
  at::Tensor kept = at::full({rows, widest}, -1, scores.options().dtype(at::kLong));
  int64_t* out = kept.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES(scores.scalar_type(), "top_k_indices", [&] {
    const scalar_t* data = scores.data_ptr<scalar_t>();
    std::vector<int64_t> order;
    for (int64_t r = 0; r < rows; ++r) {
      int64_t count = row_top(data + r * width, width, counts[r], order);
      std::sort(order.begin(), order.begin() + count);
      std::copy(order.begin(), order.begin() + count, out + r * widest);
    }
  });
  return kept;
}
