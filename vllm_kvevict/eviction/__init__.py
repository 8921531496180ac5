"""The eviction engine: which tokens a request keeps, and where they go.

No vLLM imports and no device assumptions: plain torch on any device. Policies
score tokens (:mod:`vllm_kvevict.policies`); this package turns their scores
into kept tokens and moves them, through a small cache-operations interface
that each attention backend implements for its device and page layout.
"""
