"""Random head-paged layouts for the kernel tests: where each request's
standard region and each KV head's compacted tokens live in a shuffled pool
of blocks, as the tables the kernels read (vLLM's block table, the per-head
page tables) and the list of slots that hold a live token.

The caller allocates its caches for ``num_blocks`` (every slot poisoned) and
writes random tokens at ``writes``; every slot not listed stays poisoned, so a
kernel that reads past a table reads NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PagedLayout:
    num_blocks: int
    head_lens: torch.Tensor  # [R, H] int64, compacted tokens per head
    block_table: torch.Tensor  # [R, max_blocks] int32; unused entries name a spare block
    head_page_table: torch.Tensor  # [R, H, P] int32; unused entries name a page of another spare block
    writes: list[tuple[int, int, slice]]  # (block, KV head, offsets): slots holding a live token


def random_paged_layout(
    gen: torch.Generator,
    *,
    requests: list[tuple[int, int]],
    heads: int,
    page_size: int,
    max_compacted: int,
    prefixes: list[int] | None = None,
) -> PagedLayout:
    """``requests``: ``(region_start, seq_len)`` each: the standard region is
    slots ``[region_start, seq_len)`` of the request's blocks, after a
    protected prefix ``[0, prefixes[r])`` (whole pages). Compacted lengths are
    random in ``[0, max_compacted]`` with a zero and a whole number of pages
    among them; the heads' pages are shuffled over blocks of their own."""
    num_requests = len(requests)
    prefix_list = prefixes or [0] * num_requests
    head_lens = torch.randint(0, max_compacted + 1, (num_requests, heads), generator=gen)
    head_lens.view(-1)[0] = 0
    head_lens.view(-1)[-1] = page_size * max(1, max_compacted // page_size)
    compacted_pages = [[-(-int(n) // page_size) for n in row] for row in head_lens]
    region_blocks = [
        list(range(prefix // page_size)) + list(range(start // page_size, -(-seq_len // page_size)))
        for (start, seq_len), prefix in zip(requests, prefix_list)
    ]
    num_region_blocks = sum(map(len, region_blocks))
    spare = 2  # never referenced: unused table entries point here
    num_blocks = num_region_blocks + -(-sum(map(sum, compacted_pages)) // heads) + spare
    order = torch.randperm(num_blocks, generator=gen).tolist()
    region_ids, compacted_ids = order[:num_region_blocks], order[num_region_blocks : num_blocks - spare]
    spare_ids = order[num_blocks - spare :]
    free_pages = [b * heads + s for b in compacted_ids for s in range(heads)]
    free_pages = [free_pages[i] for i in torch.randperm(len(free_pages), generator=gen).tolist()]

    max_blocks = max(-(-seq_len // page_size) for _, seq_len in requests) + 1
    block_table = torch.full((num_requests, max_blocks), spare_ids[0], dtype=torch.int32)
    max_pages = max(max(map(max, compacted_pages)), 1) + 1
    head_page_table = torch.full(
        (num_requests, heads, max_pages), spare_ids[1] * heads + 1 % heads, dtype=torch.int32
    )
    writes: list[tuple[int, int, slice]] = []
    next_region = 0
    for r, (start, seq_len) in enumerate(requests):
        for column in region_blocks[r]:
            block = region_ids[next_region]
            next_region += 1
            block_table[r, column] = block
            first = max(start, column * page_size) - column * page_size
            last = min(seq_len, (column + 1) * page_size) - column * page_size
            if column < prefix_list[r] // page_size:
                first, last = 0, page_size  # a whole prefix page
            writes.extend((block, h, slice(first, last)) for h in range(heads))
        for h in range(heads):
            length = int(head_lens[r, h])
            for p in range(compacted_pages[r][h]):
                page = free_pages.pop()
                head_page_table[r, h, p] = page
                writes.append((page // heads, page % heads, slice(0, min(page_size, length - p * page_size))))
    return PagedLayout(num_blocks, head_lens, block_table, head_page_table, writes)


def poisoned_cache(
    num_blocks: int, heads: int, page_size: int, head_dim: int, dtype: torch.dtype, strided: bool, device: str
) -> torch.Tensor:
    """A NaN-filled logical ``[num_blocks, H, page_size, D]`` cache; ``strided``:
    a view of vLLM's GPU layout ``[num_blocks, page_size, H, D]``, rows padded
    (as a slice of a fused KV tensor would be) so no stride is the natural one."""
    poison = float("nan")
    if strided:
        physical = torch.full((num_blocks, page_size, heads, head_dim + 8), poison, dtype=dtype, device=device)
        cache = physical[..., :head_dim].permute(0, 2, 1, 3)
        assert not cache.is_contiguous()
        return cache
    return torch.full((num_blocks, heads, page_size, head_dim), poison, dtype=dtype, device=device)
