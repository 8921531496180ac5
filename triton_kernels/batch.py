"""What the head-paged kernels read: R requests x H KV heads over
per-(request, KV head) page tables, and their evicted-token moments.

Storage (one layer). A vLLM block ``b`` holds one *head-page* per KV-head slot
``s``: ``page = b * H + s``, ``page_size`` tokens of ``D`` values. A request's
KV head ``h`` reads, in order:

0. optionally its *protected prefix*: the slots ``[0, prefix_lens[r])`` of the
   request's block table (laid out as the standard region below), which
   every query sees (they lie before every query: a prompt's first blocks,
   shared through vLLM's prefix cache and never evicted);
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
3. optionally its row ``moment_rows[r]`` of ``moments`` (MomentKV's statistics
   of what it has evicted), one more partial softmax state.

The request's queries ``query_start_loc[r] : query_start_loc[r + 1]`` are its
last positions before ``seq_lens[r]``. GQA: query head ``j`` reads KV head
``j // G``.

A compaction reads only the page tables and the moments: the kept tokens of
head ``h`` go to ``head_page_table[r, h]`` (``head_lens[r, h]`` of them), its
evicted ones are folded into ``moments`` row ``moment_rows[r]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_kvevict.moments import EvictedMoments


@dataclass
class HeadPagedBatch:
    """Index tensors are int32 or int64; ``moment_rows[r] = -1``: none."""

    head_page_table: torch.Tensor  # [R, H, max_pages] head-page ids block * H + slot
    head_lens: torch.Tensor  # [R, H] compacted tokens per head
    query_start_loc: torch.Tensor | None = None  # [R + 1]; attention only
    seq_lens: torch.Tensor | None = None  # [R] tokens including this step's; attention only
    block_table: torch.Tensor | None = None  # [R, max_blocks] vLLM block ids; attention only
    region_start: torch.Tensor | None = None  # [R] first standard slot; attention only
    moments: EvictedMoments | None = None  # [N, H, ...] rows
    moment_rows: torch.Tensor | None = None  # [R]
    prefix_lens: torch.Tensor | None = None  # [R] protected prefix slots [0, p); attention only

    @property
    def has_moments(self) -> bool:
        return self.moments is not None and self.moment_rows is not None

    def for_attention(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(query_start_loc, seq_lens, block_table, region_start)``, which
        attention needs and a compaction does not."""
        fields = (self.query_start_loc, self.seq_lens, self.block_table, self.region_start)
        if any(f is None for f in fields):
            raise ValueError("attention needs query_start_loc, seq_lens, block_table and region_start")
        return fields  # type: ignore[return-value]
