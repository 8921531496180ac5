"""The CUDA backend's pieces that run without a GPU: its declarations, its
CUDA-graph support, and its metadata builder on synthetic metadata.

The builder must plan from vLLM's host copies of the lengths (a device read
would sync every step): the device ``seq_lens`` here are deliberately wrong,
and the plan must still have the true lengths, eviction points and frontiers
(worked out by hand from the schedule's rule: after an eviction at point P a
head keeps ``budget`` tokens, the frontier is ``P - budget`` rounded down to a
block). Serving through these classes is in ``test_triton_path_e2e.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

BLOCK = 32
EVICTION = {"policy": "snapkv", "budget": 256, "decode_interval": 16}


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.engine.arg_utils import EngineArgs

    import vllm_kvevict
    from tiny_model import fetch_tiny_model

    vllm_kvevict.register()
    return EngineArgs(
        model=str(fetch_tiny_model()), dtype="float32", block_size=BLOCK, max_model_len=2048,
        max_num_batched_tokens=512, enforce_eager=True,
        additional_config={"kv_eviction": EVICTION},
    ).create_engine_config()


@pytest.fixture(scope="module")
def builder(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.plugin.backends.triton.backend import KVEvictTritonBackend

    with set_current_vllm_config(vllm_config):
        spec = KVEvictTritonBackend.customize_spec(
            FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.float32)
        )
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
        return KVEvictTritonBackend.get_builder_cls()(spec, layers, vllm_config, torch.device("cpu"))


def test_declarations():
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from vllm_kvevict.backend_name import GPU_BACKEND_NAME
    from vllm_kvevict.plugin.backends.triton.backend import (
        KVEvictTritonBackend,
        KVEvictTritonImpl,
        KVEvictTritonMetadataBuilder,
    )

    assert KVEvictTritonBackend.get_name() == GPU_BACKEND_NAME
    assert KVEvictTritonBackend.supported_kv_cache_layouts() == (KVCacheLayout.LBHNC,)
    assert KVEvictTritonBackend.get_impl_cls() is KVEvictTritonImpl
    assert KVEvictTritonBackend.get_builder_cls() is KVEvictTritonMetadataBuilder
    assert KVEvictTritonBackend.forward_includes_kv_cache_update is False


def test_evicting_specs_get_piecewise_graphs_only(builder, vllm_config):
    from vllm.v1.attention.backend import AttentionCGSupport
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from vllm_kvevict.plugin.backends.triton.backend import KVEvictTritonMetadataBuilder
    from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec

    assert isinstance(builder.kv_cache_spec, EvictingAttentionSpec)
    cls = KVEvictTritonMetadataBuilder
    assert cls.get_cudagraph_support(vllm_config, builder.kv_cache_spec) == AttentionCGSupport.NEVER
    plain = FullAttentionSpec(block_size=BLOCK, num_kv_heads=4, head_size=32, dtype=torch.float32)
    assert cls.get_cudagraph_support(vllm_config, plain) == AttentionCGSupport.ALWAYS


def _metadata(query_lens: list[int], seq_lens: list[int], num_blocks: int = 256):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    num_reqs = len(seq_lens)
    query_start = torch.tensor(np.concatenate([[0], np.cumsum(query_lens)]), dtype=torch.int32)
    tokens = int(query_start[-1])
    generator = torch.Generator().manual_seed(7)
    # Block 0 is vLLM's null block: never a live block.
    table = (torch.randperm(num_blocks - 1, generator=generator) + 1)[: num_reqs * 40].view(num_reqs, 40).int()
    return CommonAttentionMetadata(
        query_start_loc=query_start.clone(),
        query_start_loc_cpu=query_start,
        # Wrong on purpose: the plan must come from the host copies below.
        seq_lens=torch.zeros(num_reqs, dtype=torch.int32),
        num_reqs=num_reqs,
        num_actual_tokens=tokens,
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=table,
        slot_mapping=torch.zeros(tokens, dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
    )


def test_builder_plans_from_host_lengths(builder, monkeypatch):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    from vllm_kvevict.plugin.worker import runner_hooks
    from vllm_kvevict.plugin.backends.triton.backend import KVEvictTritonMetadata

    # Request "a": a 300-token prompt in one chunk (evicted at its end, 300);
    # "b": decode token 616 of a 600-token prompt (16 decode steps: point 616);
    # "c": decode, no point in this step.
    cm = _metadata([300, 1, 1], [300, 616, 608])
    prompt_lens = np.array([300, 600, 600])

    monkeypatch.setattr(runner_hooks, "_building", True)
    monkeypatch.setattr(runner_hooks, "_current", None)
    plain = builder.build(0, cm)
    assert type(plain) is TritonAttentionMetadata  # vLLM's dummy runs: no plan

    # A real step must be planned: no batch, or another batch, is an error
    # (attention without the plan would read freed blocks), not plain vLLM.
    monkeypatch.setattr(runner_hooks, "_building", False)
    with pytest.raises(RuntimeError, match="built with no batch"):
        builder.build(0, cm)
    monkeypatch.setattr(runner_hooks, "_building", True)
    monkeypatch.setattr(runner_hooks, "_current", runner_hooks.BatchContext(["a", "b"], prompt_lens[:2]))
    with pytest.raises(RuntimeError, match="built with 2 requests"):
        builder.build(0, cm)

    monkeypatch.setattr(runner_hooks, "_current", runner_hooks.BatchContext(["a", "b", "c"], prompt_lens))
    metadata = builder.build(0, cm)
    assert isinstance(metadata, KVEvictTritonMetadata)
    assert metadata.seq_lens is cm.seq_lens  # vLLM's own fields pass through
    plan = metadata.eviction
    assert plan.kernel == "triton" and plan.storage == "slots"
    assert plan.seq_lens == [300, 616, 608]
    assert plan.query_start == [0, 300, 301, 302]
    assert plan.frontier_before == [0, 320, 320]  # b, c: after the point at 600 (600 - 256 -> 320)
    points = [(ev.request_id, ev.point, ev.frontier_after, ev.segment_end) for ev in plan.evictions]
    assert points == [("a", 300, 32, 300), ("b", 616, 352, 616)]
    assert plan.num_evictions == 2
    rows = plan.state_rows.tolist()
    assert len(set(rows)) == 3
    assert torch.equal(plan.block_table, cm.block_table_tensor)
    builder.state.release({"a", "b", "c"})

    # The scheduler freed a block the worker would read (null block 0 inside
    # request b's live range): stop, never read it.
    cm.block_table_tensor[1, 616 // BLOCK] = 0
    with pytest.raises(RuntimeError, match="request b would read a block the scheduler freed"):
        builder.build(0, cm)
    builder.state.release({"a", "b", "c"})
