"""C++ sources of vllm-kvevict's CPU kernels, shipped as package data
(``vllm_kvevict.csrc``) and JIT-built by :mod:`vllm_kvevict.cpu_ops`."""
