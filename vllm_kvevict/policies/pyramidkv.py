from __future__ import annotations

from dataclasses import dataclass

from vllm_kvevict.policies.snapkv import SnapKVPolicy


@dataclass
class PyramidKVPolicy(SnapKVPolicy):
    """PyramidKV (Cai et al., 2024, "PyramidKV: Dynamic KV Cache Compression
    based on Pyramidal Information Funneling"): SnapKV's scores (the attention
    of the last ``observation_window`` queries, pooled along the sequence),
    kept under per-layer budgets that fall linearly with depth, because
    attention in the first layers is spread over the whole context and in the
    last ones concentrated on a few tokens. The layer budgets are the
    ``pyramid`` head budget
    (:class:`~vllm_kvevict.eviction.allocation.PyramidAllocation`, ``pyramid_beta``),
    this policy's default; the request holds what SnapKV's uniform budget
    holds. Like SnapKV it evicts at the end of the prompt by default.
    """

    name = "pyramidkv"
    default_head_budget = "pyramid"
