// The extension's Python module: the kernels of head_paged_attention.cpp,
// compact_head_pages.cpp and select_top.cpp, built together into one
// extension by vllm_kvevict/cpu_ops.py (one build, one cache entry).
//
// Only this file includes pybind11 and torch's tensor casters
// (torch/csrc/utils/pybind.h, ~15 s to compile); the kernels include ATen's
// core headers. torch/extension.h (torch's whole C++ API) took ~40 s per
// file that included it.

#include <ATen/core/Tensor.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <cstdint>
#include <optional>

// head_paged_attention.cpp
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
                          at::Tensor& lse, const std::optional<at::Tensor>& prefix_lens);

// compact_head_pages.cpp
void gather_heads(const at::Tensor& kv_cache, const at::Tensor& head_pages,
                  const at::Tensor& head_lens, const at::Tensor& block_row, int64_t start,
                  int64_t end, const at::Tensor& key_offsets, const at::Tensor& value_offsets,
                  at::Tensor& keys, at::Tensor& values);
void write_heads(at::Tensor& kv_cache, const at::Tensor& keys, const at::Tensor& values,
                 const at::Tensor& kept, const at::Tensor& counts, const at::Tensor& page_table);

// select_top.cpp
at::Tensor top_k_mask(const at::Tensor& scores, const at::Tensor& k);
at::Tensor top_k_indices(const at::Tensor& scores, const at::Tensor& k);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "vllm-kvevict CPU kernels";
  m.def("head_paged_attention", &head_paged_attention,
        "Attention over per-(request, KV-head) page tables with the evicted-token moments",
        py::arg("query"), py::arg("kv_cache"), py::arg("query_start_loc"), py::arg("seq_lens"),
        py::arg("head_page_table"), py::arg("head_lens"), py::arg("block_table"),
        py::arg("region_start"), py::arg("key_offsets"), py::arg("value_offsets"),
        py::arg("scale"), py::arg("moment_count"), py::arg("moment_key_mean"),
        py::arg("moment_value_mean"), py::arg("moment_cross_cov"), py::arg("moment_rows"),
        py::arg("out"), py::arg("lse"), py::arg("prefix_lens") = py::none(),
        py::call_guard<py::gil_scoped_release>());
  m.def("gather_heads", &gather_heads,
        "Each KV head's compacted tokens, then its standard slots [start, end), into dense "
        "[H, S, D] keys and values",
        py::arg("kv_cache"), py::arg("head_pages"), py::arg("head_lens"), py::arg("block_row"),
        py::arg("start"), py::arg("end"), py::arg("key_offsets"), py::arg("value_offsets"),
        py::arg("keys"), py::arg("values"), py::call_guard<py::gil_scoped_release>());
  m.def("write_heads", &write_heads,
        "Each KV head's kept rows of dense keys and values into its new head-pages, in order",
        py::arg("kv_cache"), py::arg("keys"), py::arg("values"), py::arg("kept"),
        py::arg("counts"), py::arg("page_table"), py::call_guard<py::gil_scoped_release>());
  m.def("top_k_mask", &top_k_mask,
        "[R, N] bool: each row's first k[r] entries by score descending, ties to the lower index",
        py::arg("scores"), py::arg("k"));
  m.def("top_k_indices", &top_k_indices,
        "The same entries as indices, ascending, -1 padded to [R, max k]",
        py::arg("scores"), py::arg("k"));
}
