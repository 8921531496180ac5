"""Side-buffer memory: one row per sequence, allocated once before vLLM sizes
the KV pool; the bytes exported as ``kvevict_side_buffer_bytes`` follow the
documented formula; a setting whose buffers cannot be allocated stops
start-up with one line naming the bytes and the fix."""

from __future__ import annotations

import json
import logging
import os
import re
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from vllm_kvevict.config import KVEvictionConfigError, config_from_additional
from vllm_kvevict.plugin.worker import side_buffers, worker_state
from vllm_kvevict.plugin.worker.side_buffers import (
    SideBufferLayout,
    side_buffer_bytes,
    side_buffer_layout,
    side_buffer_terms,
)
from vllm_kvevict.plugin.worker.worker_state import (
    WorkerEvictionState,
    adopt_worker_state,
    allocate_worker_state,
    preallocate_for_kv_cache_specs,
    preallocate_worker_state,
)

CPU = torch.device("cpu")
README = Path(__file__).resolve().parents[1] / "docs" / "operations.md"


@pytest.fixture(autouse=True)
def no_preallocated_state(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(worker_state, "_preallocated", None)


def evicting_spec(config, num_kv_heads: int, head_size: int, block_size: int):
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec

    base = FullAttentionSpec(
        block_size=block_size, num_kv_heads=num_kv_heads, head_size=head_size, dtype=torch.float32
    )
    return EvictingAttentionSpec.from_full_attention(base, config.schedule(block_size, 512), 512)


def fake_vllm_config(settings: dict, max_num_seqs: int, max_model_len: int = 4096, num_blocks: int = 0):
    return SimpleNamespace(
        additional_config={"kv_eviction": settings},
        scheduler_config=SimpleNamespace(max_num_seqs=max_num_seqs),
        model_config=SimpleNamespace(max_model_len=max_model_len, dtype=torch.float32),
        cache_config=SimpleNamespace(num_gpu_blocks=num_blocks),
    )


# The default model's shapes: 30 layers, 3 KV heads, 9 query heads, head_dim 64.
SMOLLM2 = {"num_layers": 30, "num_kv_heads": 3, "num_q_heads": 9, "head_dim": 64}


def test_formula_on_the_default_model_matches_a_hand_computed_number() -> None:
    """snapkv at its defaults (budget 512, window 32, slots), blocks of 32,
    fp32, 256 sequences: positions hold budget + one block per head."""
    positions = 30 * 256 * 3 * (512 + 32) * 4
    ring = 30 * 256 * 32 * 9 * 64 * 4
    assert positions == 50_135_040 and ring == 566_231_040
    got = side_buffer_bytes(
        **SMOLLM2, rows=256, retained_capacity=512 + 32, query_window=32, query_dtype=torch.float32
    )
    assert got == positions + ring == 616_366_080
    # docs/operations.md's worked example is this number.
    assert "616,366,080" in README.read_text()


def test_state_bytes_match_a_hand_computed_momentkv_state() -> None:
    """momentkv (AdaKV head pages, full covariance): 2 layers, 2 KV heads,
    4 query heads, head_dim 8, 3 rows, budget 64 in blocks of 16, window 32."""
    config = config_from_additional({"kv_eviction": {"policy": "momentkv", "budget": 64}})
    spec = evicting_spec(config, num_kv_heads=2, head_size=8, block_size=16)
    layout = side_buffer_layout(config, spec, 2, 4, fake_vllm_config({}, max_num_seqs=3))
    assert layout.max_head_pages == 2 * (64 // 16 + 1) and layout.retained_capacity == 160
    state = WorkerEvictionState.from_layout(layout, CPU)
    positions = 2 * 3 * 2 * 160 * 4
    ring = 2 * 3 * 32 * 4 * 8 * 4
    page_tables = 2 * 3 * 2 * (10 + 1) * 4 + 3 * 8
    moments = 2 * 3 * 2 * (1 + 8 + 8 + 8 * 8) * 4
    assert state.counters.side_buffer_bytes == positions + ring + page_tables + moments == 36_696


CASES = {
    "snapkv slots": {"policy": "snapkv", "budget": 64},
    "streamingllm slots, no queries": {"policy": "streamingllm", "budget": 64},
    "adakv snapkv head pages": {"policy": "snapkv", "budget": 64, "head_budget": "adaptive"},
    "momentkv full covariance": {"policy": "momentkv", "budget": 64},
    "momentkv diagonal covariance": {"policy": "momentkv", "budget": 64, "moment_covariance": "diagonal"},
    "momentkv no covariance": {"policy": "momentkv", "budget": 64, "moment_covariance": "none"},
    "learned global": {"policy": "learned", "budget": 64},
    "pyramidkv": {"policy": "pyramidkv", "budget": 64},
}


@pytest.mark.parametrize("case", list(CASES))
def test_exported_bytes_follow_the_formula(case: str) -> None:
    """What kvevict_side_buffer_bytes exports is the documented formula, for
    every policy family and storage; pooled layers add log β per pool slot."""
    settings = CASES[case]
    config = config_from_additional({"kv_eviction": settings})
    num_layers, heads, q_heads, dim, bs, rows, pool_blocks = 3, 2, 6, 8, 16, 5, 7
    spec = evicting_spec(config, heads, dim, bs)
    layout = side_buffer_layout(config, spec, num_layers, q_heads, fake_vllm_config(settings, rows))
    state = WorkerEvictionState.from_layout(layout, CPU)
    pool_slots = 0
    if config.pools_layers:
        state.reserve_log_beta(pool_blocks * num_layers, bs)
        pool_slots = pool_blocks * num_layers * bs
    expected = side_buffer_bytes(
        num_layers, heads, q_heads, dim, rows, layout.retained_capacity, layout.query_window,
        torch.float32, layout.max_head_pages, layout.moment_correction, layout.moment_covariance,
        pool_slots,
    )
    assert state.counters.side_buffer_bytes == expected
    assert state.counters.rows_allocated == rows
    terms = side_buffer_terms(
        num_layers, heads, q_heads, dim, rows, layout.retained_capacity, layout.query_window,
        torch.float32, layout.max_head_pages, layout.moment_correction, layout.moment_covariance,
        pool_slots,
    )
    # Which terms apply to which settings.
    assert bool(terms["query_ring"]) == config.build_policy().needs_queries
    assert bool(terms["page_tables"]) == config.uses_head_pages
    assert bool(terms["moments"]) == config.moment_correction
    assert terms["log_beta"] == pool_blocks * num_layers * bs * heads * 4 * config.pools_layers
    if config.pools_layers:  # a head may take every page of every layer's heads
        assert layout.max_head_pages == heads * num_layers * (64 // bs + 1)
    elif config.uses_head_pages:
        assert layout.max_head_pages == heads * (64 // bs + 1)
    else:
        assert layout.retained_capacity == 64 + bs


def test_positions_are_int32_and_rows_never_grow() -> None:
    state = WorkerEvictionState(2, 2, 4, 8, 48, 4, torch.float32, CPU, rows=3)
    assert state.positions.dtype == torch.int32 and state.positions.shape == (2, 3, 2, 48)
    before = state.counters.side_buffer_bytes
    rows = [state.row(f"r{i}") for i in range(3)]
    assert sorted(rows) == [0, 1, 2] and state.row("r1") == rows[1]
    with pytest.raises(RuntimeError, match=r"all 3 rows \(--max-num-seqs\)"):
        state.row("r3")
    state.release({"r0"})
    assert state.row("r3") == rows[0]
    assert state.counters.side_buffer_bytes == before and state.counters.rows_allocated == 3


def test_slots_eviction_keeps_int64_positions_for_the_policy() -> None:
    """The engine reads the int32 side buffer and hands the policy the same
    int64 positions as before."""
    from vllm_kvevict.eviction.allocation import UniformAllocation
    from vllm_kvevict.eviction.point import EvictionPoint
    from vllm_kvevict.eviction.select import KeepRule
    from vllm_kvevict.eviction.slots import evict_slots
    from vllm_kvevict.policies import make_policy
    from vllm_kvevict.policies.base import ScoringInputs

    heads, dim, bs = 2, 4, 4
    row = torch.zeros(heads, 24, dtype=torch.int32)
    row[:, :8] = torch.tensor([0, 1, 2, 3, 9, 10, 14, 15], dtype=torch.int32)
    seen = []

    class Cache:
        block_size = bs

        def read_slots(self, block_row, start, end):
            return torch.randn(heads, end - start, dim), torch.randn(heads, end - start, dim)

        def write_slots(self, block_row, start, keys, values):
            pass

    def inputs(keys, values, positions, evicted):
        seen.append(positions)
        return ScoringInputs(keys, values, positions, None, None, 1.0, evicted)

    class Observer:
        def released(self, cache, released):
            pass

    # 8 compacted tokens below the last point 16 (frontier 8), new ones up to point 24.
    ev = EvictionPoint("r", 0, 0, 0, 20, 16, 8, 24, 16, 24, compacts=True)
    rule = KeepRule(make_policy("knorm"), UniformAllocation(), 2, 2)
    counts = evict_slots(Cache(), rule, ev, row, torch.arange(8), inputs, 0, Observer())
    assert counts == [8, 8]
    assert seen[0].dtype == torch.int64
    assert seen[0][0].tolist() == [0, 1, 2, 3, 9, 10, 14, 15, *range(16, 24)]
    kept = row[:, :8]
    assert kept.dtype == torch.int32 and bool((kept[:, :2] == torch.tensor([0, 1])).all())


def test_an_impossible_setting_names_the_bytes_the_terms_and_the_fix() -> None:
    layout = SideBufferLayout(30, 3, 9, 64, rows=10**6, retained_capacity=10**6, query_window=32,
                              query_dtype=torch.bfloat16)
    with pytest.raises(KVEvictionConfigError) as error:
        allocate_worker_state(layout, CPU)
    message = str(error.value)
    assert "\n" not in message
    assert f"({layout.nbytes} bytes)" in message and "for 1000000 sequences (--max-num-seqs)" in message
    assert "positions 30 layers x 1000000 rows x 3 KV heads x 1000000 tokens x 4 B" in message
    assert "query ring 30 layers x 1000000 rows x 32 queries x 9 query heads x 64 x 2 B" in message
    assert message.endswith("lower budget, observation_window or --max-num-seqs")


def test_the_allocators_failure_becomes_the_same_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past the host-memory check, the allocator's own failure (torch's
    "can't allocate memory", or CUDA's OutOfMemoryError) is converted."""
    monkeypatch.setattr(side_buffers, "host_memory_available", lambda: 1 << 62)
    layout = SideBufferLayout(30, 3, 9, 64, rows=10**6, retained_capacity=10**6, query_window=0,
                              query_dtype=torch.float32)
    with pytest.raises(KVEvictionConfigError, match=r"could not be allocated \(RuntimeError: .*can't allocate"):
        allocate_worker_state(layout, CPU)
    with pytest.raises(KVEvictionConfigError, match="lower budget or --max-num-seqs$"):
        allocate_worker_state(layout, CPU)

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(WorkerEvictionState, "_allocate", out_of_memory)
    small = SideBufferLayout(1, 1, 1, 8, rows=1, retained_capacity=8, query_window=0, query_dtype=torch.float32)
    with pytest.raises(KVEvictionConfigError, match="OutOfMemoryError: CUDA out of memory"):
        allocate_worker_state(small, CPU)


def test_builders_adopt_the_state_allocated_before_the_pool(caplog: pytest.LogCaptureFixture) -> None:
    layout = SideBufferLayout(2, 2, 4, 8, rows=4, retained_capacity=48, query_window=4,
                              query_dtype=torch.float32)
    state = preallocate_worker_state(layout, CPU)
    assert preallocate_worker_state(layout, CPU) is state
    assert adopt_worker_state(layout, CPU) is state
    assert adopt_worker_state(layout, CPU) is state  # a second builder shares it
    other = SideBufferLayout(2, 2, 4, 8, rows=4, retained_capacity=64, query_window=4,
                             query_dtype=torch.float32)
    with caplog.at_level(logging.WARNING, logger=worker_state.__name__):
        again = adopt_worker_state(other, CPU)
    assert again is not state and again.layout == other
    assert "allocating them again" in caplog.text


def test_specs_reported_by_the_runner_allocate_max_num_seqs_rows(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm.v1.attention.backends.utils as backend_utils

    monkeypatch.setattr(backend_utils, "get_num_attention_heads_from_layers", lambda config, names: 6)
    settings = {"policy": "snapkv", "budget": 64}
    config = config_from_additional({"kv_eviction": settings})
    spec = evicting_spec(config, 2, 8, 16)
    vllm_config = fake_vllm_config(settings, max_num_seqs=7)
    specs = {f"model.layers.{i}.self_attn.attn": spec for i in range(3)}
    preallocate_for_kv_cache_specs(specs, vllm_config, CPU)
    state = worker_state._preallocated
    assert state is not None and state.num_rows == 7 and state.num_layers == 3
    assert state.counters.side_buffer_bytes == side_buffer_bytes(3, 2, 6, 8, 7, 64 + 16, 32, torch.float32)
    assert adopt_worker_state(side_buffer_layout(config, spec, 3, 6, vllm_config), CPU) is state
    # Eviction off: nothing allocated.
    monkeypatch.setattr(worker_state, "_preallocated", None)
    preallocate_for_kv_cache_specs(specs, SimpleNamespace(additional_config={}), CPU)
    assert worker_state._preallocated is None


def test_the_runner_hook_allocates_when_the_specs_are_reported(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.plugin.worker import runner_hooks

    calls = []
    monkeypatch.setattr(GPUModelRunner, "get_kv_cache_spec", lambda self: {"layer": "spec"})
    monkeypatch.setattr(runner_hooks, "_side_buffers_hooked", False)
    monkeypatch.setattr(worker_state, "preallocate_for_kv_cache_specs",
                        lambda specs, config, device: calls.append((specs, config, device)))
    runner_hooks.install_side_buffer_hook()
    runner = SimpleNamespace(vllm_config="config", device=CPU)
    assert GPUModelRunner.get_kv_cache_spec(runner) == {"layer": "spec"}
    assert calls == [({"layer": "spec"}, "config", CPU)]


def test_log_beta_is_reserved_once_for_the_pool() -> None:
    state = WorkerEvictionState(3, 2, 4, 8, 64, 0, torch.float32, CPU, max_head_pages=4, rows=2)
    before = state.counters.side_buffer_bytes
    state.reserve_log_beta(3 * 5, 4)
    reserved = state.log_beta_pages
    assert reserved.shape == (3 * 5 * 2, 4)
    assert state.counters.side_buffer_bytes == before + 3 * 5 * 2 * 4 * 4
    buffer = torch.randn(3 * 5 * 2 * 2 * 4 * 8)
    layer = buffer[: 5 * 2 * 2 * 4 * 8].view(5, 2, 2 * 4, 8)
    state.global_kv(0, layer, 4)
    assert state.log_beta_pages is reserved  # the pool it was reserved for: reused


@pytest.mark.e2e
def test_impossible_setting_fails_at_start_up_before_the_kv_cache(model_dir: str) -> None:
    """2,048 sequences of snapkv observing 8,192 queries need a 1.2 TB query
    ring: `vllm serve` stops while the worker starts, before vLLM sizes the
    KV cache, with the one-line error."""
    from helpers import vllm_executable

    config = {"policy": "snapkv", "observation_window": 8192}
    result = subprocess.run(
        [vllm_executable(), "serve", model_dir, "--dtype", "float32", "--max-model-len", "8192",
         "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", "200000000",
         "--max-num-seqs", "2048", "--host", "127.0.0.1", "--port", "1",
         "--kv-eviction", "snapkv", "--kv-eviction-config", json.dumps(config)],
        capture_output=True, text=True, timeout=300, check=False, env=dict(os.environ, PYTHONSAFEPATH="1"),
    )
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    expected = side_buffer_bytes(30, 3, 9, 64, 2048, 512 + 32, 8192, torch.float32)
    match = re.search(r"KV eviction's side buffers need [^\n]*\((\d+) bytes\)[^\n]*--max-num-seqs", output)
    assert match is not None, output[-3000:]
    assert int(match.group(1)) == expected
    # Before vLLM sized the KV cache (its CPU worker logs the size it sets).
    assert "for KV cache on node" not in output, output[-3000:]


@pytest.mark.e2e
def test_served_worker_adopts_max_num_seqs_rows(model_dir: str, tmp_path: Path) -> None:
    """A real server: the worker's side buffers are the 8 rows of
    --max-num-seqs 8 allocated before the KV cache (adopted, not allocated
    again), the formula's bytes, unchanged by a request."""
    import requests
    from helpers import SNAPKV_SERVER_CONFIG, VllmServer, eviction_server_args, kvevict_samples

    server = VllmServer(
        model_dir, eviction_server_args(SNAPKV_SERVER_CONFIG, 160),
        stats_path=tmp_path / "stats.json", log_path=tmp_path / "server.log",
    )
    try:
        server.wait_ready()
        expected = side_buffer_bytes(30, 3, 9, 64, 8, 512 + 32, 32, torch.float32)
        worker = server.worker_stats()
        assert worker["rows_allocated"] == 8 and worker["side_buffer_bytes"] == expected
        # A fresh server exports every scheduler-side series at 0 before its
        # first request (a counter that appears on its first increase loses
        # that increase to rate(), and dashboards read "no data").
        from vllm_kvevict.evaluation.server import scrape
        from vllm_kvevict.metrics import ENGINE_METRICS, REQUEST_SETTING_LABELS

        fresh = kvevict_samples(scrape(server.url))
        names = {name for name, _ in fresh}
        for name, definition in ENGINE_METRICS.items():
            exposed = f"{name}_total" if definition.kind == "counter" else name
            assert exposed in names, (exposed, sorted(names))
        by_setting = {dict(labels)["setting"]: value for (name, labels), value in fresh.items()
                      if name == "kvevict_requests_by_setting_total"}
        assert by_setting == dict.fromkeys(REQUEST_SETTING_LABELS, 0), by_setting
        assert sum(v for (name, _), v in fresh.items() if name == "kvevict_requests_admitted_total") == 0
        reply = requests.post(server.url + "/v1/completions", timeout=120, json={
            "model": "smollm2", "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0,
        })
        assert reply.status_code == 200
        _, (worker,) = server.wait_idle()
        assert worker["rows_allocated"] == 8 and worker["side_buffer_bytes"] == expected
        assert "allocating them again" not in Path(server.log_path).read_text()
    finally:
        server.stop()
