"""Training what the policies learn (retention gates); transformers, not vLLM."""
