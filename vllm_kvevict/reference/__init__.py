"""Reference implementations that run outside vLLM (oracles for the plugin)."""

from vllm_kvevict.reference.hf_decoder import ReferenceEvictingDecoder

__all__ = ["ReferenceEvictingDecoder"]
