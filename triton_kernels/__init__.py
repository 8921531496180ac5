"""Kernels over the retained pages, each beside its torch reference.

Installed as ``vllm_kvevict.triton_kernels`` (a top-level ``triton_kernels``
package would shadow the one vLLM imports). Kernels know nothing of policies:
they gather, scatter and attend over block tables.
"""
