"""Eviction policies. Each is a small dataclass whose ``score()`` is its paper's
equation; none of them imports vLLM."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_kvevict.policies.base import EvictionPolicy, RotaryFrequencies, ScoringInputs
from vllm_kvevict.policies.criticalkv import CriticalKVPolicy
from vllm_kvevict.policies.expected_attention import ExpectedAttentionPolicy
from vllm_kvevict.policies.h2o import H2OPolicy
from vllm_kvevict.policies.keydiff import KeyDiffPolicy
from vllm_kvevict.policies.knorm import KnormPolicy
from vllm_kvevict.policies.momentkv import MomentKVPolicy
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
        PyramidKVPolicy,
    )
}


def policy_options(name: str) -> dict[str, Any]:
    """The options a policy accepts, with their defaults."""
    return {
        f.name: f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        for f in dataclasses.fields(POLICIES[name])
    }


def make_policy(name: str, options: dict[str, Any] | None = None) -> EvictionPolicy:
    """Build a policy by name; raise ``ValueError`` naming the fix on bad input."""
    if name not in POLICIES:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of: {', '.join(sorted(POLICIES))}"
        )
    options = dict(options or {})
    accepted = policy_options(name)
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        hint = ", ".join(sorted(accepted)) or "none"
        raise ValueError(
            f"policy {name!r} has no option {', '.join(map(repr, unknown))}; "
            f"its options are: {hint}"
        )
    return POLICIES[name](**options)


__all__ = [
    "POLICIES",
    "CriticalKVPolicy",
    "EvictionPolicy",
    "ExpectedAttentionPolicy",
    "H2OPolicy",
    "KeyDiffPolicy",
    "KnormPolicy",
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
