"""Scheduler side, in process: EvictingAttentionSpec and EvictionManager on a
real vLLM BlockPool, checked against the schedule's arithmetic."""

from __future__ import annotations

import dataclasses
import pickle
import random

import pytest
import torch

pytest.importorskip("vllm")

from vllm.v1.core.block_pool import BlockPool  # noqa: E402
from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry  # noqa: E402

from vllm_kvevict.schedule import EvictionSchedule, cdiv  # noqa: E402
from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec  # noqa: E402
from vllm_kvevict.plugin.scheduler.manager import EvictionManager, register_spec  # noqa: E402


def make_spec(prefill_mode: str = "per_chunk", budget: int = 100, decode_interval: int = 8,
              step: int = 64, protected: int = 0) -> EvictingAttentionSpec:
    return EvictingAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32,
        schedule=EvictionSchedule(
            budget=budget, decode_interval=decode_interval, block_size=16,
            prefill_mode=prefill_mode,  # type: ignore[arg-type]
            # as customize_spec sets it by default: one scheduler step
            prefill_interval=step,
            max_protected_prefix=protected,
        ),
        max_step_tokens=step,
    )


def make_manager(spec: EvictingAttentionSpec, num_blocks: int = 400) -> EvictionManager:
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=16)
    return EvictionManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0,
        scheduler_block_size=16,
    )


def series(manager: EvictionManager, sample: str, **labels: str) -> float:
    """A sample of the manager's own Prometheus registry (0 when absent)."""
    for metric in manager.metrics.registry.collect():
        for s in metric.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_registry_resolves_our_manager_and_merge_keeps_fields():
    register_spec()
    spec = make_spec("end_of_prompt")
    assert KVCacheSpecRegistry.get_manager_class(spec) is EvictionManager
    merged = EvictingAttentionSpec.merge([spec, spec])
    assert merged == spec and merged.schedule.prefill_mode == "end_of_prompt"
    assert not spec.prefix_cacheable
    with pytest.raises(ValueError, match="disagree"):
        EvictingAttentionSpec.merge([spec, make_spec(budget=200)])


def test_spec_pickles_compares_by_value_and_keeps_the_schedule_at_its_block_size():
    spec = make_spec("hybrid")
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert hash(make_spec("hybrid")) == hash(spec)
    assert spec != make_spec("hybrid", decode_interval=9)
    # vLLM rebuilds specs with another block size (kernel blocks, page unification).
    for smaller in (spec.copy_with_new_block_size(8), dataclasses.replace(spec, block_size=8)):
        assert smaller.schedule == dataclasses.replace(spec.schedule, block_size=8)
        assert smaller.max_step_tokens == spec.max_step_tokens


@pytest.mark.parametrize("protected", [0, 100])
@pytest.mark.parametrize("seed", range(5))
def test_manager_frees_exactly_the_blocks_below_the_frontier(seed, protected):
    """Drive the manager like vLLM's allocate_slots does (free on the processed
    basis, then allocate the next step) and compare with the schedule: every
    block between the protected prefix (96 tokens of at most 100: six blocks)
    and the frontier is freed, no other."""
    rng = random.Random(seed)
    spec = make_spec(protected=protected)
    prefix_blocks = protected // 16
    assert spec.prefix_cacheable == bool(protected)
    schedule = spec.schedule
    manager = make_manager(spec)
    pool = manager.block_pool
    prompt_len, decode_steps = rng.randint(150, 700), rng.randint(10, 60)
    n, req = 0, "r"
    expected_free_points, freed_blocks, peak = [], prefix_blocks, 0
    while n < prompt_len + decode_steps:
        step = min(rng.randint(1, 64), prompt_len - n) if n < prompt_len else 1
        manager.remove_skipped_blocks(req, n, prompt_len)
        last_processed = n
        # What the metrics say against the schedule: the tokens between the
        # protected prefix and the frontier are dropped; without eviction the
        # request would hold every processed token's block.
        assert series(manager, "kvevict_tokens_evicted_total") == schedule.frontier(n, prompt_len) - prefix_blocks * 16
        assert series(manager, "kvevict_blocks_held_without_eviction") == cdiv(n, 16)
        if n and schedule.frontier(n, prompt_len) // 16 > freed_blocks:
            freed_blocks = schedule.frontier(n, prompt_len) // 16
            expected_free_points.append(n)
        manager.allocate_new_blocks(req, n + step, n + step)
        blocks = manager.req_to_blocks[req]
        frontier_blocks = schedule.frontier(n, prompt_len) // 16
        assert frontier_blocks >= prefix_blocks
        assert not any(b.is_null for b in blocks[:prefix_blocks])
        assert all(b.is_null for b in blocks[prefix_blocks:frontier_blocks])
        assert not any(b.is_null for b in blocks[frontier_blocks:])
        held = len(blocks) - frontier_blocks + prefix_blocks
        peak = max(peak, held)
        assert held == cdiv(n + step, 16) - frontier_blocks + prefix_blocks
        assert held <= manager.max_admission_blocks_per_request
        assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1 - held
        assert manager.stats.protected_prefix_blocks == min(prefix_blocks, len(blocks))
        n += step
    assert manager.stats.blocks_freed_by_eviction == (
        schedule.frontier(last_processed, prompt_len) // 16 - prefix_blocks
    )
    assert manager.stats.blocks_freed_by_eviction > 0
    manager.free(req)
    assert pool.get_num_free_blocks() == pool.num_gpu_blocks - 1
    assert manager.stats.blocks_held == 0
    assert series(manager, "kvevict_blocks_held_without_eviction") == 0
    assert series(manager, "kvevict_requests_by_setting_total", setting="server") == 1
    assert series(manager, "kvevict_requests_by_setting_total", setting="own_budget") == 0
    trace = manager.stats.as_dict()["recent_requests"][-1]
    assert trace["request_id"] == req and trace["prompt_len"] == prompt_len
    assert trace["free_points"] == expected_free_points[: manager.stats.MAX_FREE_POINTS]
    assert trace["peak_blocks"] == peak


def test_admission_cap_and_pool_sizing():
    spec = make_spec(budget=100, decode_interval=8, step=64)
    manager = make_manager(spec)
    # budget + max(decode interval, prefill interval) + step + block - 2
    expected = cdiv(100 + 64 + 64 + 16 - 2, 16)
    assert manager.max_admission_blocks_per_request == expected
    assert spec.max_blocks_per_request(max_model_len=8192) == expected
    assert spec.max_blocks_per_request(max_model_len=64) == 4
    # eviction every 300 prompt tokens: up to 299 unevicted ones on top
    wide = EvictingAttentionSpec.from_full_attention(
        spec, EvictionSchedule(100, 8, 16, "per_chunk", 0, 300), max_step_tokens=64
    )
    assert wide.max_blocks_per_request(max_model_len=8192) == cdiv(100 + 300 + 64 + 16 - 2, 16)
    # end_of_prompt holds the whole prompt: no cap below the full length.
    assert make_manager(make_spec("end_of_prompt")).max_admission_blocks_per_request is None
    assert make_spec("end_of_prompt").max_blocks_per_request(max_model_len=8192) == 512
