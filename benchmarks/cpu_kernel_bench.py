"""Decode attention over per-head page tables on the CPU: the C++ kernel
(``vllm_kvevict.cpu_ops``) against its torch path and a full-cache baseline.

    PYTHONSAFEPATH=1 python benchmarks/cpu_kernel_bench.py [--quick]

SmolLM2-135M-like shapes: 3 KV heads, 9 query heads, head_dim 64, page 32.
Every request decodes one token over ``L`` retained tokens per KV head:
``L - 40`` compacted tokens in head-pages (any slot of any block, the order of
a real page table after compaction) plus a standard region of 40 slots
(starting mid-block, in vLLM's ISA page layout) and a MomentKV summary.
Bytes read = the K and V rows attended (B x H x L x D x 2 x element size);
the summary (B x H x (D^2 + 2D + 1) fp32) is not counted. Baseline: torch
``scaled_dot_product_attention`` over contiguous K/V of the same length (one
decode query, GQA), i.e. what a full cache of L tokens costs without paging.
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from vllm_kvevict import cpu_ops
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch
from vllm_kvevict.plugin.backends.cpu.page_layout import PageLayout, probe_page_layout

KV_HEADS, Q_HEADS, HEAD_DIM, PAGE = 3, 9, 64, 32
STANDARD = 40  # slots in each request's standard region
MAX_BYTES = 2 * 1024**3  # skip (batch, length) combinations whose KV is larger


def attn_isa(dtype: torch.dtype) -> str:
    """The page layout vLLM's CPU backend would use on this machine."""
    try:
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        return _get_attn_isa(dtype, PAGE, HEAD_DIM)
    except Exception:  # an older or newer vLLM: the portable layout
        return "vec"


def timeit(fn: Callable[[], object], min_seconds: float, min_runs: int = 5) -> float:
    """Median seconds per call, after one warm-up call."""
    fn()
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < min_runs or time.perf_counter() - started < min_seconds:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) >= 1000:
            break
    return statistics.median(times)


def build(batch: int, length: int, dtype: torch.dtype, layout: PageLayout, seed: int = 0):
    """One layer's CPU cache and the page tables of ``batch`` decoding requests."""
    gen = torch.Generator().manual_seed(seed)
    compacted = length - STANDARD
    pages_per_head = -(-compacted // PAGE)
    # The standard region: slots [start, start + STANDARD), start mid-block.
    start = 4 * PAGE + PAGE // 2
    seq_len = start + STANDARD
    std_blocks = list(range(start // PAGE, -(-seq_len // PAGE)))
    compacted_blocks = pages_per_head  # H heads x pages_per_head head-pages fill them
    blocks_per_request = len(std_blocks) + compacted_blocks
    num_blocks = batch * blocks_per_request
    perm = torch.randperm(num_blocks, generator=gen)
    kv_cache = torch.randn(num_blocks, KV_HEADS, 2 * PAGE, HEAD_DIM, generator=gen).to(dtype)
    block_table = torch.zeros(batch, -(-seq_len // PAGE), dtype=torch.int32)
    head_page_table = torch.zeros(batch, KV_HEADS, pages_per_head, dtype=torch.int32)
    for r in range(batch):
        mine = perm[r * blocks_per_request : (r + 1) * blocks_per_request]
        for i, b in enumerate(std_blocks):
            block_table[r, b] = mine[i]
        pages = torch.stack(
            [mine[len(std_blocks) :] * KV_HEADS + s for s in range(KV_HEADS)], 1
        ).reshape(-1)
        pages = pages[torch.randperm(pages.numel(), generator=gen)][: KV_HEADS * pages_per_head]
        head_page_table[r] = pages.view(KV_HEADS, pages_per_head).to(torch.int32)
    moments = EvictedMoments.zeros(batch, KV_HEADS, HEAD_DIM)
    moments.fold_(
        torch.randn(batch, KV_HEADS, 64, HEAD_DIM, generator=gen),
        torch.randn(batch, KV_HEADS, 64, HEAD_DIM, generator=gen),
    )
    requests = HeadPagedBatch(
        head_page_table=head_page_table,
        head_lens=torch.full((batch, KV_HEADS), compacted, dtype=torch.int32),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32),
        block_table=block_table,
        region_start=torch.full((batch,), start, dtype=torch.int32),
        moments=moments,
        moment_rows=torch.arange(batch, dtype=torch.int32),
    )
    query = torch.randn(batch, Q_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return query, kv_cache, layout.key_index, layout.value_index, requests, 1.0 / math.sqrt(HEAD_DIM)


def time_paged(
    batch: int, length: int, dtype: torch.dtype, layout: PageLayout, seconds: float
) -> tuple[float, float]:
    """Seconds per call of the C++ kernel and of the torch path."""
    args = build(batch, length, dtype, layout)
    out = torch.empty(batch, Q_HEADS, HEAD_DIM)
    lse = torch.empty(batch, Q_HEADS)
    kernel = timeit(lambda: cpu_ops.head_paged_attention(*args, out=out, lse=lse), seconds)
    reference = timeit(lambda: cpu_ops.head_paged_attention_torch(*args), seconds, min_runs=3)
    return kernel, reference


def time_sdpa(batch: int, length: int, dtype: torch.dtype, seconds: float) -> float:
    """Seconds per call of SDPA over a contiguous cache of ``length`` tokens."""
    keys = torch.randn(batch, KV_HEADS, length, HEAD_DIM).to(dtype)
    values = torch.randn(batch, KV_HEADS, length, HEAD_DIM).to(dtype)
    query = torch.randn(batch, Q_HEADS, 1, HEAD_DIM).to(dtype)
    return timeit(
        lambda: F.scaled_dot_product_attention(query, keys, values, enable_gqa=True), seconds
    )


def memcpy_bandwidth() -> float:
    """GB/s of a 512 MiB tensor copy (bytes read + bytes written)."""
    src = torch.ones(128 * 1024**2, dtype=torch.float32)
    dst = torch.empty_like(src)
    seconds = timeit(lambda: dst.copy_(src), 1.0)
    return 2 * src.numel() * 4 / seconds / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer, shorter runs")
    parser.add_argument("--seconds", type=float, default=1.0, help="time per measurement")
    opts = parser.parse_args()
    module = cpu_ops.load_cpu_ops()
    if module is None:
        sys.exit("the C++ kernel did not build; see the warning above")

    lengths = [1024, 4096] if opts.quick else [1024, 4096, 16384, 65536]
    batches = [1, 4] if opts.quick else [1, 4, 16]
    seconds = 0.3 if opts.quick else opts.seconds
    command = "PYTHONSAFEPATH=1 python benchmarks/cpu_kernel_bench.py"
    command += " --quick" if opts.quick else ""
    print(f"```\n{command}\n```\n")
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads; "
        f"H={KV_HEADS} KV heads, Hq={Q_HEADS}, D={HEAD_DIM}, page {PAGE}, "
        f"T=1 per request, {STANDARD}-slot standard region, summary on, "
        f"page layouts {attn_isa(torch.float32)} (fp32) / {attn_isa(torch.bfloat16)} (bf16). "
        f"memcpy: {memcpy_bandwidth():.1f} GB/s (512 MiB copy, read + write).\n"
    )
    print(
        "| dtype | batch | tokens/head | KV read | C++ kernel | GB/s | torch path | speedup "
        "| SDPA full cache | GB/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for dtype in (torch.float32, torch.bfloat16):
        layout = probe_page_layout(PAGE, HEAD_DIM, dtype, attn_isa(dtype))
        for length in lengths:
            for batch in batches:
                if length == 65536 and batch > 1:
                    continue
                kv_bytes = batch * KV_HEADS * length * HEAD_DIM * 2 * torch.finfo(dtype).bits // 8
                if kv_bytes > MAX_BYTES:
                    continue
                kernel, reference = time_paged(batch, length, dtype, layout, seconds)
                sdpa = time_sdpa(batch, length, dtype, seconds)
                name = str(dtype).split(".")[-1]
                print(
                    f"| {name} | {batch} | {length} | {kv_bytes / 1e6:.1f} MB "
                    f"| {kernel * 1e3:.3f} ms | {kv_bytes / kernel / 1e9:.1f} "
                    f"| {reference * 1e3:.2f} ms | {reference / kernel:.1f}x "
                    f"| {sdpa * 1e3:.3f} ms | {kv_bytes / sdpa / 1e9:.1f} |",
                    flush=True,
                )


if __name__ == "__main__":
    main()
