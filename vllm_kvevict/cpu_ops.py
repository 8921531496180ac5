"""CPU attention over per-(request, KV-head) page tables on vLLM's CPU KV cache.

Two implementations of one interface (:func:`head_paged_attention`):

* the C++ (OpenMP) kernel ``csrc/head_paged_attention.cpp``, JIT-built on first
  use by :func:`load_cpu_ops` with torch's extension loader;
* :func:`head_paged_attention_torch`, the same computation in torch: the
  ``attention_kernel="torch"`` serving path and the fallback when the kernel
  cannot be built (no compiler, a failed build).

Both read one layer's cache ``kv_cache [num_blocks, H, 2 * page_size, D]``:
``num_blocks * H`` head-pages (``page = block * H + slot``), each a K page then
a V page. Compacted head-pages (``head_page_table``) hold their tokens in the
plain logical order (element ``(t, d)`` at ``t * D + d`` of the page);
standard-region pages (the request's ``block_table``) are in vLLM's ISA layout,
read through the probed offset tables of
:class:`~vllm_kvevict.vllm_glue.cpu_page_layout.PageLayout`. The batch
(:class:`~vllm_kvevict.triton_kernels.batch.HeadPagedBatch`) and the semantics
are those of
:func:`~vllm_kvevict.triton_kernels.head_paged_attention.head_paged_attention_reference`
on the logical cache.

Also here, the other torch code of the CPU serving path:
:func:`attend_head_tokens` (the attention both torch implementations share)
and :func:`region_attention` (``attention_kernel="torch"`` with ``slots``
storage).
"""

from __future__ import annotations

import hashlib
import logging
import platform
import threading
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Callable

import torch

from vllm_kvevict.eviction.moments import merge_partial_states
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch

logger = logging.getLogger(__name__)

_EXTENSION_NAME = "kvevict_cpu_ops"
_SOURCE = "head_paged_attention.cpp"

_lock = threading.Lock()
_loaded = False
_module: ModuleType | None = None


def _cpu_fingerprint() -> str:
    """A short hash of what ``-march=native`` compiles for: builds are cached
    per CPU so that a cache directory shared between machines (a container
    image, a network home) never hands one CPU another's instructions."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features", "model name", "CPU part"):
                    text += line
                if key in ("flags", "Features"):
                    break  # the first processor is enough
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _build_directory() -> Path:
    from vllm_kvevict.paths import cache_dir

    path = cache_dir() / "torch_extensions" / f"{_EXTENSION_NAME}-{_cpu_fingerprint()}"
    path.mkdir(parents=True, exist_ok=True)
    return path


def _source_path() -> Path:
    # The sources ship as package data of vllm_kvevict.csrc (the repository's
    # csrc/ folder), so an installed (non-editable) package finds them too.
    return Path(str(resources.files("vllm_kvevict.csrc").joinpath(_SOURCE)))


def load_cpu_ops() -> ModuleType | None:
    """The compiled extension, built on first use (cached on disk), or None.

    torch's loader serialises concurrent builds of one directory across
    processes (a lock file) and reuses a finished build. A missing compiler or
    a failed build logs one warning and gives None: callers fall back to
    :func:`head_paged_attention_torch`.
    """
    global _loaded, _module
    with _lock:
        if _loaded:
            return _module
        _loaded = True
        try:
            from torch.utils import cpp_extension

            source = _source_path()
            if not source.is_file():
                raise FileNotFoundError(f"kernel source {source} is not installed")
            _module = cpp_extension.load(
                name=_EXTENSION_NAME,
                sources=[str(source)],
                extra_cflags=["-O3", "-march=native", "-fopenmp", "-DNDEBUG"],
                extra_ldflags=["-fopenmp"],
                build_directory=str(_build_directory()),
                verbose=False,
            )
        except Exception as exc:  # no compiler, no ninja, a compile error
            _module = None
            logger.warning(
                "vllm-kvevict: the C++ CPU attention kernel is unavailable (%s: %s); "
                "using the torch implementation",
                type(exc).__name__,
                _reason(exc),
            )
        return _module


def _reason(exc: BaseException) -> str:
    """The informative line of a build error: the compiler's first "error"
    line rather than ninja's closing "build stopped"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    return (errors or lines[-1:] or [repr(exc)])[0]


# --------------------------------------------------------------------- torch path


def region_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    region_start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's queries over its live region.

    Args:
        query: ``[T, Hq, D]``, the queries of the last ``T`` positions
            ``seq_len - T .. seq_len - 1`` where ``seq_len = region_start + S``.
        keys, values: ``[H, S, D]``, the tokens in slots
            ``[region_start, seq_len)``: the retained tokens (in original order)
            followed by the new ones at their true slots.

    A slot never holds a token later than its own index, and every retained
    token precedes every new one, so "slot <= query position" is exactly the
    causal mask. GQA: query head ``j`` reads KV head ``j // G``. Returns
    ``[T, Hq, D]`` in fp32.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, length, _ = keys.shape
    group = num_q_heads // num_kv_heads
    seq_len = region_start + length
    q = query.float().reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    logits = torch.einsum("hgtd,hsd->hgts", q, keys.float()) * scale
    key_slots = torch.arange(region_start, seq_len, device=query.device)
    query_positions = torch.arange(seq_len - num_tokens, seq_len, device=query.device)
    future = key_slots[None, :] > query_positions[:, None]  # [T, S]
    logits = logits.masked_fill(future, float("-inf"))
    out = torch.einsum("hgts,hsd->hgtd", torch.softmax(logits, dim=-1), values.float())
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)


def attend_head_tokens(
    query: torch.Tensor,
    num_kv_heads: int,
    batch: HeadPagedBatch,
    read_head_tokens: Callable[[int, int, int, int, int], tuple[torch.Tensor, torch.Tensor]],
    scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
) -> None:
    """Attention over per-head page tables, one (request, KV head) at a time,
    into ``out [T, Hq, D]`` and ``lse [T, Hq]`` (fp32).

    ``read_head_tokens(r, h, length, region_start, seq_len)`` returns head
    ``h``'s keys and values: its ``length`` compacted tokens, then its standard
    slots ``[region_start, seq_len)``; callers differ only in where those live.
    """
    query_start_loc, seq_lens, _, region_start = batch.for_attention()
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    seq_list, region_list, lens = seq_lens.tolist(), region_start.tolist(), batch.head_lens.tolist()
    rows = batch.moment_rows.tolist() if batch.has_moments else None
    for r in range(len(starts) - 1):
        first, last = starts[r], starts[r + 1]
        if last == first:
            continue
        seq_len, start = int(seq_list[r]), int(region_list[r])
        positions = torch.arange(seq_len - (last - first), seq_len, device=query.device)
        for h in range(num_kv_heads):
            length = int(lens[r][h])
            keys, values = read_head_tokens(r, h, length, start, seq_len)
            q = query[first:last, h * group : (h + 1) * group].float()  # [t, G, D]
            logits = torch.einsum("tgd,sd->tgs", q, keys.float()) * scale
            # Compacted tokens are visible to every query, standard slots causally.
            slot = torch.arange(keys.shape[0], device=query.device) - length + start
            visible = (slot[None, :] <= positions[:, None]) | (slot[None, :] < start)
            logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
            part_lse = torch.logsumexp(logits, dim=-1)  # [t, G]
            probs = torch.exp(logits - part_lse.unsqueeze(-1)).nan_to_num(0.0)
            part_out = torch.einsum("tgs,sd->tgd", probs, values.float())
            if rows is not None and int(rows[r]) >= 0:
                assert batch.moments is not None
                e_out, e_lse = batch.moments[int(rows[r]), h].partial_state(q, scale)
                part_out, part_lse = merge_partial_states(part_out, part_lse, e_out, e_lse)
            out[first:last, h * group : (h + 1) * group] = part_out
            lse[first:last, h * group : (h + 1) * group] = part_lse


def _head_rows(
    kv_cache: torch.Tensor,
    half: slice,
    offsets: torch.Tensor,
    head: int,
    pages: list[int],
    length: int,
    block_ids: list[int],
    region_start: int,
    seq_len: int,
) -> torch.Tensor:
    """One head's K (``half`` = first half of each head-page) or V rows of one
    request in the cache dtype, ``[length + seq_len - region_start, D]``: its
    compacted tokens (logical pages), then its standard slots (ISA pages read
    through ``offsets``)."""
    page_size, head_dim = kv_cache.shape[2] // 2, kv_cache.shape[3]
    parts: list[torch.Tensor] = []
    num_pages = -(-length // page_size)
    if num_pages:
        ids = torch.tensor(pages[:num_pages], dtype=torch.long)
        by_page = kv_cache.view(-1, 2 * page_size, head_dim)  # [NB * H, 2 * bs, D]
        parts.append(by_page[ids, half].reshape(-1, head_dim)[:length])
    if seq_len > region_start:
        first_block, last_block = region_start // page_size, (seq_len - 1) // page_size
        ids = torch.tensor(block_ids[first_block : last_block + 1], dtype=torch.long)
        isa = kv_cache[ids, head, half].reshape(ids.numel(), page_size * head_dim)
        logical = isa[:, offsets].reshape(-1, head_dim)
        lo = region_start - first_block * page_size
        parts.append(logical[lo : lo + seq_len - region_start])
    if not parts:
        return kv_cache.new_zeros(0, head_dim)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def head_paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    key_offsets: torch.Tensor,
    value_offsets: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_paged_attention` in torch, one (request, KV head) at a time."""
    page_size = kv_cache.shape[2] // 2
    out, lse = _outputs(query, out, lse)
    out.zero_()
    lse.fill_(float("-inf"))
    key_half, value_half = slice(0, page_size), slice(page_size, 2 * page_size)
    key_index = key_offsets.to(torch.long)
    value_index = value_offsets.to(torch.long)
    tables = batch.head_page_table.tolist()
    blocks = batch.for_attention()[2].tolist()

    def read(r: int, h: int, length: int, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        args = (h, tables[r][h], length, blocks[r], start, seq_len)
        return (
            _head_rows(kv_cache, key_half, key_index, *args),
            _head_rows(kv_cache, value_half, value_index, *args),
        )

    attend_head_tokens(query, kv_cache.shape[1], batch, read, scale, out, lse)
    return out, lse


def _outputs(
    query: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = query.shape
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=torch.float32)
    if lse is None:
        lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32)
    return out, lse


# --------------------------------------------------------------------- dispatch


def head_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    key_offsets: torch.Tensor,
    value_offsets: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its KV head's compacted pages, causal
    standard region and evicted-token moments; ``(out [T, Hq, D], lse [T, Hq])``
    in fp32 (natural-log lse, ``0 / -inf`` for a head with nothing to read).

    Args:
        query: ``[T, Hq, D]`` (fp32, bf16 or fp16; the last dim contiguous).
        kv_cache: ``[num_blocks, H, 2 * page_size, D]``, one layer of vLLM's
            CPU cache (fp32, bf16 or fp16).
        key_offsets, value_offsets: ``[page_size * D]`` offset in a K (V) page
            of logical element ``(t, d)`` (``PageLayout.key_index`` /
            ``value_index``).
        batch: the requests' page tables, standard regions and moments (every
            attention field set).
        out, lse: optional preallocated fp32 outputs.
        native: use the C++ kernel when it is available.
    """
    module = load_cpu_ops() if native else None
    if module is None:
        return head_paged_attention_torch(
            query, kv_cache, key_offsets, value_offsets, batch, scale, out, lse
        )
    query_start_loc, seq_lens, block_table, region_start = batch.for_attention()
    out, lse = _outputs(query, out, lse)
    moments = batch.moments if batch.has_moments else None
    module.head_paged_attention(
        query,
        kv_cache.contiguous(),
        query_start_loc.contiguous(),
        seq_lens.contiguous(),
        batch.head_page_table.contiguous(),
        batch.head_lens.contiguous(),
        block_table.contiguous(),
        region_start.contiguous(),
        key_offsets.contiguous(),
        value_offsets.contiguous(),
        float(scale),
        moments.count if moments is not None else None,
        moments.key_mean if moments is not None else None,
        moments.value_mean if moments is not None else None,
        moments.cross_cov if moments is not None else None,
        batch.moment_rows.contiguous() if moments is not None else None,
        out,
        lse,
    )
    return out, lse


__all__ = [
    "attend_head_tokens",
    "head_paged_attention",
    "head_paged_attention_torch",
    "load_cpu_ops",
    "region_attention",
]
