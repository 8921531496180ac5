// Attention over per-(request, KV-head) page tables on vLLM's CPU KV cache,
// with the MomentKV evicted-token moments folded into the same softmax.
//
// Semantics: vllm_kvevict/triton_kernels/head_paged_attention.py
// (head_paged_attention_reference); torch twin and loader:
// vllm_kvevict/cpu_ops.py.
//
// Storage (one layer): kv_cache [num_blocks, H, 2 * bs, D], i.e.
// num_blocks * H head-pages of 2 * bs * D elements, head-page p = block * H +
// slot; a head-page holds a K page then a V page (V starts at element bs * D).
//   * compacted head-pages (head_page_table[r, h, :]) are LOGICAL: element
//     (t, d) at t * D + d of the K (V) page;
//   * standard-region head-pages (block_table[r, s / bs] * H + h) are in
//     vLLM's ISA layout: element (t, d) at key_offsets[t * D + d] of the K
//     page, value_offsets[t * D + d] of the V page; so are those of a
//     protected prefix (prefix_lens[r]: the slots [0, prefix_lens[r]) of the
//     block table, read before the compacted pages and seen by every query).
//
// Scheme. The work is cut into items (request, KV head, tile of <= 32 query
// tokens, chunk of pages), pulled by torch's threads from a shared counter.
// An item converts its queries to fp32 (times the softmax scale), starts
// every query row from the moments' partial state (m = lse_E, l = 1,
// acc = o_E) in its first chunk, and runs the flash-style online softmax page
// by page. A page's K and V rows are made available as fp32: pointers into
// the cache where no conversion is needed (fp32 logical pages; fp32 "vec" key
// pages, [D, bs], read transposed), else converted or unpacked through the
// offset tables once into thread-local scratch; either way they are reused
// from L1 by all G query heads x tokens of the tile. Scores are computed 16
// keys at a time (16 dot products finished by one transpose-and-add tree),
// exp by a vectorised polynomial. Items of one (request, head, tile) split
// into several chunks (split-KV, when there are too few (request, head)
// pairs to keep every thread busy, e.g. decoding one request) leave
// (m, l, acc) partials that a second pass merges.

// The kernels include ATen's core headers only; the Python bindings of the
// extension are in bindings.cpp (torch/extension.h alone takes ~40 s to
// compile, once per file that includes it).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#if defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kTileTokens = 32;  // query tokens per item
constexpr int64_t kMinChunkPages = 4;  // smallest split-KV chunk

// 16 fp32 lanes through GCC/Clang vector extensions: one zmm with AVX-512,
// two ymm with AVX2, four q registers on NEON.
typedef float vf16 __attribute__((vector_size(64)));
constexpr int kLanes = 16;

inline vf16 vload(const float* p) {
  vf16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline void vstore(float* p, vf16 v) { std::memcpy(p, &v, sizeof(v)); }

inline vf16 vsplat(float x) { return vf16{} + x; }

#if defined(__clang__) || (defined(__GNUC__) && __GNUC__ >= 12)
#define KVEVICT_SHUFFLE 1
typedef float vf8 __attribute__((vector_size(32)));
typedef float vf4 __attribute__((vector_size(16)));

inline vf16 vmax(vf16 a, vf16 b) { return a > b ? a : b; }

// Tree reductions: halves combined (one shuffle + one op per level).
inline float hsum(vf16 v) {
  const vf8 a = __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
                __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  vf4 b = __builtin_shufflevector(a, a, 0, 1, 2, 3) + __builtin_shufflevector(a, a, 4, 5, 6, 7);
  b += __builtin_shufflevector(b, b, 2, 3, 0, 1);
  b += __builtin_shufflevector(b, b, 1, 0, 3, 2);
  return b[0];
}

inline float hmax(vf16 v) {
  v = vmax(v, __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7));
  v = vmax(v, __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11));
  v = vmax(v, __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13));
  v = vmax(v, __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14));
  return v[0];
}

// Lane k of the result = the sum of the lanes of a[k]: 16 dot products
// finished with 15 (two-shuffle, one-add) steps instead of 16 reductions of
// 4 steps each. Each level folds two vectors' halves into one vector.
inline vf16 transpose_sum16(const vf16* a) {
  vf16 b[8], c[4];
  for (int i = 0; i < 8; ++i) {  // [a_2i (8) | a_2i+1 (8)]
    b[i] = __builtin_shufflevector(a[2 * i], a[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19,
                                   20, 21, 22, 23) +
           __builtin_shufflevector(a[2 * i], a[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25,
                                   26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; ++i) {  // four vectors' 4-lane partials
    c[i] = __builtin_shufflevector(b[2 * i], b[2 * i + 1], 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18,
                                   19, 24, 25, 26, 27) +
           __builtin_shufflevector(b[2 * i], b[2 * i + 1], 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22,
                                   23, 28, 29, 30, 31);
  }
  vf16 d[2];
  for (int i = 0; i < 2; ++i) {  // eight vectors' 2-lane partials
    d[i] = __builtin_shufflevector(c[2 * i], c[2 * i + 1], 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20,
                                   21, 24, 25, 28, 29) +
           __builtin_shufflevector(c[2 * i], c[2 * i + 1], 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22,
                                   23, 26, 27, 30, 31);
  }
  return __builtin_shufflevector(d[0], d[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26,
                                 28, 30) +
         __builtin_shufflevector(d[0], d[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27,
                                 29, 31);
}
#else
inline vf16 vmax(vf16 a, vf16 b) {
  vf16 r;
  for (int i = 0; i < kLanes; ++i) r[i] = a[i] > b[i] ? a[i] : b[i];
  return r;
}

inline float hsum(vf16 v) {
  float s = 0.0f;
  for (int i = 0; i < kLanes; ++i) s += v[i];
  return s;
}

inline float hmax(vf16 v) {
  float m = v[0];
  for (int i = 1; i < kLanes; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline vf16 transpose_sum16(const vf16* a) {
  vf16 r;
  for (int k = 0; k < kLanes; ++k) r[k] = hsum(a[k]);
  return r;
}
#endif

typedef int32_t vi16 __attribute__((vector_size(64)));

// exp(x) for x <= 0 (scores minus their running max), 16 lanes: Cephes' expf
// (range reduction by ln 2, degree-6 polynomial, relative error ~2e-7) in
// vector arithmetic, so that no -ffast-math / libmvec is needed. exp of
// x < -87.3 (and of -inf) is 0.
inline vf16 vexp_nonpositive(vf16 x) {
  const vf16 lo = vsplat(-87.3f);
  const vf16 xc = x < lo ? lo : x;
  const vf16 t = xc * 1.44269504088896341f + 0.5f;
  vf16 k = __builtin_convertvector(__builtin_convertvector(t, vi16), vf16);  // trunc
  k = k > t ? k - 1.0f : k;  // floor
  vf16 r = xc - k * 0.693359375f;
  r = r - k * -2.12194440e-4f;
  const vf16 r2 = r * r;
  vf16 y = vsplat(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
  const vi16 bits = (__builtin_convertvector(k, vi16) + 127) << 23;
  vf16 two_k;
  std::memcpy(&two_k, &bits, sizeof(two_k));
  return x < lo ? vf16{} : y * two_k;
}

// ---------------------------------------------------------------- conversion

inline float to_f32(float x) { return x; }
inline float to_f32(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_f32(c10::Half x) { return static_cast<float>(x); }

inline void convert_row(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, n * sizeof(float));
}

inline void convert_row(const c10::BFloat16* src, float* dst, int64_t n) {
  // bf16 is the high half of an fp32: a shift, which vectorises.
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}

inline void convert_row(const c10::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__F16C__)
  for (; i + 8 <= n; i += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + i));
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
  }
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// ---------------------------------------------------------------- index views

// A contiguous int32 or int64 tensor read as int64.
struct IntView {
  const int32_t* i32 = nullptr;
  const int64_t* i64 = nullptr;
  int64_t operator[](int64_t i) const { return i64 != nullptr ? i64[i] : i32[i]; }
};

IntView int_view(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
  IntView v;
  if (t.scalar_type() == at::kLong) {
    v.i64 = t.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32 or int64, got ",
                t.scalar_type());
    v.i32 = t.data_ptr<int32_t>();
  }
  return v;
}

// ---------------------------------------------------------------- work plan

// Tokens [first, first + count) of one head-page.
struct Segment {
  int64_t base;  // element offset of the head-page in kv_cache
  int32_t first;
  int32_t count;
  int64_t slot0;  // standard: slot of token `first`; compacted: -1
  bool standard;
};

// The queries of one (request, KV head, tile) and the segments they read.
struct Group {
  int64_t head;
  int64_t tok0;  // first query token (global index)
  int64_t ntok;
  int64_t pos0;  // position of token tok0
  int64_t seg_begin, seg_end;
  int64_t moment_row;  // -1: none
  int64_t nchunks;
  int64_t partial_offset;  // floats into the partial buffer when nchunks > 1
};

struct Item {
  int64_t group;
  int64_t chunk;
  int64_t cost;
};

// ---------------------------------------------------------------- the kernel

// How a standard page orders its elements, read off its offset table.
enum class PageOrder {
  kLogical,     // (t, d) at t * D + d: vLLM's "vec" value pages
  kTransposed,  // (t, d) at d * bs + t: vLLM's "vec" key pages
  kGeneric,     // anything else (the AMX packings): read through the table
};

struct OffsetTable {
  std::vector<int32_t> offsets;
  PageOrder order;
};

// Rank of the moments' value x key cross-covariance C (see vllm_kvevict/moments.py).
enum class CovMode { kNone, kDiagonal, kFull };

struct Params {
  int64_t D, bs, G, Hq, H;
  int64_t page_elems;  // bs * D: a K (or V) page
  PageOrder key_order, value_order;
  const int32_t* key_off;
  const int32_t* value_off;
  const float* count = nullptr;  // moments, fp32 contiguous
  const float* key_mean = nullptr;
  const float* value_mean = nullptr;
  const float* cross_cov = nullptr;
  CovMode cov_mode = CovMode::kFull;
  int64_t cov_elems = 0;  // floats of C per (row, head): D * D, D or 0
  float* out;
  int64_t out_s0, out_s1;
  float* lse;
  int64_t lse_s0, lse_s1;
};

// Lane k = q . rows[k] for k < cnt <= 16 (rows of DT floats), 0 beyond; rows
// past cnt are never loaded (they may be another head's data, or poison).
template <int DT>
inline vf16 dots16(const vf16* qv, const float* rows, int64_t cnt) {
  constexpr int NV = DT / kLanes;
  vf16 dots[kLanes];
  if (cnt == kLanes) {
#pragma GCC unroll 16
    for (int k = 0; k < kLanes; ++k) {
      vf16 a = qv[0] * vload(rows + k * DT);
      for (int c = 1; c < NV; ++c) a += qv[c] * vload(rows + k * DT + c * kLanes);
      dots[k] = a;
    }
  } else {
    for (int k = 0; k < kLanes; ++k) {
      vf16 a{};
      if (k < cnt) {
        for (int c = 0; c < NV; ++c) a += qv[c] * vload(rows + k * DT + c * kLanes);
      }
      dots[k] = a;
    }
  }
  return transpose_sum16(dots);
}

// s[j] = q . K_j for j < nv (s padded with -inf to a multiple of 16); returns
// max_j s[j]. Logical K (KT = false): rows of D floats. Transposed K (KT =
// true): element (j, d) at K[d * ld + j], so 16 keys' scores are one vector
// accumulated over d with q[d] broadcast, no reduction at all.
template <int DT, bool KT>
inline float scores(const float* __restrict q, const float* __restrict K, int64_t ld, int64_t nv,
                    int64_t D_rt, float* __restrict s) {
  const int64_t D = DT > 0 ? DT : D_rt;
  const int64_t padded = (nv + kLanes - 1) / kLanes * kLanes;
  for (int64_t j = nv; j < padded; ++j) s[j] = kNegInf;
  if constexpr (DT > 0 && DT % kLanes == 0 && !KT) {
    constexpr int NV = DT / kLanes;
    vf16 qv[NV];
    for (int c = 0; c < NV; ++c) qv[c] = vload(q + c * kLanes);
    vf16 vmx = vsplat(kNegInf);
    for (int64_t j0 = 0; j0 < nv; j0 += kLanes) {
      const int64_t cnt = std::min<int64_t>(kLanes, nv - j0);
      vf16 sv = dots16<DT>(qv, K + j0 * DT, cnt);
      if (cnt < kLanes) {
        for (int k = static_cast<int>(cnt); k < kLanes; ++k) sv[k] = kNegInf;
      }
      vstore(s + j0, sv);
      vmx = vmax(vmx, sv);
    }
    return hmax(vmx);
  } else if constexpr (KT) {
    float mx = kNegInf;
    int64_t j0 = 0;
    for (; j0 + kLanes <= nv; j0 += kLanes) {
      // Four chains over d: the FMA latency, not the loads, would bound one.
      vf16 a0{}, a1{}, a2{}, a3{};
      int64_t d = 0;
      for (; d + 4 <= D; d += 4) {
        a0 += q[d] * vload(K + d * ld + j0);
        a1 += q[d + 1] * vload(K + (d + 1) * ld + j0);
        a2 += q[d + 2] * vload(K + (d + 2) * ld + j0);
        a3 += q[d + 3] * vload(K + (d + 3) * ld + j0);
      }
      for (; d < D; ++d) a0 += q[d] * vload(K + d * ld + j0);
      const vf16 sv = (a0 + a1) + (a2 + a3);
      vstore(s + j0, sv);
      mx = std::max(mx, hmax(sv));
    }
    for (int64_t j = j0; j < nv; ++j) {  // the tail, never reading past nv
      float a = 0.0f;
      for (int64_t d = 0; d < D; ++d) a += q[d] * K[d * ld + j];
      s[j] = a;
      mx = a > mx ? a : mx;
    }
    return mx;
  } else {
    float mx = kNegInf;
    for (int64_t j = 0; j < nv; ++j) {
      const float* k = K + j * D;
      float a = 0.0f;
#pragma omp simd reduction(+ : a)
      for (int64_t d = 0; d < D; ++d) a += q[d] * k[d];
      s[j] = a;
      mx = a > mx ? a : mx;
    }
    return mx;
  }
}

// The online-softmax update of one row's (m, l, acc [D]) with the nv scores
// in s (max mx) and the logical V rows.
template <int DT>
inline void softmax_update(float* __restrict s, float mx, const float* __restrict V, int64_t nv,
                           int64_t D_rt, float& m, float& l, float* __restrict acc) {
  const int64_t D = DT > 0 ? DT : D_rt;
  if (!(mx > kNegInf)) return;  // every score -inf (or NaN): nothing to add
  const float m_new = m > mx ? m : mx;
  const float alpha = std::exp(m - m_new);  // 0 when m was -inf
  vf16 vsum{};
  const vf16 vm = vsplat(m_new);
  for (int64_t j0 = 0; j0 < nv; j0 += kLanes) {  // padded lanes hold -inf: p = 0
    const vf16 p = vexp_nonpositive(vload(s + j0) - vm);
    vstore(s + j0, p);
    vsum += p;
  }
  const float sum = hsum(vsum);
  if constexpr (DT > 0 && DT % kLanes == 0) {
    // U keys per step into U accumulator sets: >= 8 independent FMA chains,
    // or the FMA latency (not throughput) would bound the loop.
    constexpr int NV = DT / kLanes;
    constexpr int U = NV >= 8 ? 1 : 8 / NV;
    vf16 av[U][NV];
    const vf16 va = vsplat(alpha);
    for (int c = 0; c < NV; ++c) {
      av[0][c] = vload(acc + c * kLanes) * va;
      for (int u = 1; u < U; ++u) av[u][c] = vf16{};
    }
    int64_t j = 0;
    for (; j + U <= nv; j += U) {
#pragma GCC unroll 8
      for (int u = 0; u < U; ++u) {
        const vf16 pj = vsplat(s[j + u]);
        const float* v = V + (j + u) * DT;
        for (int c = 0; c < NV; ++c) av[u][c] += pj * vload(v + c * kLanes);
      }
    }
    for (; j < nv; ++j) {
      const vf16 pj = vsplat(s[j]);
      const float* v = V + j * DT;
      for (int c = 0; c < NV; ++c) av[0][c] += pj * vload(v + c * kLanes);
    }
    for (int c = 0; c < NV; ++c) {
      for (int u = 1; u < U; ++u) av[0][c] += av[u][c];
      vstore(acc + c * kLanes, av[0][c]);
    }
  } else {
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) acc[d] *= alpha;
    for (int64_t j = 0; j < nv; ++j) {
      const float p = s[j];
      const float* v = V + j * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) acc[d] += p * v[d];
    }
  }
  l = l * alpha + sum;
  m = m_new;
}

// The moments' partial state of one pre-scaled query row:
// m = lse_E = log n + q . k̄, l = 1, acc = o_E = v̄ + C q / max(n, 1), where
// C q is a mat-vec (full), diag(C) ⊙ q (diagonal) or absent (none).
template <int DT>
inline void moments_state(const float* __restrict q, float n, const float* __restrict kbar,
                          const float* __restrict vbar, const float* __restrict C, CovMode mode,
                          int64_t D_rt, float& m, float& l, float* __restrict acc) {
  const int64_t D = DT > 0 ? DT : D_rt;
  const float inv_n = 1.0f / std::max(n, 1.0f);
  float qk = 0.0f;
  if constexpr (DT > 0 && DT % kLanes == 0) {
    constexpr int NV = DT / kLanes;
    vf16 qv[NV];
    vf16 a{};
    for (int c = 0; c < NV; ++c) {
      qv[c] = vload(q + c * kLanes);
      a += qv[c] * vload(kbar + c * kLanes);
    }
    qk = hsum(a);
    for (int64_t dv = 0; dv < DT; dv += kLanes) {  // C's rows are value dims
      vf16 cq{};
      if (mode == CovMode::kFull) {
        cq = dots16<DT>(qv, C + dv * DT, kLanes);
      } else if (mode == CovMode::kDiagonal) {
        cq = vload(C + dv) * qv[dv / kLanes];
      }
      vstore(acc + dv, vload(vbar + dv) + cq * inv_n);
    }
  } else {
#pragma omp simd reduction(+ : qk)
    for (int64_t d = 0; d < D; ++d) qk += q[d] * kbar[d];
    for (int64_t dv = 0; dv < D; ++dv) {
      float cq = 0.0f;
      if (mode == CovMode::kFull) {
        const float* c = C + dv * D;
#pragma omp simd reduction(+ : cq)
        for (int64_t dk = 0; dk < D; ++dk) cq += c[dk] * q[dk];
      } else if (mode == CovMode::kDiagonal) {
        cq = C[dv] * q[dv];
      }
      acc[dv] = vbar[dv] + cq * inv_n;
    }
  }
  m = std::log(n) + qk;
  l = 1.0f;
}

// Thread-local buffers of one worker.
struct Scratch {
  std::vector<float> q, m, l, acc, k, v, s;
  Scratch(int64_t rows, int64_t D, int64_t bs)
      : q(rows * D), m(rows), l(rows), acc(rows * D), k(bs * D), v(bs * D),
        s((bs + kLanes - 1) / kLanes * kLanes) {}
};

// Tokens [first, first + n) of one K or V page as fp32 logical rows (KT =
// false) or fp32 transposed rows (KT = true, leading dimension ld): a
// pointer into the cache when no conversion is needed, else `scratch`.
struct PageRows {
  const float* data;
  int64_t ld;
  bool transposed;
};

template <typename cache_t>
inline PageRows page_rows(const cache_t* page, PageOrder order, const int32_t* offsets,
                          int64_t first, int64_t n, int64_t D, int64_t bs, float* scratch) {
  switch (order) {
    case PageOrder::kLogical:
      if constexpr (std::is_same_v<cache_t, float>) {
        return {page + first * D, D, false};
      } else {
        convert_row(page + first * D, scratch, n * D);
        return {scratch, D, false};
      }
    case PageOrder::kTransposed:
      if constexpr (std::is_same_v<cache_t, float>) {
        return {page + first, bs, true};
      } else {
        for (int64_t d = 0; d < D; ++d) convert_row(page + d * bs + first, scratch + d * n, n);
        return {scratch, n, true};
      }
    case PageOrder::kGeneric:
    default: {
      const int32_t* o = offsets + first * D;
      for (int64_t e = 0; e < n * D; ++e) scratch[e] = to_f32(page[o[e]]);
      return {scratch, D, false};
    }
  }
}

// Transposed V rows (never seen from vLLM, but a table may say so) are
// unpacked to logical ones: softmax_update reads V by rows.
template <typename cache_t>
inline const float* value_rows(const cache_t* page, PageOrder order, const int32_t* offsets,
                               int64_t first, int64_t n, int64_t D, int64_t bs, float* scratch) {
  if (order == PageOrder::kTransposed) order = PageOrder::kGeneric;
  return page_rows(page, order, offsets, first, n, D, bs, scratch).data;
}

template <typename cache_t, typename query_t, int DT>
void run_item(const Params& P, const Group& g, int64_t chunk, const Segment* segs,
              const cache_t* cache, const query_t* query, int64_t q_s0, int64_t q_s1,
              float scale, Scratch& w, float* partials) {
  const int64_t D = P.D, G = P.G;
  const int64_t rows = g.ntok * G;
  float* q = w.q.data();
  float* m = w.m.data();
  float* l = w.l.data();
  float* acc = w.acc.data();

  // Queries of the tile, fp32 times the scale; row = token * G + group member.
  for (int64_t i = 0; i < g.ntok; ++i) {
    for (int64_t j = 0; j < G; ++j) {
      const query_t* src = query + (g.tok0 + i) * q_s0 + (g.head * G + j) * q_s1;
      float* dst = q + (i * G + j) * D;
      for (int64_t d = 0; d < D; ++d) dst[d] = to_f32(src[d]) * scale;
    }
  }

  // Initial state: empty, or the moments' partial state in the first chunk.
  std::fill(m, m + rows, kNegInf);
  std::fill(l, l + rows, 0.0f);
  std::fill(acc, acc + rows * D, 0.0f);
  if (chunk == 0 && g.moment_row >= 0) {
    const int64_t sh = g.moment_row * P.H + g.head;
    const float n = P.count[sh];
    if (n > 0.0f) {
      for (int64_t r = 0; r < rows; ++r) {
        moments_state<DT>(q + r * D, n, P.key_mean + sh * D, P.value_mean + sh * D,
                          P.cross_cov + sh * P.cov_elems, P.cov_mode, D, m[r], l[r],
                          acc + r * D);
      }
    }
  }

  // Segments of this chunk.
  const int64_t nseg = g.seg_end - g.seg_begin;
  const int64_t sb = g.seg_begin + chunk * nseg / g.nchunks;
  const int64_t se = g.seg_begin + (chunk + 1) * nseg / g.nchunks;
  const int64_t last_pos = g.pos0 + g.ntok - 1;
  for (int64_t si = sb; si < se; ++si) {
    const Segment& seg = segs[si];
    if (seg.standard && seg.slot0 > last_pos) continue;  // no query of the tile sees it
    const int64_t n = seg.count;
    const cache_t* kpage = cache + seg.base;
    const cache_t* vpage = kpage + P.page_elems;
    // Compacted pages are logical; standard ones in vLLM's ISA order.
    const PageOrder ko = seg.standard ? P.key_order : PageOrder::kLogical;
    const PageOrder vo = seg.standard ? P.value_order : PageOrder::kLogical;
    if (si + 1 < se) {
      // Head-pages are scattered (a bf16 K page is exactly one 4 KiB OS page)
      // and hardware stream prefetchers stop at 4 KiB boundaries: request the
      // next segment's rows while this one is computed. Measured on the dev
      // machine: -20% time for bf16 caches larger than the L3, +3-5% for
      // ones inside it.
      const Segment& nx = segs[si + 1];
      const int64_t esize = static_cast<int64_t>(sizeof(cache_t));
      // Standard pages are read through the offsets: all of the page.
      const int64_t lo = nx.standard ? 0 : nx.first * D * esize;
      const int64_t hi = nx.standard ? P.page_elems * esize : (nx.first + nx.count) * D * esize;
      const char* next_k = reinterpret_cast<const char*>(cache + nx.base);
      const char* next_v = reinterpret_cast<const char*>(cache + nx.base + P.page_elems);
      for (int64_t b = lo; b < hi; b += 64) {
        __builtin_prefetch(next_k + b);
        __builtin_prefetch(next_v + b);
      }
    }
    const PageRows K = page_rows(kpage, ko, P.key_off, seg.first, n, D, P.bs, w.k.data());
    const float* V = value_rows(vpage, vo, P.value_off, seg.first, n, D, P.bs, w.v.data());
    for (int64_t i = 0; i < g.ntok; ++i) {
      int64_t nv = n;
      if (seg.standard) {  // causal: slot <= position
        nv = std::min<int64_t>(n, g.pos0 + i - seg.slot0 + 1);
        if (nv <= 0) continue;
      }
      for (int64_t j = 0; j < G; ++j) {
        const int64_t r = i * G + j;
        float* s = w.s.data();
        const float mx = K.transposed ? scores<DT, true>(q + r * D, K.data, K.ld, nv, D, s)
                                      : scores<DT, false>(q + r * D, K.data, K.ld, nv, D, s);
        softmax_update<DT>(s, mx, V, nv, D, m[r], l[r], acc + r * D);
      }
    }
  }

  if (g.nchunks == 1) {
    for (int64_t i = 0; i < g.ntok; ++i) {
      for (int64_t j = 0; j < G; ++j) {
        const int64_t r = i * G + j;
        float* o = P.out + (g.tok0 + i) * P.out_s0 + (g.head * G + j) * P.out_s1;
        float* ls = P.lse + (g.tok0 + i) * P.lse_s0 + (g.head * G + j) * P.lse_s1;
        if (l[r] > 0.0f) {
          const float inv = 1.0f / l[r];
          for (int64_t d = 0; d < D; ++d) o[d] = acc[r * D + d] * inv;
          *ls = m[r] + std::log(l[r]);
        } else {
          std::fill(o, o + D, 0.0f);
          *ls = kNegInf;
        }
      }
    }
  } else {
    // Partial of this chunk: [rows] m, [rows] l, [rows, D] acc.
    float* p = partials + g.partial_offset + chunk * rows * (D + 2);
    std::copy(m, m + rows, p);
    std::copy(l, l + rows, p + rows);
    std::copy(acc, acc + rows * D, p + 2 * rows);
  }
}

// Merge the chunks' partials of one group into out / lse.
void merge_group(const Params& P, const Group& g, const float* partials) {
  const int64_t D = P.D, G = P.G;
  const int64_t rows = g.ntok * G;
  const int64_t stride = rows * (D + 2);
  const float* base = partials + g.partial_offset;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / G, j = r % G;
    float* o = P.out + (g.tok0 + i) * P.out_s0 + (g.head * G + j) * P.out_s1;
    float* ls = P.lse + (g.tok0 + i) * P.lse_s0 + (g.head * G + j) * P.lse_s1;
    float mx = kNegInf;
    for (int64_t c = 0; c < g.nchunks; ++c) {
      const float* p = base + c * stride;
      if (p[rows + r] > 0.0f) mx = std::max(mx, p[r]);
    }
    std::fill(o, o + D, 0.0f);
    if (mx == kNegInf) {
      *ls = kNegInf;
      continue;
    }
    float total = 0.0f;
    for (int64_t c = 0; c < g.nchunks; ++c) {
      const float* p = base + c * stride;
      const float lc = p[rows + r];
      if (!(lc > 0.0f)) continue;
      const float w = std::exp(p[r] - mx);
      total += lc * w;
      const float* a = p + 2 * rows + r * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) o[d] += w * a[d];
    }
    const float inv = 1.0f / total;
#pragma omp simd
    for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    *ls = mx + std::log(total);
  }
}

template <typename cache_t, typename query_t, int DT>
void run_all(const Params& P, const std::vector<Group>& groups, const std::vector<Item>& items,
             const std::vector<Segment>& segs, const cache_t* cache, const query_t* query,
             int64_t q_s0, int64_t q_s1, float scale, float* partials, int64_t max_rows) {
  // Dynamic scheduling on torch's thread pool: each worker pulls the next
  // item (sorted most expensive first) from a shared counter.
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_items));
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      Scratch w(max_rows, P.D, P.bs);
      for (int64_t it = next.fetch_add(1); it < num_items; it = next.fetch_add(1)) {
        const Item& item = items[it];
        run_item<cache_t, query_t, DT>(P, groups[item.group], item.chunk, segs.data(), cache,
                                       query, q_s0, q_s1, scale, w, partials);
      }
    }
  });
}

template <typename cache_t, typename query_t>
void dispatch_dim(const Params& P, const std::vector<Group>& groups,
                  const std::vector<Item>& items, const std::vector<Segment>& segs,
                  const cache_t* cache, const query_t* query, int64_t q_s0, int64_t q_s1,
                  float scale, float* partials, int64_t max_rows) {
#define KVEVICT_RUN(DT) \
  run_all<cache_t, query_t, DT>(P, groups, items, segs, cache, query, q_s0, q_s1, scale, \
                                partials, max_rows)
  switch (P.D) {
    case 32: KVEVICT_RUN(32); break;
    case 64: KVEVICT_RUN(64); break;
    case 80: KVEVICT_RUN(80); break;
    case 96: KVEVICT_RUN(96); break;
    case 128: KVEVICT_RUN(128); break;
    case 256: KVEVICT_RUN(256); break;
    default: KVEVICT_RUN(0); break;
  }
#undef KVEVICT_RUN
}

template <typename cache_t>
void dispatch_query(const at::Tensor& query, const Params& P, const std::vector<Group>& groups,
                    const std::vector<Item>& items, const std::vector<Segment>& segs,
                    const cache_t* cache, float scale, float* partials, int64_t max_rows) {
  const int64_t s0 = query.stride(0), s1 = query.stride(1);
  switch (query.scalar_type()) {
    case at::kFloat:
      dispatch_dim<cache_t, float>(P, groups, items, segs, cache, query.data_ptr<float>(), s0, s1,
                                   scale, partials, max_rows);
      break;
    case at::kBFloat16:
      dispatch_dim<cache_t, c10::BFloat16>(P, groups, items, segs, cache,
                                           query.data_ptr<c10::BFloat16>(), s0, s1, scale,
                                           partials, max_rows);
      break;
    case at::kHalf:
      dispatch_dim<cache_t, c10::Half>(P, groups, items, segs, cache,
                                       query.data_ptr<c10::Half>(), s0, s1, scale, partials,
                                       max_rows);
      break;
    default:
      TORCH_CHECK(false, "query must be float32, bfloat16 or float16, got ", query.scalar_type());
  }
}

// The offset table as int32, validated (every entry inside the page) and
// classified, in one pass.
OffsetTable checked_offsets(const at::Tensor& t, int64_t bs, int64_t D, const char* name) {
  const int64_t size = bs * D;
  TORCH_CHECK(t.numel() == size, name, " must have block_size * head_dim = ", size,
              " entries, got ", t.numel());
  const IntView v = int_view(t, name);
  OffsetTable table{std::vector<int32_t>(size), PageOrder::kGeneric};
  bool logical = true, transposed = true;
  for (int64_t tok = 0; tok < bs; ++tok) {
    for (int64_t d = 0; d < D; ++d) {
      const int64_t i = tok * D + d;
      const int64_t o = v[i];
      TORCH_CHECK(o >= 0 && o < size, name, "[", i, "] = ", o, " is outside the page");
      table.offsets[i] = static_cast<int32_t>(o);
      logical &= o == i;
      transposed &= o == d * bs + tok;
    }
  }
  table.order = logical ? PageOrder::kLogical
                        : (transposed ? PageOrder::kTransposed : PageOrder::kGeneric);
  return table;
}

}  // namespace

// out [T, Hq, D] and lse [T, Hq] (fp32) are written for every token, 0 / -inf
// where a head has nothing to read and for tokens outside every request.
void head_paged_attention(const at::Tensor& query, const at::Tensor& kv_cache,
                          const at::Tensor& query_start_loc, const at::Tensor& seq_lens,
                          const at::Tensor& head_page_table, const at::Tensor& head_lens,
                          const at::Tensor& block_table, const at::Tensor& region_start,
                          const at::Tensor& key_offsets, const at::Tensor& value_offsets,
                          double scale, const std::optional<at::Tensor>& moment_count,
                          const std::optional<at::Tensor>& moment_key_mean,
                          const std::optional<at::Tensor>& moment_value_mean,
                          const std::optional<at::Tensor>& moment_cross_cov,
                          const std::optional<at::Tensor>& moment_rows, at::Tensor& out,
                          at::Tensor& lse, const std::optional<at::Tensor>& prefix_lens) {
  // ---- shapes and dtypes
  TORCH_CHECK(query.dim() == 3 && query.device().is_cpu(), "query must be a CPU [T, Hq, D] tensor");
  TORCH_CHECK(query.stride(2) == 1, "query's last dimension must be contiguous");
  TORCH_CHECK(kv_cache.dim() == 4 && kv_cache.device().is_cpu() && kv_cache.is_contiguous(),
              "kv_cache must be a contiguous CPU [num_blocks, H, 2 * block_size, D] tensor");
  const int64_t T = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t NB = kv_cache.size(0), H = kv_cache.size(1);
  TORCH_CHECK(kv_cache.size(2) % 2 == 0, "kv_cache dim 2 must be 2 * block_size");
  const int64_t bs = kv_cache.size(2) / 2;
  TORCH_CHECK(kv_cache.size(3) == D, "kv_cache head_dim ", kv_cache.size(3), " != query's ", D);
  TORCH_CHECK(H > 0 && Hq % H == 0, "query heads ", Hq, " not a multiple of KV heads ", H);
  const int64_t G = Hq / H;
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.dim() == 3 && out.size(0) == T &&
                  out.size(1) == Hq && out.size(2) == D && out.stride(2) == 1,
              "out must be float32 [T, Hq, D] with a contiguous last dimension");
  TORCH_CHECK(lse.scalar_type() == at::kFloat && lse.dim() == 2 && lse.size(0) == T &&
                  lse.size(1) == Hq,
              "lse must be float32 [T, Hq]");
  TORCH_CHECK(out.device().is_cpu() && lse.device().is_cpu(), "out and lse must be CPU tensors");
  const int64_t R = query_start_loc.numel() - 1;
  TORCH_CHECK(R >= 0, "query_start_loc must have R + 1 entries");
  TORCH_CHECK(seq_lens.numel() == R && region_start.numel() == R,
              "seq_lens and region_start must have R entries");
  TORCH_CHECK(head_lens.dim() == 2 && head_lens.size(0) == R && head_lens.size(1) == H,
              "head_lens must be [R, H]");
  TORCH_CHECK(head_page_table.dim() == 3 && head_page_table.size(0) == R &&
                  head_page_table.size(1) == H,
              "head_page_table must be [R, H, max_pages]");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == R,
              "block_table must be [R, max_blocks]");
  const int64_t max_pages = head_page_table.size(2), max_blocks = block_table.size(1);

  const IntView qsl = int_view(query_start_loc, "query_start_loc");
  const IntView sl = int_view(seq_lens, "seq_lens");
  const IntView rs = int_view(region_start, "region_start");
  const IntView hl = int_view(head_lens, "head_lens");
  const IntView hpt = int_view(head_page_table, "head_page_table");
  const IntView bt = int_view(block_table, "block_table");
  const bool has_prefix = prefix_lens.has_value() && prefix_lens->defined();
  IntView pl;
  if (has_prefix) {
    TORCH_CHECK(prefix_lens->numel() == R, "prefix_lens must have R entries");
    pl = int_view(*prefix_lens, "prefix_lens");
  }
  const OffsetTable ko = checked_offsets(key_offsets, bs, D, "key_offsets");
  const OffsetTable vo = checked_offsets(value_offsets, bs, D, "value_offsets");

  Params P{};
  P.D = D;
  P.bs = bs;
  P.G = G;
  P.Hq = Hq;
  P.H = H;
  P.page_elems = bs * D;
  P.key_order = ko.order;
  P.value_order = vo.order;
  P.key_off = ko.offsets.data();
  P.value_off = vo.offsets.data();
  P.out = out.data_ptr<float>();
  P.out_s0 = out.stride(0);
  P.out_s1 = out.stride(1);
  P.lse = lse.data_ptr<float>();
  P.lse_s0 = lse.stride(0);
  P.lse_s1 = lse.stride(1);

  const bool has_moments = moment_count.has_value() && moment_count->defined();
  IntView srows;
  int64_t num_moment_rows = 0;
  if (has_moments) {
    TORCH_CHECK(moment_key_mean.has_value() && moment_value_mean.has_value() &&
                    moment_cross_cov.has_value() && moment_rows.has_value(),
                "the moments need count, key_mean, value_mean, cross_cov and moment_rows");
    const at::Tensor& c = *moment_count;
    const at::Tensor& km = *moment_key_mean;
    const at::Tensor& vm = *moment_value_mean;
    const at::Tensor& cc = *moment_cross_cov;
    for (const at::Tensor* t : {&c, &km, &vm, &cc}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->device().is_cpu(),
                  "moment tensors must be contiguous float32 CPU tensors");
    }
    num_moment_rows = c.size(0);
    TORCH_CHECK(c.dim() == 2 && c.size(1) == H, "moment count must be [N, H]");
    TORCH_CHECK(km.dim() == 3 && km.size(0) == num_moment_rows && km.size(1) == H &&
                    km.size(2) == D,
                "moment key_mean must be [N, H, D]");
    TORCH_CHECK(vm.sizes() == km.sizes(), "moment value_mean must be [N, H, D]");
    TORCH_CHECK(cc.dim() >= 3 && cc.size(0) == num_moment_rows && cc.size(1) == H,
                "moment cross_cov must be [N, H, ...]");
    if (cc.dim() == 4 && cc.size(2) == D && cc.size(3) == D) {
      P.cov_mode = CovMode::kFull;
      P.cov_elems = D * D;
    } else if (cc.dim() == 3 && cc.size(2) == D) {
      P.cov_mode = CovMode::kDiagonal;
      P.cov_elems = D;
    } else if (cc.dim() == 3 && cc.size(2) == 0) {
      P.cov_mode = CovMode::kNone;
      P.cov_elems = 0;
    } else {
      TORCH_CHECK(false, "moment cross_cov must be [N, H, D, D] (full), [N, H, D] (diagonal) "
                  "or [N, H, 0] (none)");
    }
    TORCH_CHECK(moment_rows->numel() == R, "moment_rows must have R entries");
    srows = int_view(*moment_rows, "moment_rows");
    P.count = c.data_ptr<float>();
    P.key_mean = km.data_ptr<float>();
    P.value_mean = vm.data_ptr<float>();
    P.cross_cov = cc.data_ptr<float>();
  }

  // ---- plan: segments of every (request, head), groups, items (validated
  // here, serially, so that the parallel part never throws).
  TORCH_CHECK(R == 0 || (qsl[0] >= 0 && qsl[R] <= T), "query_start_loc outside [0, T]");
  std::vector<Segment> segs;
  std::vector<Group> groups;
  int64_t max_rows = 1;
  for (int64_t r = 0; r < R; ++r) {
    const int64_t first = qsl[r], last = qsl[r + 1];
    TORCH_CHECK(last >= first, "query_start_loc must be non-decreasing");
    if (last == first) continue;
    const int64_t seq_len = sl[r], start = rs[r];
    TORCH_CHECK(seq_len >= last - first, "request ", r, ": seq_len ", seq_len, " < its ",
                last - first, " queries");
    TORCH_CHECK(start >= 0 && start <= seq_len, "request ", r, ": region_start ", start,
                " outside [0, seq_len]");
    TORCH_CHECK(start == seq_len || (seq_len - 1) / bs < max_blocks, "request ", r,
                ": seq_len ", seq_len, " needs more blocks than block_table has");
    const int64_t moment_row = has_moments ? srows[r] : -1;
    TORCH_CHECK(moment_row >= -1 && moment_row < num_moment_rows, "request ", r,
                ": moment row ", moment_row, " out of range");
    const int64_t prefix = has_prefix ? pl[r] : 0;
    TORCH_CHECK(prefix >= 0 && prefix <= std::min(start, seq_len - (last - first)), "request ", r,
                ": prefix_lens ", prefix, " must lie before its region and its queries");
    TORCH_CHECK(prefix == 0 || (prefix - 1) / bs < max_blocks, "request ", r, ": prefix_lens ",
                prefix, " needs more blocks than block_table has");
    for (int64_t h = 0; h < H; ++h) {
      const int64_t seg_begin = static_cast<int64_t>(segs.size());
      // The protected prefix: standard slots [0, prefix), before every query.
      for (int64_t b = 0; b * bs < prefix; ++b) {
        const int64_t block = bt[r * max_blocks + b];
        TORCH_CHECK(block >= 0 && block < NB, "request ", r, ": block id ", block,
                    " outside [0, ", NB, ")");
        segs.push_back({(block * H + h) * 2 * bs * D, 0,
                        static_cast<int32_t>(std::min(bs, prefix - b * bs)), b * bs, true});
      }
      const int64_t length = hl[r * H + h];
      TORCH_CHECK(length >= 0 && length <= max_pages * bs, "request ", r, " head ", h,
                  ": head_lens ", length, " exceeds its page table");
      for (int64_t i = 0; i * bs < length; ++i) {
        const int64_t page = hpt[(r * H + h) * max_pages + i];
        TORCH_CHECK(page >= 0 && page < NB * H, "request ", r, " head ", h, ": head-page id ",
                    page, " outside [0, ", NB * H, ")");
        segs.push_back({page * 2 * bs * D, 0, static_cast<int32_t>(std::min(bs, length - i * bs)),
                        -1, false});
      }
      for (int64_t b = start / bs; b * bs < seq_len && start < seq_len; ++b) {
        const int64_t block = bt[r * max_blocks + b];
        TORCH_CHECK(block >= 0 && block < NB, "request ", r, ": block id ", block,
                    " outside [0, ", NB, ")");
        const int64_t lo = std::max(start, b * bs), hi = std::min(seq_len, (b + 1) * bs);
        segs.push_back({(block * H + h) * 2 * bs * D, static_cast<int32_t>(lo - b * bs),
                        static_cast<int32_t>(hi - lo), lo, true});
      }
      const int64_t seg_end = static_cast<int64_t>(segs.size());
      for (int64_t tok = first; tok < last; tok += kTileTokens) {
        Group g{};
        g.head = h;
        g.tok0 = tok;
        g.ntok = std::min(kTileTokens, last - tok);
        g.pos0 = seq_len - (last - first) + (tok - first);
        g.seg_begin = seg_begin;
        // Standard segments past the tile's last position are invisible to it.
        int64_t e = seg_end;
        const int64_t last_pos = g.pos0 + g.ntok - 1;
        while (e > seg_begin && segs[e - 1].standard && segs[e - 1].slot0 > last_pos) --e;
        g.seg_end = e;
        g.moment_row = moment_row;
        g.nchunks = 1;
        max_rows = std::max(max_rows, g.ntok * G);
        groups.push_back(g);
      }
    }
  }

  // Tokens outside every request: 0 / -inf, like the reference.
  const int64_t covered_begin = R > 0 ? qsl[0] : 0, covered_end = R > 0 ? qsl[R] : 0;
  for (int64_t t = 0; t < T; ++t) {
    if (t >= covered_begin && t < covered_end) continue;
    for (int64_t j = 0; j < Hq; ++j) {
      std::fill(P.out + t * P.out_s0 + j * P.out_s1, P.out + t * P.out_s0 + j * P.out_s1 + D, 0.0f);
      P.lse[t * P.lse_s0 + j * P.lse_s1] = kNegInf;
    }
  }
  if (groups.empty()) return;

  // Split-KV only where the groups alone cannot keep every thread busy:
  // aim at ~8 items per thread (dynamic scheduling evens them out), chunks
  // of at least kMinChunkPages pages.
  const int64_t threads = at::get_num_threads();
  std::vector<int64_t> cost(groups.size());
  int64_t total_cost = 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    const Group& g = groups[i];
    int64_t tokens = 0;
    for (int64_t s = g.seg_begin; s < g.seg_end; ++s) tokens += segs[s].count;
    cost[i] = g.ntok * G * (tokens + 1);
    total_cost += cost[i];
  }
  std::vector<Item> items;
  int64_t partial_floats = 0;
  const int64_t target = threads > 1 ? std::max<int64_t>(1, total_cost / (8 * threads)) : 0;
  for (size_t i = 0; i < groups.size(); ++i) {
    Group& g = groups[i];
    const int64_t nseg = g.seg_end - g.seg_begin;
    if (target > 0 && cost[i] > target) {
      const int64_t by_cost = (cost[i] + target - 1) / target;
      g.nchunks = std::max<int64_t>(1, std::min(by_cost, nseg / kMinChunkPages));
    }
    if (g.nchunks > 1) {
      g.partial_offset = partial_floats;
      partial_floats += g.nchunks * g.ntok * G * (D + 2);
    }
    for (int64_t c = 0; c < g.nchunks; ++c) {
      items.push_back({static_cast<int64_t>(i), c, cost[i] / g.nchunks});
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<float> partials(partial_floats);

  const float fscale = static_cast<float>(scale);
  switch (kv_cache.scalar_type()) {
    case at::kFloat:
      dispatch_query<float>(query, P, groups, items, segs, kv_cache.data_ptr<float>(), fscale,
                            partials.data(), max_rows);
      break;
    case at::kBFloat16:
      dispatch_query<c10::BFloat16>(query, P, groups, items, segs,
                                    kv_cache.data_ptr<c10::BFloat16>(), fscale, partials.data(),
                                    max_rows);
      break;
    case at::kHalf:
      dispatch_query<c10::Half>(query, P, groups, items, segs, kv_cache.data_ptr<c10::Half>(),
                                fscale, partials.data(), max_rows);
      break;
    default:
      TORCH_CHECK(false, "kv_cache must be float32, bfloat16 or float16, got ",
                  kv_cache.scalar_type());
  }

  if (partial_floats > 0) {
    std::vector<int64_t> split;
    for (size_t i = 0; i < groups.size(); ++i) {
      if (groups[i].nchunks > 1) split.push_back(static_cast<int64_t>(i));
    }
    at::parallel_for(0, static_cast<int64_t>(split.size()), 1, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) merge_group(P, groups[split[i]], partials.data());
    });
  }
}
