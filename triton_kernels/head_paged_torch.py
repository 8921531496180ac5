"""Head-paged attention in torch, one (request, KV head) at a time, over the
tokens a reader supplies. Both torch implementations run it: the reference
on the logical cache
(:func:`~vllm_kvevict.triton_kernels.head_paged_attention.head_paged_attention_reference`)
and the CPU serving path on vLLM's CPU cache
(:func:`vllm_kvevict.cpu_ops.head_paged_attention_torch`). The batch and its
semantics are :class:`~vllm_kvevict.triton_kernels.batch.HeadPagedBatch`'s.
Imports neither Triton nor vLLM.
"""

from __future__ import annotations

from typing import Callable

import torch

from vllm_kvevict.moments import merge_partial_states
from vllm_kvevict.triton_kernels.batch import HeadPagedBatch


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
    A protected prefix (``batch.prefix_lens``) is read as the standard slots
    ``[0, prefix)`` with no compacted tokens, before the rest.
    """
    query_start_loc, seq_lens, _, region_start = batch.for_attention()
    num_q_heads = query.shape[1]
    group = num_q_heads // num_kv_heads
    starts = query_start_loc.tolist()
    seq_list, region_list, lens = seq_lens.tolist(), region_start.tolist(), batch.head_lens.tolist()
    prefixes = batch.prefix_lens.tolist() if batch.prefix_lens is not None else [0] * len(seq_list)
    rows = batch.moment_rows.tolist() if batch.has_moments else None
    for r in range(len(starts) - 1):
        first, last = starts[r], starts[r + 1]
        if last == first:
            continue
        seq_len, start, prefix = int(seq_list[r]), int(region_list[r]), int(prefixes[r])
        positions = torch.arange(seq_len - (last - first), seq_len, device=query.device)
        for h in range(num_kv_heads):
            length = int(lens[r][h])
            keys, values = read_head_tokens(r, h, length, start, seq_len)
            if prefix:
                prefix_keys, prefix_values = read_head_tokens(r, h, 0, 0, prefix)
                keys, values = torch.cat([prefix_keys, keys]), torch.cat([prefix_values, values])
                length += prefix
            q = query[first:last, h * group : (h + 1) * group].float()  # [t, G, D]
            logits = torch.einsum("tgd,sd->tgs", q, keys.float()) * scale
            # The prefix and the compacted tokens are visible to every query,
            # standard slots causally.
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
