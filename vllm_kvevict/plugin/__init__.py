"""The thin layer that plugs eviction into vLLM 0.32 (pinned in ``compat``)."""
