"""The KV-cache spec of evicting layers, the contract between the workers and
the scheduler.

The worker's backend turns every ``FullAttentionSpec`` into an
:class:`EvictingAttentionSpec` (``customize_spec``); vLLM pickles it to the
engine core, whose ``KVCacheSpecRegistry`` builds the scheduler's
:class:`~vllm_kvevict.plugin.scheduler.manager.EvictionManager` for the group.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

from vllm.v1.kv_cache_interface import AttentionSpec, FullAttentionSpec

from vllm_kvevict.schedule import EvictionSchedule, cdiv

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True, kw_only=True)
class EvictingAttentionSpec(FullAttentionSpec):
    """A full-attention layer whose requests keep at most a budget of tokens.

    It pickles from the worker to the engine core and compares by value, like
    every vLLM spec. The schedule's block size is the spec's: vLLM rebuilds
    specs with another block size (``dataclasses.replace``), and the schedule
    follows.
    """

    schedule: EvictionSchedule
    max_step_tokens: int
    """Most tokens one request processes in a step (vLLM's in-flight limit)."""
    metric_labels: tuple[tuple[str, str], ...] = ()
    """Prometheus labels (model_name, engine, policy) of the engine core's series."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.schedule.block_size != self.block_size:
            object.__setattr__(self, "schedule", replace(self.schedule, block_size=self.block_size))

    @property
    def prefix_cacheable(self) -> bool:
        # Compaction rewrites blocks in place: their contents no longer match
        # any prefix hash, so they must never be shared or looked up; only a
        # protected prefix is (EvictionManager.cache_blocks hashes no other).
        return self.schedule.max_protected_prefix > 0

    def max_blocks_per_request(self, max_model_len: int) -> int:
        full = cdiv(max_model_len, self.block_size)
        bound = self.schedule.max_blocks_per_request(self.max_step_tokens)
        return full if bound is None else min(full, bound)

    def max_memory_usage_bytes(self, vllm_config: VllmConfig) -> int:
        # What one request can hold at once, so vLLM's start-up check admits a
        # max_model_len whose full KV cache would not fit in memory.
        max_model_len = vllm_config.model_config.max_model_len
        return self.max_blocks_per_request(max_model_len) * self.page_size_bytes

    @classmethod
    def merge(cls, specs: list[EvictingAttentionSpec]) -> EvictingAttentionSpec:  # type: ignore[override]
        # FullAttentionSpec.merge rebuilds the base class from its own fields
        # and would silently drop ours (and with them, eviction).
        extra = {(s.schedule, s.max_step_tokens, s.metric_labels) for s in specs}
        if len(extra) != 1:
            raise ValueError(f"layers of one KV cache group disagree on eviction: {extra}")
        base = FullAttentionSpec.merge(specs)  # type: ignore[arg-type]
        return cls.from_full_attention(base, *extra.pop())

    @classmethod
    def from_full_attention(
        cls,
        spec: FullAttentionSpec,
        schedule: EvictionSchedule,
        max_step_tokens: int,
        metric_labels: tuple[tuple[str, str], ...] = (),
    ) -> EvictingAttentionSpec:
        values = {f.name: getattr(spec, f.name) for f in fields(FullAttentionSpec) if f.init}
        return cls(
            **values,
            schedule=schedule,
            max_step_tokens=max_step_tokens,
            metric_labels=metric_labels,
        )


def is_plain_full_attention(spec: AttentionSpec) -> bool:
    return type(spec) is FullAttentionSpec
