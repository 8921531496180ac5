"""Attention over per-(request, KV-head) page tables, with the evicted-token
summary folded into the same softmax.

Storage (one layer). A vLLM block ``b`` holds one *head-page* per KV-head slot
``s``: ``page = b * H + s`` addresses ``cache[b, s]``, ``page_size`` tokens of
``D`` values. A request's KV head ``h`` reads, in order:

1. its *compacted* tokens: ``head_lens[r, h]`` tokens filling the pages
   ``head_page_table[r, h, :]`` in order (a page of any slot ``s``: heads that
   keep more tokens borrow the head-pages of heads that keep fewer). They were
   kept by evictions at or before ``region_start[r]``, so every query sees all
   of them;
2. its *standard region*: the slots ``[region_start[r], seq_lens[r])`` of the
   request's block table, where vLLM's cache writer puts new tokens (head
   ``h``'s token at slot ``t`` is in page ``block_table[r, t // page_size] * H + h``
   at offset ``t % page_size``). Causal: a query at position ``p`` reads slots
   ``<= p``;
3. optionally the summary of what it has evicted (MomentKV, see
   ``evicted_summary``), one more partial softmax state.

The request's ``T`` queries are the last ``T`` positions ``seq_len - T ..
seq_len - 1``. GQA: query head ``j`` reads KV head ``j // G``.

This file holds the torch reference (the semantics every kernel is tested
against).
"""

from __future__ import annotations

import torch

from vllm_kvevict.triton_kernels.evicted_summary import (
    EvictedSummary,
    merge_partial_states,
    summary_partial_state,
)


def head_tokens_reference(
    cache: torch.Tensor,
    head: int,
    pages: torch.Tensor,
    length: int,
    block_ids: torch.Tensor,
    region_start: int,
    region_end: int,
) -> torch.Tensor:
    """Head ``head``'s tokens of one request, ``[length + region_end - region_start, D]``:
    its compacted tokens, then its standard-region slots.

    ``cache`` is logical, ``[num_blocks, H, page_size, D]``.
    """
    num_heads, page_size, head_dim = cache.shape[1:]
    flat = cache.reshape(-1, page_size, head_dim)
    num_pages = -(-length // page_size)
    compacted = flat[pages[:num_pages].long()].reshape(-1, head_dim)[:length]
    slots = torch.arange(region_start, region_end, device=cache.device)
    standard = cache[block_ids[slots // page_size].long(), head, slots % page_size]
    return torch.cat([compacted, standard])


def head_paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    head_page_table: torch.Tensor,
    head_lens: torch.Tensor,
    block_table: torch.Tensor,
    region_start: torch.Tensor,
    scale: float,
    summary: EvictedSummary | None = None,
    summary_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its head's compacted tokens, standard region
    and evicted summary.

    Args:
        query: ``[T, Hq, D]``.
        key_cache, value_cache: logical ``[num_blocks, H, page_size, D]``.
        query_start_loc: ``[R + 1]``; request ``r`` owns queries
            ``query_start_loc[r] : query_start_loc[r + 1]``.
        seq_lens: ``[R]``, tokens of each request including this step's.
        head_page_table: ``[R, H, max_pages]`` head-page ids ``block * H + slot``.
        head_lens: ``[R, H]`` compacted tokens per head.
        block_table: ``[R, max_blocks]`` vLLM block ids.
        region_start: ``[R]`` first slot of the standard region.
        summary, summary_rows: evicted-token summaries and each request's row
            in them (``-1``: none).

    Returns:
        ``(out [T, Hq, D], lse [T, Hq])`` in fp32; ``lse`` is the natural-log
        partition function including the summary; a head with nothing to read
        gives ``out = 0, lse = -inf``.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[1]
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.full((num_tokens, num_q_heads), float("-inf"), device=query.device)
    starts = query_start_loc.tolist()
    for r in range(len(starts) - 1):
        first, last = starts[r], starts[r + 1]
        if last == first:
            continue
        seq_len, start = int(seq_lens[r]), int(region_start[r])
        positions = torch.arange(seq_len - (last - first), seq_len, device=query.device)
        for h in range(num_kv_heads):
            length = int(head_lens[r, h])
            args = (h, head_page_table[r, h], length, block_table[r], start, seq_len)
            keys = head_tokens_reference(key_cache, *args).float()
            values = head_tokens_reference(value_cache, *args).float()
            q = query[first:last, h * group : (h + 1) * group].float()  # [t, G, D]
            logits = torch.einsum("tgd,sd->tgs", q, keys) * scale
            slot = torch.arange(keys.shape[0], device=query.device) - length + start
            visible = (slot[None, :] <= positions[:, None]) | (slot[None, :] < start)
            logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
            part_lse = torch.logsumexp(logits, dim=-1)  # [t, G]
            probs = torch.exp(logits - part_lse.unsqueeze(-1)).nan_to_num(0.0)
            part_out = torch.einsum("tgs,sd->tgd", probs, values)
            if summary is not None and summary_rows is not None and int(summary_rows[r]) >= 0:
                row = int(summary_rows[r])
                e_out, e_lse = summary_partial_state(
                    q,
                    summary.count[row, h],
                    summary.key_mean[row, h],
                    summary.value_mean[row, h],
                    summary.cross_cov[row, h],
                    scale,
                )
                part_out, part_lse = merge_partial_states(part_out, part_lse, e_out, e_lse)
            out[first:last, h * group : (h + 1) * group] = part_out
            lse[first:last, h * group : (h + 1) * group] = part_lse
    return out, lse
