"""Eviction policies. Each is a small dataclass whose ``score()`` is its paper's
equation; none of them imports vLLM."""

from __future__ import annotations

from typing import Any

from vllm_kvevict.policies.base import EvictionPolicy, RotaryFrequencies, ScoringInputs
from vllm_kvevict.policies.criticalkv import CriticalKVPolicy
from vllm_kvevict.policies.defensivekv import DefensiveKVPolicy, LayerDefensiveKVPolicy
from vllm_kvevict.policies.expected_attention import ExpectedAttentionPolicy
from vllm_kvevict.policies.h2o import H2OPolicy
from vllm_kvevict.policies.keydiff import KeyDiffPolicy
from vllm_kvevict.policies.knorm import KnormPolicy
from vllm_kvevict.policies.kvzip import KVzipPolicy
from vllm_kvevict.policies.momentkv import MomentKVPolicy
from vllm_kvevict.policies.options import build_with_options, option_fields
from vllm_kvevict.policies.pyramidkv import PyramidKVPolicy
from vllm_kvevict.policies.random_policy import RandomPolicy
from vllm_kvevict.policies.retention_gate import LearnedRetentionPolicy
from vllm_kvevict.policies.snapkv import SnapKVPolicy
from vllm_kvevict.policies.streaming_llm import StreamingLLMPolicy
from vllm_kvevict.policies.tova import TOVAPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {
    cls.name: cls
    for cls in (
        StreamingLLMPolicy, SnapKVPolicy, KeyDiffPolicy, KnormPolicy, TOVAPolicy, MomentKVPolicy,
        ExpectedAttentionPolicy, CriticalKVPolicy, H2OPolicy, RandomPolicy, LearnedRetentionPolicy,
        PyramidKVPolicy, DefensiveKVPolicy, LayerDefensiveKVPolicy, KVzipPolicy,
    )
}


def policy_options(name: str) -> dict[str, Any]:
    """The options a policy accepts, with their defaults."""
    return option_fields(POLICIES[name])


def make_policy(name: str, options: dict[str, Any] | None = None) -> EvictionPolicy:
    """Build a policy by name; raise ``ValueError`` naming the fix on bad input
    (an unknown policy or option, an option of the wrong type or value)."""
    if name not in POLICIES:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}"
        )
    return build_with_options(POLICIES[name], name, options)


__all__ = [
    "POLICIES",
    "CriticalKVPolicy",
    "DefensiveKVPolicy",
    "EvictionPolicy",
    "ExpectedAttentionPolicy",
    "H2OPolicy",
    "KeyDiffPolicy",
    "KVzipPolicy",
    "KnormPolicy",
    "LayerDefensiveKVPolicy",
    "LearnedRetentionPolicy",
    "MomentKVPolicy",
    "PyramidKVPolicy",
    "RandomPolicy",
    "RotaryFrequencies",
    "ScoringInputs",
    "SnapKVPolicy",
    "StreamingLLMPolicy",
    "TOVAPolicy",
    "make_policy",
    "policy_options",
]
