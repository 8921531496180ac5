// The two copies of one head_pages compaction on vLLM's CPU KV cache, every
// KV head of a (request, layer) in one call:
//
//   * gather_heads: each head's live tokens (its compacted tokens, then the
//     standard slots [start, end)) into dense [H, S, D] keys and values, the
//     rows past a head's live tokens zeroed;
//   * write_heads: each head's kept rows of those dense tensors, in order,
//     into its new head-pages, the rest of its last page zeroed.
//
// Semantics: vllm_kvevict/eviction/head_pages.py (gather_live, write_kept)
// over HeadPagedCache.read_pages / read_slots / write_pages
// (vllm_kvevict/vllm_glue/cpu_head_pages.py); the Triton twin that moves the
// kept tokens on the GPU: vllm_kvevict/triton_kernels/compact_head_pages.py.
//
// Storage as in head_paged_attention.cpp: kv_cache [num_blocks, H, 2 * bs, D]
// holds num_blocks * H head-pages (block * H + slot), each a K page then a V
// page of bs * D elements; compacted pages are logical ((t, d) at t * D + d),
// standard slots in vLLM's ISA layout ((t, d) at key_offsets[t * D + d] of
// the K page, value_offsets[t * D + d] of the V page). Elements are copied as
// they are stored (fp32, bf16 or fp16 alike): nothing is converted.
//
// Every index is checked before the first byte is copied, so a bad page,
// block, row or length raises and leaves the cache and the outputs as they
// were. write_heads reads only its dense inputs, which the gather copied out
// of the cache, so a head's new pages may be any pages, its old ones included.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace {

void check_index_tensor(const at::Tensor& t, const char* name, at::ScalarType type, int64_t dim) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous(), name, " must be a contiguous CPU tensor");
  TORCH_CHECK(t.scalar_type() == type, name, " must be ", type, ", got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dimension(s), got ", t.dim());
}

struct Geometry {
  int64_t num_blocks, num_heads, page_size, head_dim, element_size;

  explicit Geometry(const at::Tensor& kv_cache) {
    TORCH_CHECK(kv_cache.device().is_cpu() && kv_cache.is_contiguous() && kv_cache.dim() == 4,
                "kv_cache must be a contiguous CPU [num_blocks, H, 2 * block_size, D] tensor");
    TORCH_CHECK(kv_cache.size(2) % 2 == 0, "kv_cache dim 2 must be 2 * block_size");
    num_blocks = kv_cache.size(0);
    num_heads = kv_cache.size(1);
    page_size = kv_cache.size(2) / 2;
    head_dim = kv_cache.size(3);
    element_size = kv_cache.element_size();
  }
  int64_t page_elements() const { return page_size * head_dim; }
  // Bytes of one head-page (K page + V page) and of one token row.
  int64_t head_page_bytes() const { return 2 * page_elements() * element_size; }
  int64_t row_bytes() const { return head_dim * element_size; }
};

void check_dense(const at::Tensor& t, const char* name, const at::Tensor& kv_cache, int64_t heads,
                 int64_t head_dim) {
  TORCH_CHECK(t.device().is_cpu() && t.is_contiguous() && t.dim() == 3, name,
              " must be a contiguous CPU [H, S, D] tensor");
  TORCH_CHECK(t.scalar_type() == kv_cache.scalar_type(), name, " must have the cache's dtype ",
              kv_cache.scalar_type(), ", got ", t.scalar_type());
  TORCH_CHECK(t.size(0) == heads && t.size(2) == head_dim, name, " must be [", heads, ", S, ",
              head_dim, "], got ", t.sizes());
}

// Offsets of one page layout, checked; `plain` when (t, d) sits at t * D + d.
struct Layout {
  const int64_t* offsets;
  bool plain;
};

Layout check_layout(const at::Tensor& offsets, const char* name, int64_t page_elements) {
  check_index_tensor(offsets, name, at::kLong, 1);
  TORCH_CHECK(offsets.numel() == page_elements, name, " must have block_size * head_dim = ",
              page_elements, " entries, got ", offsets.numel());
  const int64_t* o = offsets.data_ptr<int64_t>();
  bool plain = true;
  for (int64_t i = 0; i < page_elements; ++i) {
    TORCH_CHECK(o[i] >= 0 && o[i] < page_elements, name, "[", i, "] = ", o[i], " is outside the page");
    plain = plain && o[i] == i;
  }
  return {o, plain};
}

// One standard-slot row (logical order) out of a page in vLLM's layout.
template <typename T>
void read_laid_out_row(const T* page, const int64_t* offsets, int64_t head_dim, T* out) {
  for (int64_t d = 0; d < head_dim; ++d) out[d] = page[offsets[d]];
}

void read_standard_row(const char* page, const Layout& layout, int64_t slot, int64_t head_dim,
                       int64_t element_size, char* out) {
  const int64_t* offsets = layout.offsets + slot * head_dim;
  if (layout.plain) {
    std::memcpy(out, page + slot * head_dim * element_size, head_dim * element_size);
  } else if (element_size == 4) {
    read_laid_out_row(reinterpret_cast<const uint32_t*>(page), offsets, head_dim,
                      reinterpret_cast<uint32_t*>(out));
  } else {
    read_laid_out_row(reinterpret_cast<const uint16_t*>(page), offsets, head_dim,
                      reinterpret_cast<uint16_t*>(out));
  }
}

}  // namespace

void gather_heads(const at::Tensor& kv_cache, const at::Tensor& head_pages,
                  const at::Tensor& head_lens, const at::Tensor& block_row, int64_t start,
                  int64_t end, const at::Tensor& key_offsets, const at::Tensor& value_offsets,
                  at::Tensor& keys, at::Tensor& values) {
  const Geometry g(kv_cache);
  const int64_t H = g.num_heads, bs = g.page_size, D = g.head_dim, es = g.element_size;
  TORCH_CHECK(es == 4 || es == 2, "kv_cache must be float32, bfloat16 or float16, got ",
              kv_cache.scalar_type());
  check_index_tensor(head_pages, "head_pages", at::kInt, 2);
  check_index_tensor(head_lens, "head_lens", at::kLong, 1);
  check_index_tensor(block_row, "block_row", at::kInt, 1);
  TORCH_CHECK(head_pages.size(0) == H && head_lens.size(0) == H, "head_pages and head_lens must have ",
              H, " rows (the cache's KV heads)");
  check_dense(keys, "keys", kv_cache, H, D);
  check_dense(values, "values", kv_cache, H, D);
  TORCH_CHECK(values.size(1) == keys.size(1), "keys and values must have the same width");
  const Layout key_layout = check_layout(key_offsets, "key_offsets", g.page_elements());
  const Layout value_layout = check_layout(value_offsets, "value_offsets", g.page_elements());

  const int64_t width = keys.size(1), max_pages = head_pages.size(1);
  const int64_t num_standard = end - start;
  TORCH_CHECK(start >= 0 && start <= end && end <= block_row.numel() * bs, "standard slots [", start,
              ", ", end, ") are outside the block row of ", block_row.numel(), " blocks");
  const int32_t* pages = head_pages.data_ptr<int32_t>();
  const int64_t* lens = head_lens.data_ptr<int64_t>();
  const int32_t* blocks = block_row.data_ptr<int32_t>();
  for (int64_t h = 0; h < H; ++h) {
    TORCH_CHECK(lens[h] >= 0 && lens[h] <= max_pages * bs, "head_lens[", h, "] = ", lens[h],
                " is outside [0, ", max_pages * bs, "]");
    TORCH_CHECK(lens[h] + num_standard <= width, "head ", h, " has ", lens[h] + num_standard,
                " live tokens, more than keys' width ", width);
    for (int64_t i = 0; i < (lens[h] + bs - 1) / bs; ++i) {
      const int64_t p = pages[h * max_pages + i];
      TORCH_CHECK(p >= 0 && p < g.num_blocks * H, "head-page id ", p, " (head ", h, ", page ", i,
                  ") is outside the cache's ", g.num_blocks * H);
    }
  }
  for (int64_t b = start / bs; b < (end + bs - 1) / bs; ++b) {
    TORCH_CHECK(blocks[b] >= 0 && blocks[b] < g.num_blocks, "block id ", blocks[b], " (block_row[",
                b, "]) is outside the cache's ", g.num_blocks);
  }

  const char* cache = static_cast<const char*>(kv_cache.data_ptr());
  char* key_out = static_cast<char*>(keys.data_ptr());
  char* value_out = static_cast<char*>(values.data_ptr());
  const int64_t page_bytes = g.page_elements() * es, row = g.row_bytes();
  at::parallel_for(0, H, 1, [&](int64_t first, int64_t last) {
    for (int64_t h = first; h < last; ++h) {
      char* k_dst = key_out + h * width * row;
      char* v_dst = value_out + h * width * row;
      const int64_t length = lens[h];
      for (int64_t t = 0; t < length; t += bs) {  // compacted pages: logical, whole rows
        const char* page = cache + pages[h * max_pages + t / bs] * g.head_page_bytes();
        const int64_t n = std::min(bs, length - t);
        std::memcpy(k_dst + t * row, page, n * row);
        std::memcpy(v_dst + t * row, page + page_bytes, n * row);
      }
      for (int64_t s = start; s < end; ++s) {  // standard slots: vLLM's layout
        const char* page = cache + (blocks[s / bs] * H + h) * g.head_page_bytes();
        const int64_t j = length + s - start;
        read_standard_row(page, key_layout, s % bs, D, es, k_dst + j * row);
        read_standard_row(page + page_bytes, value_layout, s % bs, D, es, v_dst + j * row);
      }
      const int64_t filled = length + num_standard;
      std::memset(k_dst + filled * row, 0, (width - filled) * row);
      std::memset(v_dst + filled * row, 0, (width - filled) * row);
    }
  });
}

void write_heads(at::Tensor& kv_cache, const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& kept, const at::Tensor& counts, const at::Tensor& page_table) {
  const Geometry g(kv_cache);
  const int64_t H = g.num_heads, bs = g.page_size, D = g.head_dim;
  check_dense(keys, "keys", kv_cache, H, D);
  check_dense(values, "values", kv_cache, H, D);
  TORCH_CHECK(values.size(1) == keys.size(1), "keys and values must have the same width");
  check_index_tensor(kept, "kept", at::kLong, 2);
  check_index_tensor(counts, "counts", at::kLong, 1);
  check_index_tensor(page_table, "page_table", at::kInt, 2);
  TORCH_CHECK(kept.size(0) == H && counts.size(0) == H && page_table.size(0) == H,
              "kept, counts and page_table must have ", H, " rows (the cache's KV heads)");
  const int64_t width = keys.size(1), kept_width = kept.size(1), max_pages = page_table.size(1);
  const int64_t* rows = kept.data_ptr<int64_t>();
  const int64_t* n_kept = counts.data_ptr<int64_t>();
  const int32_t* pages = page_table.data_ptr<int32_t>();
  for (int64_t h = 0; h < H; ++h) {
    const int64_t n = n_kept[h];
    TORCH_CHECK(n >= 0 && n <= kept_width && n <= max_pages * bs, "counts[", h, "] = ", n,
                " is outside [0, ", std::min(kept_width, max_pages * bs), "]");
    for (int64_t j = 0; j < n; ++j) {
      const int64_t r = rows[h * kept_width + j];
      TORCH_CHECK(r >= 0 && r < width, "kept[", h, ", ", j, "] = ", r, " is outside keys' ", width,
                  " rows");
    }
    for (int64_t i = 0; i < (n + bs - 1) / bs; ++i) {
      const int64_t p = pages[h * max_pages + i];
      TORCH_CHECK(p >= 0 && p < g.num_blocks * H, "head-page id ", p, " (head ", h, ", page ", i,
                  ") is outside the cache's ", g.num_blocks * H);
    }
  }

  char* cache = static_cast<char*>(kv_cache.data_ptr());
  const char* key_in = static_cast<const char*>(keys.data_ptr());
  const char* value_in = static_cast<const char*>(values.data_ptr());
  const int64_t page_bytes = g.page_elements() * g.element_size, row = g.row_bytes();
  at::parallel_for(0, H, 1, [&](int64_t first, int64_t last) {
    for (int64_t h = first; h < last; ++h) {
      const int64_t n = n_kept[h];
      for (int64_t j = 0; j < n; ++j) {
        char* page = cache + pages[h * max_pages + j / bs] * g.head_page_bytes();
        const int64_t r = rows[h * kept_width + j];
        std::memcpy(page + (j % bs) * row, key_in + (h * width + r) * row, row);
        std::memcpy(page + page_bytes + (j % bs) * row, value_in + (h * width + r) * row, row);
      }
      if (n % bs) {  // the rest of the last page: nothing reads it, zeros keep stale bytes out
        char* page = cache + pages[h * max_pages + n / bs] * g.head_page_bytes();
        std::memset(page + (n % bs) * row, 0, (bs - n % bs) * row);
        std::memset(page + page_bytes + (n % bs) * row, 0, (bs - n % bs) * row);
      }
    }
  });
}
