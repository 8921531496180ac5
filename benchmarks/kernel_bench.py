"""GPU benchmark of the Triton kernels over per-head page tables.

Table 1, decode: one query token per request over ``L`` retained tokens per KV
head, batch ``B``. The Triton kernel (``head_paged_attention``, with and
without a MomentKV summary per head) against a full-cache baseline on the same
KV data (flash-attn's ``flash_attn_with_kvcache`` when importable, else torch
SDPA), with the bytes of KV each reads, the bandwidth achieved, and the
device-to-device copy bandwidth as the yardstick (target: >= 70% of it at
large sizes).

Table 2, eviction: one SnapKV-style eviction step (scores over an observation
window in torch, top-k) plus the compaction kernel (``compact_head_pages``,
evicted tokens folded into the summary), against one decode step of the same
batch. Two compaction orders: sequence order (every kept token after the first
hole shifts down) and hole filling (the last kept tokens move into the holes;
attention over compacted tokens does not depend on their order).

    python benchmarks/kernel_bench.py                  # needs a CUDA GPU
    python benchmarks/kernel_bench.py --lengths 4096,65536 --batches 1,16
    python benchmarks/kernel_bench.py --smoke          # one tiny case; on CPU under TRITON_INTERPRET=1

Without CUDA and without ``--smoke`` it says a GPU is needed and exits 1.

The KV data is laid out the way vLLM's GPU cache is (``[num_blocks,
page_size, H, D]``), read through the kernels' strided logical view
``[num_blocks, H, page_size, D]``; request ``b``'s pages are its own blocks in
order, so the baseline reads the very same tensor as ``[B, L, H, D]``.
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    parser.add_argument("--lengths", type=ints, default=[1024, 4096, 16384, 65536], help="retained tokens per head")
    parser.add_argument("--batches", type=ints, default=[1, 4, 16, 64])
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--group", type=int, default=4, help="query heads per KV head (GQA)")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    parser.add_argument("--evict-tokens", type=int, default=64, help="tokens evicted per head per eviction step")
    parser.add_argument("--window", type=int, default=32, help="SnapKV observation window (queries)")
    parser.add_argument("--memory-fraction", type=float, default=0.8, help="of free GPU memory a case may use")
    parser.add_argument("--smoke", action="store_true", help="one tiny case (on CPU: under the Triton interpreter)")
    return parser.parse_args(argv)


DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


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


def make_timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    """Seconds per call: triton's ``do_bench`` (median, L2 flushed between runs)
    on a GPU; one wall-clock call under the interpreter (a smoke check only)."""
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


@dataclass
class DecodeCase:
    batch: int
    length: int
    query: torch.Tensor  # [B, Hq, D]
    physical_k: torch.Tensor  # [B * L / page_size, page_size, H, D]
    physical_v: torch.Tensor
    key_cache: torch.Tensor  # logical strided view [num_blocks, H, page_size, D]
    value_cache: torch.Tensor
    args: tuple  # (query, key_cache, value_cache, batch without moments, scale)
    summary_args: tuple  # the same with the batch's moments
    src_tokens: torch.Tensor  # [B, H, L] flat addresses of every retained token
    kv_bytes: int


def make_decode_case(setup: Setup, batch: int, length: int) -> DecodeCase:
    """``B`` requests of ``L`` tokens per head: tokens ``0 .. L-2`` compacted
    (head-pages ``block * H + h`` of the request's blocks), token ``L-1`` the
    standard region, so the cache is also a plain ``[B, L, H, D]`` tensor."""
    from vllm_kvevict.eviction.moments import EvictedMoments
    from vllm_kvevict.triton_kernels.batch import HeadPagedBatch

    dev, dt, heads, dim, ps = setup.device, setup.dtype, setup.kv_heads, setup.head_dim, setup.page_size
    pages = length // ps
    num_blocks = batch * pages
    physical_k = torch.randn(num_blocks, ps, heads, dim, device=dev, dtype=dt)
    physical_v = torch.randn(num_blocks, ps, heads, dim, device=dev, dtype=dt)
    key_cache, value_cache = physical_k.permute(0, 2, 1, 3), physical_v.permute(0, 2, 1, 3)
    i32 = dict(dtype=torch.int32, device=dev)
    blocks = torch.arange(num_blocks, **i32).view(batch, pages)
    heads_ix = torch.arange(heads, **i32)
    head_page_table = blocks[:, None, :] * heads + heads_ix[None, :, None]  # [B, H, pages]
    head_lens = torch.full((batch, heads), length - 1, **i32)
    seq_lens = torch.full((batch,), length, **i32)
    region_start = torch.full((batch,), length - 1, **i32)
    query = torch.randn(batch, setup.q_heads, dim, device=dev, dtype=dt)
    query_start_loc = torch.arange(batch + 1, **i32)
    scale = 1.0 / math.sqrt(dim)
    requests = HeadPagedBatch(head_page_table, head_lens, query_start_loc, seq_lens, blocks, region_start)
    args = (query, key_cache, value_cache, requests, scale)
    moments = EvictedMoments.zeros(batch, heads, dim, device=dev)
    moments.count.fill_(100.0)
    moments.key_mean.normal_()
    moments.value_mean.normal_()
    moments.cross_cov.normal_().mul_(10.0)
    with_moments = replace(requests, moments=moments, moment_rows=torch.arange(batch, **i32))
    summary_args = (query, key_cache, value_cache, with_moments, scale)
    token = torch.arange(length, device=dev)
    src_tokens = (head_page_table.long()[..., token // ps] * ps + token % ps).contiguous()  # [B, H, L]
    kv_bytes = 2 * batch * length * heads * dim * physical_k.element_size()
    return DecodeCase(batch, length, query, physical_k, physical_v, key_cache, value_cache, args, summary_args, src_tokens, kv_bytes)


def baseline_attention(case: DecodeCase, setup: Setup) -> tuple[str, Callable[[], torch.Tensor]]:
    """Full-cache decode over the same tensor seen as ``[B, L, H, D]``."""
    batch, length = case.batch, case.length
    heads, dim = setup.kv_heads, setup.head_dim
    k = case.physical_k.view(batch, length, heads, dim)
    v = case.physical_v.view(batch, length, heads, dim)
    if setup.device.type == "cuda":
        try:
            from flash_attn import flash_attn_with_kvcache

            seqlens = torch.full((batch,), length, dtype=torch.int32, device=setup.device)
            q = case.query.unsqueeze(1)  # [B, 1, Hq, D]
            return "flash_attn_with_kvcache", lambda: flash_attn_with_kvcache(q, k, v, cache_seqlens=seqlens)
        except ImportError:
            pass
    q = case.query.unsqueeze(2)  # [B, Hq, 1, D]
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # [B, H, L, D] views, no copy
    return "torch SDPA", lambda: F.scaled_dot_product_attention(q, kt, vt, enable_gqa=True).squeeze(2)


def fits(setup: Setup, nbytes: float, fraction: float) -> bool:
    if setup.device.type != "cuda":
        return True
    free, _ = torch.cuda.mem_get_info(setup.device)
    return nbytes <= fraction * free


def gbps(nbytes: float, seconds: float) -> str:
    return f"{nbytes / seconds / 1e9:,.0f}"


def decode_row(setup: Setup, args: argparse.Namespace, copy_bw: float, batch: int, length: int) -> float | None:
    """One row of the decode table; the Triton time without summary, or None if skipped."""
    from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention

    elt = torch.tensor([], dtype=setup.dtype).element_size()
    kv = 2 * batch * length * setup.kv_heads * setup.head_dim * elt
    if length % setup.page_size or not fits(setup, 1.3 * kv, args.memory_fraction):
        print(f"| {batch} | {length} | {kv / 1e6:,.0f} | skipped: does not fit | | | | | | | | |")
        return None
    case = make_decode_case(setup, batch, length)
    t = setup.timer(lambda: head_paged_attention(*case.args, max_seq_len=length))
    t_summary = setup.timer(lambda: head_paged_attention(*case.summary_args, max_seq_len=length))
    name, baseline = baseline_attention(case, setup)
    try:
        t_base = setup.timer(baseline)
        out = head_paged_attention(*case.args, max_seq_len=length)[0]
        diff = (out - baseline().float().reshape(out.shape)).abs().max().item()
        base_cols = f"{t_base * 1e6:,.1f} | {gbps(case.kv_bytes, t_base)} | {case.kv_bytes / t_base / copy_bw:.0%}"
    except torch.OutOfMemoryError:
        base_cols, diff = "out of memory | | ", float("nan")
    print(
        f"| {batch} | {length} | {case.kv_bytes / 1e6:,.1f} | {t * 1e6:,.1f} | {gbps(case.kv_bytes, t)} | "
        f"{case.kv_bytes / t / copy_bw:.0%} | {t_summary * 1e6:,.1f} | {name} | {base_cols} | {diff:.1e} |",
        flush=True,
    )
    return t


def decode_table(setup: Setup, args: argparse.Namespace, copy_bw: float) -> dict[tuple[int, int], float]:
    print(
        "| B | L / head | KV read (MB) | Triton (µs) | GB/s | % copy | + summary (µs) | "
        "baseline | baseline (µs) | GB/s | % copy | max abs diff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    decode_times: dict[tuple[int, int], float] = {}
    for batch in args.batches:
        for length in args.lengths:
            t = decode_row(setup, args, copy_bw, batch, length)
            if t is not None:
                decode_times[(batch, length)] = t
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()  # the case died with decode_row's frame
    return decode_times


def snapkv_keep(
    setup: Setup, case: DecodeCase, window_q: torch.Tensor, keep_count: int, pool: int = 7
) -> torch.Tensor:
    """SnapKV scores in torch: softmax of the window's queries over each head's
    retained keys, summed over the window and the query group, average-pooled;
    the top ``keep_count`` positions, ``[B, H, keep_count]`` sorted. Requests in
    chunks so the fp32 probabilities stay under ~1 GB."""
    batch, length, heads, group = case.batch, case.length, setup.kv_heads, setup.group
    window = window_q.shape[1]
    chunk = max(1, int(2**30 // (heads * group * window * length * 4)))
    kept = []
    ps = setup.page_size
    for b0 in range(0, batch, chunk):
        flat = case.src_tokens[b0 : b0 + chunk]  # [b, H, L]
        page = flat // ps
        keys = case.key_cache[page // heads, page % heads, flat % ps]  # [b, H, L, D]
        q = window_q[b0 : b0 + chunk]
        q = q.view(q.shape[0], window, heads, group, -1).permute(0, 2, 3, 1, 4).flatten(2, 3)  # [b, H, G*W, D]
        probs = torch.softmax((q @ keys.transpose(-1, -2)).float() / math.sqrt(setup.head_dim), dim=-1)
        score = F.avg_pool1d(probs.sum(2), pool, stride=1, padding=pool // 2)  # [b, H, L]
        kept.append(score.topk(keep_count, dim=-1).indices.sort(dim=-1).values)
    return torch.cat(kept)


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


def eviction_row(
    setup: Setup, args: argparse.Namespace, batch: int, length: int, t_decode: float | None
) -> None:
    from vllm_kvevict.triton_kernels.compact_head_pages import compact_head_pages
    from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention

    evict = args.evict_tokens
    elt = torch.tensor([], dtype=setup.dtype).element_size()
    kv = 2 * batch * length * setup.kv_heads * setup.head_dim * elt
    # Cache + the compaction's scratch copy of the kept tokens + the score's key gather.
    if length % setup.page_size or length <= evict or not fits(setup, 2.6 * kv, args.memory_fraction):
        print(f"| {batch} | {length} | {evict} | skipped: does not fit | | | | |")
        return
    case = make_decode_case(setup, batch, length)
    window_q = torch.randn(batch, args.window, setup.q_heads, setup.head_dim, device=setup.device, dtype=setup.dtype)
    keep_count = length - evict
    t_score = setup.timer(lambda: snapkv_keep(setup, case, window_q, keep_count))
    kept = snapkv_keep(setup, case, window_q, keep_count)
    heads = setup.kv_heads
    requests = case.summary_args[3]
    i32 = dict(dtype=torch.int32, device=setup.device)
    src_lens = torch.full((batch, heads), length, **i32)
    # In place: the head's own pages, from the first.
    after = replace(requests, head_lens=torch.full((batch, heads), keep_count, **i32))

    def compaction(keep: torch.Tensor) -> Callable[[], None]:
        # Repeated runs re-read the same addresses (the data changes, the work does not).
        keep = keep.to(torch.int32).contiguous()
        return lambda: compact_head_pages(
            case.key_cache, case.value_cache, case.src_tokens, src_lens, keep, after
        )

    t_ordered = setup.timer(compaction(kept))
    t_holes = setup.timer(compaction(hole_filling_order(kept, length)))
    if t_decode is None:
        t_decode = setup.timer(lambda: head_paged_attention(*case.args, max_seq_len=length))
    print(
        f"| {batch} | {length} | {evict} | {t_score * 1e6:,.1f} | {t_ordered * 1e6:,.1f} | "
        f"{t_holes * 1e6:,.1f} | {t_decode * 1e6:,.1f} | {(t_score + t_holes) / t_decode:.1f}x |",
        flush=True,
    )


def eviction_table(setup: Setup, args: argparse.Namespace, decode_times: dict[tuple[int, int], float]) -> None:
    print(
        "| B | L / head | evicted / head | SnapKV score (µs) | compaction, sequence order (µs) | "
        "compaction, hole filling (µs) | decode step (µs) | eviction / decode (hole filling) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for batch in args.batches:
        for length in args.lengths:
            eviction_row(setup, args, batch, length, decode_times.get((batch, length)))
            if setup.device.type == "cuda":
                torch.cuda.empty_cache()


def smoke_check(setup: Setup) -> None:
    """Kernels against their references on one tiny case (catches a script
    that times wrong results)."""
    from vllm_kvevict.triton_kernels.compact_head_pages import compact_head_pages, compact_head_pages_reference
    from vllm_kvevict.eviction.moments import EvictedMoments
    from vllm_kvevict.triton_kernels.head_paged_attention import head_paged_attention, head_paged_attention_reference

    case = make_decode_case(setup, 2, 4 * setup.page_size)
    out, lse = head_paged_attention(*case.summary_args)
    ref_out, ref_lse = head_paged_attention_reference(*case.summary_args)
    torch.testing.assert_close(out, ref_out, atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(lse, ref_lse, atol=3e-2, rtol=3e-2)
    length, heads = case.length, setup.kv_heads
    window_q = torch.randn(2, 4, setup.q_heads, setup.head_dim, device=setup.device, dtype=setup.dtype)
    kept = hole_filling_order(snapkv_keep(setup, case, window_q, length - 5), length).to(torch.int32)
    i32 = dict(dtype=torch.int32, device=setup.device)
    results = []
    for fn in (compact_head_pages, compact_head_pages_reference):
        k, v = case.physical_k.clone(), case.physical_v.clone()
        requests = case.summary_args[3]
        s = requests.moments
        s = EvictedMoments(s.count.clone(), s.key_mean.clone(), s.value_mean.clone(), s.cross_cov.clone())
        after = replace(requests, head_lens=torch.full((2, heads), length - 5, **i32), moments=s)
        fn(
            k.permute(0, 2, 1, 3), v.permute(0, 2, 1, 3), case.src_tokens,
            torch.full((2, heads), length, **i32), kept, after,
        )
        results.append((k, v, s.cross_cov, s.count))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)
    print("smoke check: kernels match their torch references")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    print(f"Command: `{shlex.join(['python', 'benchmarks/kernel_bench.py', *(argv if argv is not None else sys.argv[1:])])}`\n")
    if not cuda:
        print("kernel_bench.py measures GPU kernels and needs a CUDA GPU; none is visible.")
        if not args.smoke:
            return 1
        # Triton reads this when the kernel modules are imported (below, lazily).
        os.environ["TRITON_INTERPRET"] = "1"
        print("--smoke: one tiny case on CPU under TRITON_INTERPRET=1 (times are the interpreter's, meaningless).\n")
    import triton

    device = torch.device("cuda" if cuda else "cpu")
    dtype = DTYPES[args.dtype]
    if args.smoke:
        args.lengths, args.batches, args.evict_tokens, args.window = [64], [2], 8, 8
        if not cuda:
            args.kv_heads, args.group, args.head_dim = 2, 2, 32
    setup = Setup(device, dtype, args.kv_heads, args.group, args.head_dim, args.page_size, make_timer(device))
    torch.manual_seed(0)
    name = torch.cuda.get_device_name(device) if cuda else "CPU (Triton interpreter)"
    print(
        f"Device: {name}; torch {torch.__version__}, triton {triton.__version__}; {args.dtype}, "
        f"{args.kv_heads} KV heads x {args.group} query heads each, head_dim {args.head_dim}, "
        f"page size {args.page_size}.\n"
    )
    copy_bw = copy_bandwidth(setup, (1 << 30) if cuda else (1 << 20))
    print(f"Device-to-device copy: {copy_bw / 1e9:,.0f} GB/s (bytes read + written per second).\n")
    if args.smoke:
        smoke_check(setup)
        print()
    print("## Decode: one query token per request, Triton head-paged attention vs a full-cache baseline\n")
    print(
        "KV read = K and V bytes of the retained tokens (the summary adds D² + 2D + 1 fp32 per head). "
        "GB/s = KV read / time; % copy = that over the copy bandwidth. max abs diff: Triton (no summary) "
        "vs baseline outputs on the same data.\n"
    )
    decode_times = decode_table(setup, args, copy_bw)
    print("\n## Eviction step vs one decode step\n")
    print(
        f"Each head evicts {args.evict_tokens} of its L tokens: SnapKV scores over a {args.window}-query window "
        "(torch: gather keys, softmax, pool, top-k), then the compaction kernel in place with the evicted "
        "tokens folded into the MomentKV summary. Decode step: the Triton kernel without summary, as above.\n"
    )
    eviction_table(setup, args, decode_times)
    return 0


if __name__ == "__main__":
    sys.exit(main())
