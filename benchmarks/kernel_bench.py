"""GPU benchmark of the Triton kernels over per-head page tables: the two targets.

Target 1, decode attention. One query token per request, batch ``B`` (16), ``L``
(16,384) retained tokens per KV head, bf16, through the Triton kernel
``head_paged_attention`` over per-head page tables, reading one layer of the KV
cache exactly as vLLM 0.32 lays it out (one buffer, a layer's logical
``[num_blocks, H, page_size, 2D]`` view in the physical order ``LBHNC`` or
``LBNHC``, split into strided key and value views). Reported: the K and V bytes
it reads per second as a percentage of the device's measured copy bandwidth
(bytes read + written per second of a device-to-device copy), for both
layouts; with the MomentKV moments too; and, for context, a full-cache decode
(flash-attn's ``flash_attn_with_kvcache`` when importable, else torch SDPA)
over a contiguous ``[B, L, H, D]`` copy of the same data.

Target 2, eviction step against decode step, over all layers of a model-like
shape (default: 32 layers, 8 KV heads x 4 query heads, head_dim 128, the
attention of Llama-3-8B), same batch. One eviction step = for every layer,
SnapKV scores, then the compaction kernel ``compact_head_pages`` in place
(every head evicts ``--evict-tokens``, folded into the MomentKV moments). The
scores two ways: in torch (gather the keys, softmax of a 32-query window,
pooling, top-k), and as serving computes them on the Triton path (the
window-score kernel ``window_votes`` over every request and head of the layer
through the page tables, the policy's pooling, top-k), the latter also against
reading the layer's keys once at the measured copy bandwidth. And the eviction
step as serving runs it on the Triton path, the engine's own code with its
selection and bookkeeping: ``compact_head_pages_many`` of every layer, AdaKV +
SnapKV, and ``evict_slots_many`` (the default storage), SnapKV, each layer's
requests as one batch (no moments); MomentKV on head pages (its moments
folded by the compaction) and CriticalKV on head pages (Expected Attention's
base, the value factor by its kernel), each one batch too. One decode step =
``head_paged_attention`` of every layer (the rest of the model is not counted,
so the ratio overstates the share of a whole decode step). Reported: the
times, the eviction step's ratio to the decode step with each way of scoring,
and that ratio spread over the ``--decode-interval`` decode steps between two
evictions.

The value factor of CriticalKV and DefensiveKV (``‖v W_O‖₁`` of every
retained token, through the rows of an output projection of ``d_model =``
query heads x head_dim), over one layer at the same shape: the Triton kernel
``projected_value_norms`` (one launch, the product never stored) and the torch
fallback, in TFLOP/s and, times the layers, against the decode step.

    python benchmarks/kernel_bench.py                  # needs a CUDA GPU
    python benchmarks/kernel_bench.py --json out.json  # the figures as JSON too
    python benchmarks/kernel_bench.py --smoke          # tiny shapes; on CPU under TRITON_INTERPRET=1

Without CUDA and without ``--smoke`` it says a GPU is needed and exits 1.
``--smoke`` first checks the four kernels against their torch references (the
three over pages on vLLM's views in both layouts); its times (the interpreter's on CPU) mean
nothing.

Request ``b``'s pages are its own blocks in order (head ``h`` in head-page
``block * H + h``): tokens ``0 .. L-2`` compacted, token ``L-1`` in the
standard region, so the same bytes are also a plain ``[B, L, H, D]`` cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

LAYOUTS = ("LBHNC", "LBNHC")
# Logical axes [L, B, H, N, C] in physical order (vllm/v1/kv_cache_layout.py).
STRIDE_ORDER = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4)}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=16, help="requests (B)")
    parser.add_argument("--length", type=int, default=16384, help="retained tokens per KV head (L)")
    parser.add_argument("--layers", type=int, default=32, help="target 2: layers of the model-like shape")
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head (GQA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16, help="tokens per block (vLLM's block size)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--layout", choices=LAYOUTS, default="LBHNC", help="target 2's KV cache layout")
    parser.add_argument("--evict-tokens", type=int, default=64, help="target 2: tokens each head evicts")
    parser.add_argument("--window", type=int, default=32, help="target 2: SnapKV observation window (queries)")
    parser.add_argument("--decode-interval", type=int, default=32, help="decode steps between two evictions")
    parser.add_argument("--memory-fraction", type=float, default=0.85, help="of free GPU memory the caches may use")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes (on CPU: under the Triton interpreter)")
    return parser.parse_args(argv)


@dataclass
class Setup:
    device: torch.device
    dtype: torch.dtype
    kv_heads: int
    group: int
    head_dim: int
    page_size: int
    timer: Callable[[Callable[[], object]], float]

    @property
    def q_heads(self) -> int:
        return self.kv_heads * self.group

    @property
    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    def kv_bytes(self, batch: int, length: int) -> int:
        """K and V bytes of one layer's retained tokens."""
        return 2 * batch * length * self.kv_heads * self.head_dim * self.element_size


def make_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: triton's ``do_bench`` (median, L2 flushed between runs)
    on a GPU; one wall-clock call elsewhere (a smoke check only)."""
    if device.type == "cuda":
        import triton.testing

        def cuda_timer(fn: Callable[[], object]) -> float:
            return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median") / 1e3

        return cuda_timer

    def cpu_timer(fn: Callable[[], object]) -> float:
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start

    return cpu_timer


def copy_bandwidth(setup: Setup, nbytes: int) -> float:
    """Device-to-device copy bandwidth, bytes read + written per second."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=setup.device)
    dst = torch.empty_like(src)
    return 2 * nbytes / setup.timer(lambda: dst.copy_(src))


def fits(setup: Setup, nbytes: float, fraction: float) -> bool:
    if setup.device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(setup.device)
    return nbytes <= fraction * free


# --------------------------------------------------------------------------- vLLM's KV cache


def layer_kv_cache(
    raw: torch.Tensor, num_layers: int, num_blocks: int, setup: Setup, layout: str, layer: int
) -> torch.Tensor:
    """Layer ``layer``'s logical ``[num_blocks, H, page_size, 2D]`` view of the
    int8 buffer ``raw`` as vLLM 0.32 makes it for a layer-outermost layout
    (``create_kv_cache_views``)."""
    shape = (num_layers, num_blocks, setup.kv_heads, setup.page_size, 2 * setup.head_dim * setup.element_size)
    strides = [0] * 5
    stride = 1
    for dim in reversed(STRIDE_ORDER[layout]):
        strides[dim] = stride
        stride *= shape[dim]
    assert raw.numel() == stride
    return torch.as_strided(raw, shape, strides, raw.storage_offset())[layer].view(setup.dtype)


def layer_kv_views(
    raw: torch.Tensor, num_layers: int, num_blocks: int, setup: Setup, layout: str, layer: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer ``layer``'s ``(key, value)`` views, as the attention backend
    splits them (``kv_cache.split(head_dim, dim=-1)``): strided
    ``[num_blocks, H, page_size, D]``."""
    key, value = layer_kv_cache(raw, num_layers, num_blocks, setup, layout, layer).split(setup.head_dim, dim=-1)
    return key, value


def make_kv_cache(
    setup: Setup, num_layers: int, num_blocks: int, layout: str
) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Random K and V for ``num_layers`` layers in one buffer: the buffer, each layer's views."""
    nbytes = num_layers * num_blocks * setup.kv_heads * setup.page_size * 2 * setup.head_dim * setup.element_size
    raw = torch.empty(nbytes, dtype=torch.int8, device=setup.device)
    raw.view(setup.dtype).normal_()
    return raw, [layer_kv_views(raw, num_layers, num_blocks, setup, layout, layer) for layer in range(num_layers)]


def engine_step(
    setup: Setup, raw: torch.Tensor, allocated: int, num_blocks: int, layout: str, requests: Requests,
    window_q: torch.Tensor, layers: int, evict: int, storage: str, policy: str = "snapkv",
    every_layer: bool = False,
) -> Callable[[], None]:
    """One eviction step of every layer as serving runs it on the Triton path:
    the eviction engine's entry point for every request of the layer, on
    ``TritonPagedCache`` over vLLM's view of the layer, SnapKV from the
    window-score kernel's votes, the layer's requests as one batch:
    ``compact_head_pages_many`` with AdaKV (``storage`` head_pages: tokens
    ``0 .. L-2`` compacted, ``L-1`` in the standard region) or
    ``evict_slots_many`` (slots: tokens ``0 .. L-2`` kept at the last point,
    ``L-1`` new). Each request's point at ``L``, ``L - evict`` tokens per head
    (on average with AdaKV) kept in the blocks from ``evict // page_size``.
    Each run first restores the side buffers (page tables, lengths,
    positions: a few MB) so every run does the same work. ``policy``
    momentkv: MomentKV on head pages, each request's moments as after a
    decode-time history (``L`` tokens evicted before, so one round, as at
    a decode-time point), restored each run too; criticalkv: CriticalKV on
    Expected Attention (RoPE of base 500,000), an output projection of
    ``d_model =`` query heads x head_dim, the value factor by the Triton
    kernel. ``every_layer`` (head pages, layout LBHNC): every layer's
    evictions as one call after the step's last layer, as serving runs a
    step whose points are at its end (``compact_layers_many`` on the pool
    of every layer's blocks; the layers beyond those allocated share their
    blocks, so their items move the same tokens)."""
    from vllm_kvevict.eviction.allocation import AdaKVAllocation, UniformAllocation
    from vllm_kvevict.eviction.cache_ops import EvictionObserver
    from vllm_kvevict.eviction.head_pages import compact_head_pages_many, compact_layers_many
    from vllm_kvevict.eviction.point import EvictionPoint, LayerEviction, StreamRows
    from vllm_kvevict.eviction.select import KeepRule
    from vllm_kvevict.eviction.slots import evict_slots_many
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.plugin.backends.triton.cache import TritonPagedCache
    from vllm_kvevict.policies import RotaryFrequencies, ScoringInputs, make_policy

    batch, length, heads, ps, dev = requests.batch, requests.length, setup.kv_heads, setup.page_size, setup.device
    window = window_q.shape[1]
    allocation = AdaKVAllocation(0.2) if storage == "head_pages" else UniformAllocation()
    rule = KeepRule(make_policy(policy), allocation, 4, window)
    plain = requests.plain
    pages0 = plain.head_page_table.contiguous()  # [B, H, L / ps]
    lens0 = torch.full((batch, heads), length - 1, dtype=torch.int32, device=dev)
    positions0 = torch.arange(length, device=dev).expand(batch, heads, -1).contiguous()
    caches = [
        TritonPagedCache(layer_kv_cache(raw, allocated, num_blocks, setup, layout, layer % allocated))
        for layer in range(layers)
    ]
    moments0 = None
    if rule.policy.needs_moments:
        moments0 = EvictedMoments.zeros(batch, heads, setup.head_dim, dev)
        moments0.count.fill_(length)
        moments0.key_mean.normal_(0.0, 0.1), moments0.value_mean.normal_(0.0, 0.1)
    # Each layer's moments, one row per request, as the worker holds them
    # (filled from moments0 before every run).
    layer_moments = [
        EvictedMoments.zeros(batch, heads, setup.head_dim, dev) if moments0 is not None else None
        for _ in range(layers)
    ]
    rows = [
        [
            StreamRows(positions0[b].clone(), pages0[b].clone(), lens0[b].clone(),
                       moments[b] if moments is not None else None)
            for b in range(batch)
        ]
        for moments in layer_moments
    ]
    query_positions = torch.arange(length - window, length, device=dev)
    frontier = evict // ps * ps
    projection = rotary = None
    if rule.policy.needs_output_projection:
        d_model = setup.q_heads * setup.head_dim
        weight = torch.randn(d_model, d_model, device=dev, dtype=setup.dtype) / d_model**0.5
        projection = weight.t().reshape(setup.q_heads, setup.head_dim, d_model)  # o_proj.weight.T, a view
    if rule.policy.needs_rotary:
        rotary = RotaryFrequencies(
            1.0 / 500000.0 ** (torch.arange(0, setup.head_dim, 2, dtype=torch.float64, device=dev) / setup.head_dim)
        )

    def scoring_inputs(b: int):
        queries = window_q[b].transpose(0, 1)  # [Hq, W, D]

        def inputs(keys, values, positions, evicted):
            return ScoringInputs(
                keys, values, positions, queries, query_positions, requests.scale, evicted,
                rotary=rotary, output_projection=projection,
            )

        return inputs

    inputs = [scoring_inputs(b) for b in range(batch)]
    observer = EvictionObserver()
    pool = None
    if every_layer:
        assert storage == "head_pages" and layout == "LBHNC", "every layer at once: head pages in one pool (LBHNC)"
        pool = TritonPagedCache(raw.view(setup.dtype).view(allocated * num_blocks, heads, ps, 2 * setup.head_dim))

    def run() -> None:
        for layer_rows in rows:
            torch._foreach_copy_([r.pages for r in layer_rows], list(pages0.unbind(0)))
            torch._foreach_copy_([r.lens for r in layer_rows], list(lens0.unbind(0)))
            torch._foreach_copy_([r.positions for r in layer_rows], list(positions0.unbind(0)))
            if moments0 is not None:
                moments0.unstack_into([r.moments for r in layer_rows])
        step = []
        for layer, (cache, layer_rows) in enumerate(zip(caches, rows)):
            evictions = [
                LayerEviction(
                    EvictionPoint(f"r{b}", b, b, b, length - 1, length - 1, 0, length, frontier, length,
                                  compacts=True, region_start=length - 1),
                    layer_rows[b], requests.blocks[b], inputs[b],
                )
                for b in range(batch)
            ]
            if pool is not None:
                step += [(layer, e) for e in evictions]
            elif storage == "head_pages":
                compact_head_pages_many(cache, rule, evictions, layer, observer, [[length - 1] * heads] * batch)
            else:
                evict_slots_many(cache, rule, evictions, layer, observer)
        if pool is not None:
            offsets = [(layer % allocated) * num_blocks for layer, _ in step]
            kept = compact_layers_many(
                pool, rule, [e for _, e in step], [layer for layer, _ in step], offsets, observer,
                [[length - 1] * heads] * len(step),
            )
            assert kept is not None, "the step's evictions did not run as one batch"

    return run


@dataclass
class Requests:
    batch: int
    length: int
    query: torch.Tensor  # [B, Hq, D]
    plain: object  # HeadPagedBatch without moments
    with_moments: object  # HeadPagedBatch with a row of moments per request
    src_tokens: torch.Tensor  # [B, H, L] flat addresses of every retained token
    blocks: torch.Tensor  # [B, pages] each request's blocks in order
    scale: float


def make_requests(setup: Setup, batch: int, length: int) -> Requests:
    """``B`` requests of ``L`` tokens per head over blocks ``0 .. B * L / page_size``."""
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.triton_kernels.batch import HeadPagedBatch

    dev, heads, ps = setup.device, setup.kv_heads, setup.page_size
    pages = length // ps
    i32 = dict(dtype=torch.int32, device=dev)
    blocks = torch.arange(batch * pages, **i32).view(batch, pages)
    head_page_table = blocks[:, None, :] * heads + torch.arange(heads, **i32)[None, :, None]  # [B, H, pages]
    plain = HeadPagedBatch(
        head_page_table,
        torch.full((batch, heads), length - 1, **i32),  # compacted tokens 0 .. L-2
        torch.arange(batch + 1, **i32),  # one query each
        torch.full((batch,), length, **i32),
        blocks,
        torch.full((batch,), length - 1, **i32),  # the standard region: token L-1
    )
    moments = EvictedMoments.zeros(batch, heads, setup.head_dim, device=dev)
    moments.count.fill_(100.0)
    moments.key_mean.normal_()
    moments.value_mean.normal_()
    moments.cross_cov.normal_().mul_(10.0)
    with_moments = replace(plain, moments=moments, moment_rows=torch.arange(batch, **i32))
    token = torch.arange(length, device=dev)
    src_tokens = (head_page_table.long()[..., token // ps] * ps + token % ps).contiguous()
    query = torch.randn(batch, setup.q_heads, setup.head_dim, device=dev, dtype=setup.dtype)
    return Requests(batch, length, query, plain, with_moments, src_tokens, blocks, 1.0 / math.sqrt(setup.head_dim))


def contiguous_copy(cache: torch.Tensor, requests: Requests) -> torch.Tensor:
    """The retained tokens of ``cache`` as a contiguous ``[B, L, H, D]`` tensor."""
    pages = cache[requests.blocks.reshape(-1).long()]  # [B * pages, H, ps, D]
    batch, length = requests.batch, requests.length
    heads, ps, dim = pages.shape[1:]
    return pages.view(batch, length // ps, heads, ps, dim).permute(0, 1, 3, 2, 4).reshape(batch, length, heads, dim)


def baseline_attention(
    setup: Setup, requests: Requests, key: torch.Tensor, value: torch.Tensor
) -> tuple[str, Callable[[], torch.Tensor]]:
    """Full-cache decode over contiguous ``[B, L, H, D]`` K and V."""
    if setup.device.type == "cuda":
        try:
            from flash_attn import flash_attn_with_kvcache

            seqlens = torch.full((requests.batch,), requests.length, dtype=torch.int32, device=setup.device)
            q = requests.query.unsqueeze(1)  # [B, 1, Hq, D]
            return "flash_attn_with_kvcache", lambda: flash_attn_with_kvcache(q, key, value, cache_seqlens=seqlens)
        except ImportError:
            pass
    q = requests.query.unsqueeze(2)  # [B, Hq, 1, D]
    kt, vt = key.transpose(1, 2), value.transpose(1, 2)  # [B, H, L, D]
    return "torch SDPA", lambda: F.scaled_dot_product_attention(q, kt, vt, enable_gqa=True).squeeze(2)


# --------------------------------------------------------------------------- target 1


def target_decode(setup: Setup, args: argparse.Namespace, copy_bw: float) -> list[dict]:
    """Target 1 in both layouts: one row each."""
    from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention

    batch, length = args.batch, args.length
    kv_bytes = setup.kv_bytes(batch, length)
    print("## Target 1: decode attention over per-head page tables\n")
    print(
        f"B = {batch} requests, L = {length:,} retained tokens per KV head, {args.dtype}; one layer of vLLM's "
        f"KV cache; KV read = {kv_bytes / 1e6:,.1f} MB of K and V (the moments add (1 + 2D + D²) fp32 per "
        "head). % copy = (KV read / time) / copy bandwidth. Baseline: full-cache decode over a contiguous "
        "[B, L, H, D] copy of the same K and V; max abs diff: its output against the Triton kernel's.\n"
    )
    print(
        "| layout | Triton (µs) | GB/s | % copy | + moments (µs) | % copy | baseline | baseline (µs) | "
        "% copy | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    rows = []
    if not fits(setup, 2.2 * kv_bytes, args.memory_fraction):
        print(f"| skipped: {2.2 * kv_bytes / 1e9:.1f} GB do not fit | | | | | | | | | |")
        return rows
    requests = make_requests(setup, batch, length)
    num_blocks = batch * length // setup.page_size
    for layout in LAYOUTS:
        raw, ((key, value),) = make_kv_cache(setup, 1, num_blocks, layout)
        plain = (requests.query, key, value, requests.plain, requests.scale)
        moments = (requests.query, key, value, requests.with_moments, requests.scale)
        t = setup.timer(lambda: head_paged_attention(*plain, max_seq_len=length))
        t_moments = setup.timer(lambda: head_paged_attention(*moments, max_seq_len=length))
        k_contig, v_contig = contiguous_copy(key, requests), contiguous_copy(value, requests)
        name, baseline = baseline_attention(setup, requests, k_contig, v_contig)
        t_base = setup.timer(baseline)
        out = head_paged_attention(*plain, max_seq_len=length)[0]
        diff = (out - baseline().float().reshape(out.shape)).abs().max().item()
        row = {
            "layout": layout, "batch": batch, "length": length, "dtype": args.dtype, "kv_bytes": kv_bytes,
            "triton_us": t * 1e6, "triton_GBps": kv_bytes / t / 1e9, "triton_pct_copy": 100 * kv_bytes / t / copy_bw,
            "moments_us": t_moments * 1e6, "moments_pct_copy": 100 * kv_bytes / t_moments / copy_bw,
            "baseline": name, "baseline_us": t_base * 1e6, "baseline_pct_copy": 100 * kv_bytes / t_base / copy_bw,
            "max_abs_diff": diff,
        }
        rows.append(row)
        print(
            f"| {layout} | {t * 1e6:,.1f} | {kv_bytes / t / 1e9:,.0f} | {row['triton_pct_copy']:.0f}% | "
            f"{t_moments * 1e6:,.1f} | {row['moments_pct_copy']:.0f}% | {name} | {t_base * 1e6:,.1f} | "
            f"{row['baseline_pct_copy']:.0f}% | {diff:.1e} |",
            flush=True,
        )
        del raw, key, value, k_contig, v_contig
        if setup.device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# --------------------------------------------------------------------------- target 2


def snapkv_keep(setup: Setup, key: torch.Tensor, requests: Requests, window_q: torch.Tensor, keep_count: int,
                pool: int = 7) -> torch.Tensor:
    """SnapKV scores in torch: softmax of the window's queries over each head's
    retained keys, summed over the window and the query group, average-pooled;
    the top ``keep_count`` positions, ``[B, H, keep_count]`` sorted. Requests in
    chunks so the fp32 probabilities stay under ~1 GB."""
    batch, length, heads, group = requests.batch, requests.length, setup.kv_heads, setup.group
    window = window_q.shape[1]
    chunk = max(1, int(2**30 // (heads * group * window * length * 4)))
    ps = setup.page_size
    kept = []
    for b0 in range(0, batch, chunk):
        flat = requests.src_tokens[b0 : b0 + chunk]  # [b, H, L]
        page = flat // ps
        keys = key[page // heads, page % heads, flat % ps]  # [b, H, L, D]
        q = window_q[b0 : b0 + chunk]
        q = q.view(q.shape[0], window, heads, group, -1).permute(0, 2, 3, 1, 4).flatten(2, 3)  # [b, H, G*W, D]
        probs = torch.softmax((q @ keys.transpose(-1, -2)).float() / math.sqrt(setup.head_dim), dim=-1)
        score = F.avg_pool1d(probs.sum(2), pool, stride=1, padding=pool // 2)  # [b, H, L]
        kept.append(score.topk(keep_count, dim=-1).indices.sort(dim=-1).values)
    return torch.cat(kept)


def window_keep(setup: Setup, key: torch.Tensor, requests: Requests, window_q: torch.Tensor,
                keep_count: int, positions: torch.Tensor, pool: int = 7) -> torch.Tensor:
    """SnapKV as serving scores it on the Triton path: the window-score kernel
    over every (request, KV head) of the layer at once, through the page
    tables (the token ``L - 1`` in the standard region, the others compacted
    at ``positions``), SnapKV's average pooling, the top ``keep_count``."""
    from vllm_kvevict.policies.snapkv import pool_votes
    from vllm_kvevict.triton_kernels.window_scores import window_votes

    length = requests.length
    votes = window_votes(window_q.transpose(1, 2), key, requests.plain, requests.scale,
                         compacted_positions=positions, max_len=length)
    lengths = torch.full(votes.shape[:2], length, device=votes.device)
    score = pool_votes(votes, lengths, pool, "avg")
    return score.topk(keep_count, dim=-1).indices.sort(dim=-1).values


def hole_filling_order(kept_sorted: torch.Tensor, length: int) -> torch.Tensor:
    """Destination order that leaves every kept token below the new length ``K``
    in place and moves the kept tokens at or above it into the holes (evicted
    slots below ``K``), so only as many tokens move as were evicted there."""
    batch, heads, keep_count = kept_sorted.shape
    device = kept_sorted.device
    kept_mask = torch.zeros(batch, heads, length, dtype=torch.bool, device=device)
    kept_mask.scatter_(2, kept_sorted, True)
    below = torch.arange(keep_count, device=device)
    above = torch.arange(keep_count, length, device=device)
    # Sorting keys that push non-members past every member lists the holes
    # (resp. the kept tokens above K) first, in position order; both lists
    # have the same number of members.
    holes = torch.where(kept_mask[..., :keep_count], keep_count + below, below).sort(dim=-1).values
    tail = torch.where(kept_mask[..., keep_count:], above, length + above).sort(dim=-1).values
    pairs = min(keep_count, length - keep_count)
    holes, tail = holes[..., :pairs], tail[..., :pairs]
    target = torch.where(holes < keep_count, holes, keep_count)  # non-pairs land in a spare column
    order = torch.arange(keep_count + 1, device=device).expand(batch, heads, keep_count + 1).clone()
    order.scatter_(2, target, tail)
    return order[..., :keep_count]


def target_eviction(setup: Setup, args: argparse.Namespace, copy_bw: float) -> dict | None:
    """Target 2: one eviction step of every layer against one decode step of every layer."""
    from vllm_kvevict.triton_kernels.compact_head_pages import compact_head_pages
    from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention

    batch, length, layers, evict = args.batch, args.length, args.layers, args.evict_tokens
    layer_bytes = setup.kv_bytes(batch, length)
    print(f"\n## Target 2: one eviction step against one decode step, all {layers} layers\n")
    print(
        f"B = {batch}, L = {length:,} tokens per KV head, {args.dtype}, {layers} layers x {setup.kv_heads} KV heads x "
        f"{setup.group} query heads each, head_dim {setup.head_dim}, page size {setup.page_size}, layout "
        f"{args.layout} ({layers * layer_bytes / 1e9:,.1f} GB of K and V). Eviction step, per layer: SnapKV scores "
        f"over a {args.window}-query window (in torch; with the window-score kernel over every request and head, "
        "as the Triton path serves it), then every head evicts "
        f"{evict} tokens with the compaction "
        "kernel in place (sequence order; hole filling: only the kept tokens past the new end move), the evicted "
        "tokens folded into the moments. Decode step: the Triton attention of every layer (no other model work). "
        "Keys once: one read of every layer's keys at the measured copy bandwidth. "
        f"Per decode step: the eviction's share when it runs every {args.decode_interval} decode steps.\n"
    )
    if length % setup.page_size or length <= evict:
        print("skipped: the length must be a multiple of the page size and exceed --evict-tokens")
        return None
    # Scratch beside the caches: the compaction's copy of the kept tokens, the
    # score's key gather and fp32 probabilities (about two layers' worth).
    distinct = fits(setup, (layers + 2.5) * layer_bytes, args.memory_fraction)
    allocated = layers if distinct else 1
    if not fits(setup, (allocated + 2.5) * layer_bytes, args.memory_fraction):
        print(f"skipped: one layer ({layer_bytes / 1e9:.1f} GB) and its scratch do not fit")
        return None
    num_blocks = batch * length // setup.page_size
    raw, caches = make_kv_cache(setup, allocated, num_blocks, args.layout)
    if not distinct:
        print(f"(the {layers} layers do not fit at once: each step runs {layers} times over one layer's cache)\n")
    views = [caches[layer % allocated] for layer in range(layers)]
    requests = make_requests(setup, batch, length)
    window_q = torch.randn(batch, args.window, setup.q_heads, setup.head_dim, device=setup.device, dtype=setup.dtype)
    keep_count = length - evict
    heads = setup.kv_heads
    i32 = dict(dtype=torch.int32, device=setup.device)
    src_lens = torch.full((batch, heads), length, **i32)
    # In place: each head's own pages, from the first.
    after = replace(requests.with_moments, head_lens=torch.full((batch, heads), keep_count, **i32))
    positions = torch.arange(length - 1, dtype=torch.int32, device=setup.device).expand(batch, heads, -1)
    kept = [snapkv_keep(setup, key, requests, window_q, keep_count).to(torch.int32) for key, _ in caches]
    holes = [hole_filling_order(k.long(), length).to(torch.int32).contiguous() for k in kept]

    def decode_step() -> None:
        for key, value in views:
            head_paged_attention(requests.query, key, value, requests.plain, requests.scale, max_seq_len=length)

    def scores() -> None:
        for key, _ in views:
            snapkv_keep(setup, key, requests, window_q, keep_count)

    def kernel_scores() -> None:
        for key, _ in views:
            window_keep(setup, key, requests, window_q, keep_count, positions)

    def compaction(orders: list[torch.Tensor]) -> Callable[[], None]:
        # Repeated runs move the same addresses (the data changes, the work does not).
        def run() -> None:
            for layer, (key, value) in enumerate(views):
                compact_head_pages(key, value, requests.src_tokens, src_lens, orders[layer % allocated], after)

        return run

    t_decode = setup.timer(decode_step)
    t_engine = setup.timer(engine_step(setup, raw, allocated, num_blocks, args.layout, requests, window_q, layers,
                                       evict, "head_pages"))
    t_slots = setup.timer(engine_step(setup, raw, allocated, num_blocks, args.layout, requests, window_q, layers,
                                      evict, "slots"))
    t_moments = setup.timer(engine_step(setup, raw, allocated, num_blocks, args.layout, requests, window_q, layers,
                                        evict, "head_pages", "momentkv"))
    t_critical = setup.timer(engine_step(setup, raw, allocated, num_blocks, args.layout, requests, window_q, layers,
                                         evict, "head_pages", "criticalkv"))
    t_layers = None
    if args.layout == "LBHNC":
        t_layers = setup.timer(engine_step(setup, raw, allocated, num_blocks, args.layout, requests, window_q,
                                           layers, evict, "head_pages", every_layer=True))
    t_score = setup.timer(scores)
    t_kernel = setup.timer(kernel_scores)
    t_ordered = setup.timer(compaction(kept))
    t_holes = setup.timer(compaction(holes))
    t_evict = t_score + t_ordered
    t_evict_kernel = t_kernel + t_holes
    t_keys = layers * layer_bytes / 2 / (copy_bw / 2)  # each layer's K once, at the copy's read rate
    result = {
        "layout": args.layout, "batch": batch, "length": length, "layers": layers, "layers_allocated": allocated,
        "kv_heads": heads, "group": setup.group, "head_dim": setup.head_dim, "dtype": args.dtype,
        "evict_tokens": evict, "window": args.window, "decode_interval": args.decode_interval,
        "decode_step_us": t_decode * 1e6, "score_us": t_score * 1e6, "compaction_us": t_ordered * 1e6,
        "compaction_hole_filling_us": t_holes * 1e6, "eviction_step_us": t_evict * 1e6,
        "eviction_over_decode": t_evict / t_decode,
        "eviction_over_decode_per_step": t_evict / t_decode / args.decode_interval,
        "kernel_score_us": t_kernel * 1e6, "keys_once_us": t_keys * 1e6, "kernel_score_over_keys_once": t_kernel / t_keys,
        "kernel_eviction_step_us": t_evict_kernel * 1e6, "kernel_eviction_over_decode": t_evict_kernel / t_decode,
        "kernel_eviction_over_decode_per_step": t_evict_kernel / t_decode / args.decode_interval,
        "engine_eviction_step_us": t_engine * 1e6, "engine_eviction_over_decode": t_engine / t_decode,
        "engine_eviction_over_decode_per_step": t_engine / t_decode / args.decode_interval,
        "engine_slots_eviction_step_us": t_slots * 1e6, "engine_slots_eviction_over_decode": t_slots / t_decode,
        "engine_momentkv_eviction_step_us": t_moments * 1e6,
        "engine_momentkv_eviction_over_decode": t_moments / t_decode,
        "engine_criticalkv_eviction_step_us": t_critical * 1e6,
        "engine_criticalkv_eviction_over_decode": t_critical / t_decode,
        "engine_every_layer_eviction_step_us": t_layers * 1e6 if t_layers is not None else None,
        "engine_every_layer_eviction_over_decode": t_layers / t_decode if t_layers is not None else None,
    }
    print(
        "| scores | decode step (µs) | scores (µs) | keys once (µs) | compaction (µs) | compaction, hole filling (µs) | "
        "eviction step (µs) | eviction / decode | per decode step |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for label, t_s, t_c in (("torch", t_score, t_ordered), ("window-score kernel, hole filling", t_kernel, t_holes)):
        t_e = t_s + t_c
        print(
            f"| {label} | {t_decode * 1e6:,.0f} | {t_s * 1e6:,.0f} | {t_keys * 1e6:,.0f} | {t_ordered * 1e6:,.0f} | "
            f"{t_holes * 1e6:,.0f} | {t_e * 1e6:,.0f} | {t_e / t_decode:.2f}x | "
            f"{100 * t_e / t_decode / args.decode_interval:.1f}% |",
            flush=True,
        )
    for label, t_e in (
        ("the served path, head pages (compact_head_pages_many, AdaKV + SnapKV, the layer's requests as one batch)",
         t_engine),
        ("the served path, slots (evict_slots_many, SnapKV, the layer's requests as one batch)", t_slots),
        ("the served path, head pages, MomentKV (AdaKV, one round, the moments folded; one batch)", t_moments),
        ("the served path, head pages, CriticalKV (AdaKV, Expected Attention's base, the value factor by its "
         "kernel; one batch)", t_critical),
        *((("the served path, head pages, every layer at the step's end (compact_layers_many, AdaKV + SnapKV, "
            "every request and layer as one batch)", t_layers),) if t_layers is not None else ()),
    ):
        print(
            f"| {label} | {t_decode * 1e6:,.0f} | | {t_keys * 1e6:,.0f} | | | {t_e * 1e6:,.0f} | "
            f"{t_e / t_decode:.2f}x | {100 * t_e / t_decode / args.decode_interval:.1f}% |",
            flush=True,
        )
    return result


def target_value_factor(setup: Setup, args: argparse.Namespace, decode_us: float | None) -> dict | None:
    """CriticalKV's and DefensiveKV's value factor over one layer's retained tokens."""
    from vllm_kvevict.policies.criticalkv import projected_value_norms_torch
    from vllm_kvevict.triton_kernels.value_norms import projected_value_norms

    batch, length, layers, heads = args.batch, args.length, args.layers, setup.kv_heads
    d_model = setup.q_heads * setup.head_dim
    tokens = batch * length
    flop = 2 * tokens * setup.q_heads * setup.head_dim * d_model
    print("\n## The value factor of CriticalKV and DefensiveKV, one layer\n")
    print(
        f"‖v W_O‖₁ per query head, averaged over the group, for every retained token of one layer: "
        f"{batch} x {length:,} tokens x {heads} KV heads, d_model {d_model:,} (query heads x head_dim), "
        f"{args.dtype} values and W_O (a view of o_proj.weight.T), {flop / 1e12:,.2f} TFLOP. Kernel: Triton, one launch, "
        "no [tokens, G x d_model] product stored (what a GPU scores with); torch: one KV head at a time in fp32, "
        "at most 256 MiB of product at a time (the fallback without Triton). All layers: the one-layer time x "
        f"{layers}.\n"
    )
    values_bytes = tokens * heads * setup.head_dim * setup.element_size
    if not fits(setup, 3 * values_bytes + (1 << 29), args.memory_fraction):
        print(f"skipped: one layer's values ({values_bytes / 1e9:.1f} GB) and the torch path's scratch do not fit")
        return None
    values = torch.randn(heads, tokens, setup.head_dim, device=setup.device, dtype=setup.dtype)
    weight = torch.randn(d_model, d_model, device=setup.device, dtype=setup.dtype) / d_model**0.5
    projection = weight.t().reshape(setup.q_heads, setup.head_dim, d_model)
    t_kernel = setup.timer(lambda: projected_value_norms(values, projection))
    t_torch = setup.timer(lambda: projected_value_norms_torch(values, projection))
    result = {
        "tokens_per_head": tokens, "d_model": d_model, "tflop": flop / 1e12,
        "kernel_us": t_kernel * 1e6, "kernel_tflops": flop / t_kernel / 1e12,
        "torch_us": t_torch * 1e6, "torch_tflops": flop / t_torch / 1e12,
        "kernel_all_layers_over_decode": layers * t_kernel * 1e6 / decode_us if decode_us else None,
    }
    print("| path | one layer (µs) | TFLOP/s | all layers (ms) | all layers / decode step |")
    print("|---|---|---|---|---|")
    for label, t in (("Triton kernel", t_kernel), ("torch", t_torch)):
        ratio = f"{layers * t * 1e6 / decode_us:,.1f}x" if decode_us else "n/a"
        print(f"| {label} | {t * 1e6:,.0f} | {flop / t / 1e12:,.1f} | {layers * t * 1e3:,.1f} | {ratio} |", flush=True)
    return result


# --------------------------------------------------------------------------- smoke


def smoke_check(setup: Setup) -> None:
    """Both kernels against their torch references on vLLM's views in both
    layouts (catches a script that times wrong results)."""
    from vllm_kvevict.moments import EvictedMoments
    from vllm_kvevict.triton_kernels.compact_head_pages import compact_head_pages, compact_head_pages_reference
    from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention, head_paged_attention_reference
    from vllm_kvevict.triton_kernels.window_scores import window_votes, window_votes_reference

    batch, length, heads = 2, 4 * setup.page_size, setup.kv_heads
    requests = make_requests(setup, batch, length)
    num_blocks = batch * length // setup.page_size
    window_q = torch.randn(batch, 4, setup.q_heads, setup.head_dim, device=setup.device, dtype=setup.dtype)
    i32 = dict(dtype=torch.int32, device=setup.device)
    for layout in LAYOUTS:
        raw, ((key, value),) = make_kv_cache(setup, 1, num_blocks, layout)
        args = (requests.query, key, value, requests.with_moments, requests.scale)
        out, lse = head_paged_attention(*args)
        ref_out, ref_lse = head_paged_attention_reference(*args)
        torch.testing.assert_close(out, ref_out, atol=3e-2, rtol=3e-2)
        torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=3e-2)
        kept = hole_filling_order(snapkv_keep(setup, key, requests, window_q, length - 5), length).to(torch.int32)
        results = []
        for fn in (compact_head_pages, compact_head_pages_reference):
            buffer = raw.clone()
            k, v = layer_kv_views(buffer, 1, num_blocks, setup, layout, 0)
            s = requests.with_moments.moments
            s = EvictedMoments(s.count.clone(), s.key_mean.clone(), s.value_mean.clone(), s.cross_cov.clone())
            after = replace(requests.with_moments, head_lens=torch.full((batch, heads), length - 5, **i32), moments=s)
            fn(k, v, requests.src_tokens, torch.full((batch, heads), length, **i32), kept, after)
            results.append((buffer, s.cross_cov, s.count))
        assert torch.equal(results[0][0], results[1][0])  # kept tokens are copied bit for bit
        positions = torch.arange(length - 1, **i32).expand(batch, heads, -1)
        votes = [fn(window_q.transpose(1, 2), key, requests.plain, requests.scale, compacted_positions=positions,
                    max_len=length) for fn in (window_votes, window_votes_reference)]
        torch.testing.assert_close(votes[0], votes[1], atol=1e-3, rtol=1e-2)
        for got, want in zip(results[0][1:], results[1][1:]):
            torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    from vllm_kvevict.triton_kernels.value_norms import projected_value_norms, projected_value_norms_reference

    values = torch.randn(heads, 2 * length, setup.head_dim, device=setup.device, dtype=setup.dtype)
    weight = torch.randn(48, setup.q_heads * setup.head_dim, device=setup.device, dtype=setup.dtype)
    projection = weight.t().reshape(setup.q_heads, setup.head_dim, 48)
    torch.testing.assert_close(
        projected_value_norms(values, projection), projected_value_norms_reference(values, projection),
        atol=1e-3, rtol=1e-4,
    )
    print("smoke check: the four kernels match their torch references (attention, compaction and window votes "
          "on vLLM's views, LBHNC and LBNHC)\n")


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    command = ["python", "benchmarks/kernel_bench.py", *(argv if argv is not None else sys.argv[1:])]
    print(f"Command: `{shlex.join(command)}`\n")
    if not cuda:
        print("kernel_bench.py measures GPU kernels and needs a CUDA GPU; none is visible.")
        if not args.smoke:
            return 1
        # Triton reads this when the kernel modules are imported (below, lazily).
        os.environ["TRITON_INTERPRET"] = "1"
        print("--smoke: tiny shapes on CPU under TRITON_INTERPRET=1 (times are the interpreter's, meaningless).\n")
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    if args.smoke:
        args.batch, args.length, args.layers, args.evict_tokens, args.window = 2, 64, 2, 16, 8
        if not cuda:
            args.kv_heads, args.group, args.head_dim = 2, 2, 32
    setup = Setup(
        device, DTYPES[args.dtype], args.kv_heads, args.group, args.head_dim, args.page_size, make_timer(device)
    )
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    print(f"Device: {name}; torch {torch.__version__}, triton {triton.__version__}.\n")
    copy_bw = copy_bandwidth(setup, (1 << 30) if cuda else (1 << 20))
    print(f"Device-to-device copy: {copy_bw / 1e9:,.0f} GB/s (bytes read + written per second).\n")
    if args.smoke:
        smoke_check(setup)
    decode = target_decode(setup, args, copy_bw)
    eviction = target_eviction(setup, args, copy_bw)
    value_factor = target_value_factor(setup, args, eviction["decode_step_us"] if eviction else None)
    if args.json:
        figures = {
            "command": shlex.join(command), "device": name, "torch": torch.__version__, "triton": triton.__version__,
            "smoke": args.smoke, "copy_GBps": copy_bw / 1e9, "target1_decode": decode, "target2_eviction": eviction,
            "value_factor": value_factor,
        }
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(figures, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
