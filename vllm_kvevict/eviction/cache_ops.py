"""What the eviction engine asks of a KV cache, and what it tells about it.

A backend implements :class:`CacheOps` for its device and page layout (vLLM's
CPU pages in :mod:`vllm_kvevict.plugin.backends.cpu.head_pages`). The cache is a
pool of blocks; block ``b`` holds one *head-page* per KV-head slot ``s``
(id ``b * H + s``). Two kinds of storage live in it:

* *slots*: token ``t`` of a request's KV head ``h`` at offset ``t % bs`` of
  head-page ``block_row[t // bs] * H + h``, in whatever order the backend's
  cache writer uses (new tokens always land there);
* *pages*: a head's compacted tokens filling a list of head-pages in order,
  ``bs`` tokens of ``D`` values each, keys and values.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from vllm_kvevict.moments import EvictedMoments


class CacheOps(Protocol):
    @property
    def num_heads(self) -> int:
        """KV heads per block (head-pages per block)."""

    @property
    def block_size(self) -> int:
        """Tokens per head-page."""

    def read_slots(
        self, block_row: torch.Tensor, start: int, end: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``[start, end)`` of every head, ``([H, n, D], [H, n, D])``."""

    def write_slots(
        self, block_row: torch.Tensor, start: int, keys: torch.Tensor, values: torch.Tensor
    ) -> None:
        """Write ``keys, values [H, n, D]`` into slots ``[start, start + n)``."""

    def read_pages(self, pages: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first ``length`` tokens of the head-pages ``pages``, ``([length, D], [length, D])``."""

    def write_pages(self, pages: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys, values [n, D]`` into the head-pages ``pages`` (``cdiv(n, bs)`` of them)."""


@runtime_checkable
class CompactsInPlace(Protocol):
    """A cache that moves a compaction's kept tokens itself, on its device
    (the Triton compaction kernel), instead of the engine reading them out and
    writing them back through :meth:`CacheOps.write_pages`.

    Tokens are named by their *flat address* ``head_page * bs + offset``, the
    same for compacted pages and standard slots.
    """

    def compact(
        self,
        addresses: torch.Tensor,
        live_lens: torch.Tensor,
        kept: torch.Tensor,
        kept_lens: torch.Tensor,
        page_table: torch.Tensor,
        moments: EvictedMoments | None,
    ) -> None:
        """Head ``h`` keeps ``addresses[h, kept[h, :kept_lens[h]]]`` (``[H, S]``
        live tokens, ``live_lens[h]`` of them), written in order into the
        head-pages ``page_table[h]``; its other live tokens are folded into
        ``moments`` (``[H, ...]`` views; ``None``: dropped). Every read
        happens before every write."""

    def compact_many(
        self,
        addresses: torch.Tensor,
        live_lens: torch.Tensor,
        kept: torch.Tensor,
        kept_lens: torch.Tensor,
        page_table: torch.Tensor,
        moments: EvictedMoments | None = None,
    ) -> None:
        """:meth:`compact` of ``R`` requests at once: each argument with a
        leading ``[R]`` (``addresses [R, H, S]``, ``live_lens [R, H]``,
        ``kept [R, H, K]``, ``kept_lens [R, H]``, ``page_table [R, H, P]``,
        ``moments [R, H, ...]``: request ``r``'s evicted tokens folded into
        its row ``r``; ``None``: dropped). Every read before every write."""


@runtime_checkable
class ReadsTokens(Protocol):
    """A cache that reads any tokens by flat address (``head_page * bs +
    offset``) in one gather, on its device (the Triton path's cache)."""

    def read_tokens(self, addresses: torch.Tensor, live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The tokens at ``addresses [H, S]``, zeros where ``live [H, S]`` is
        false: ``(keys, values)``, each ``[H, S, D]``."""


@runtime_checkable
class WritesHeads(Protocol):
    """A cache that writes every KV head's kept tokens into its pages in one
    call (the C++ extension on CPU, torch indexing on the Triton path)
    instead of a write per head through :meth:`CacheOps.write_pages`; the
    same bytes either way."""

    def write_heads(
        self, keys: torch.Tensor, values: torch.Tensor, kept: torch.Tensor, counts: torch.Tensor,
        page_table: torch.Tensor,
    ) -> None:
        """Head ``h``'s rows ``kept[h, :counts[h]]`` of ``keys, values [H, S, D]``,
        in order, into its pages ``page_table[h]``, as :meth:`CacheOps.write_pages`
        writes them (the rest of the last page zeroed)."""


@runtime_checkable
class CopiesHeads(WritesHeads, Protocol):
    """A cache that also reads every KV head of a compaction in one call (the
    C++ extension on CPU) instead of a read per head through
    :meth:`CacheOps.read_pages` and :meth:`CacheOps.read_slots`."""

    def read_heads(
        self, pages: torch.Tensor, lens: torch.Tensor, block_row: torch.Tensor, start: int, end: int,
        longest: int | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Head ``h``'s first ``lens[h]`` tokens of its pages ``pages[h]``, then
        its slots ``[start, end)``, then zeros: ``(keys, values)``, each
        ``[H, max(lens) + end - start, D]`` (``longest``: ``max(lens)``, when
        the caller knows it)."""


@runtime_checkable
class ScoresWindows(Protocol):
    """A cache that computes SnapKV's window votes for every (request, KV
    head) of a layer's evictions at once, on its device (the Triton
    window-score kernel), instead of each policy call attending with the
    window queries head by head."""

    def window_votes(
        self, queries: torch.Tensor, query_lens: torch.Tensor, pages: torch.Tensor, lens: torch.Tensor,
        positions: torch.Tensor, block_rows: torch.Tensor, region_start: torch.Tensor, points: torch.Tensor,
        scale: float, width: int,
    ) -> torch.Tensor:
        """Request ``r``'s live tokens (head ``h``'s first ``lens[r, h]``
        tokens of its pages ``pages[r, h]``, at positions ``positions[r, h]``,
        then its slots ``[region_start[r], points[r])`` through
        ``block_rows[r]``), each key's mean causal softmax attention over the
        ``G * query_lens[r]`` rows of ``queries [R, Hq, W, D]`` (rows
        ``[0, query_lens[r])``: positions ``[points[r] - query_lens[r],
        points[r])``): ``[R, H, width]`` fp32, zero past a head's tokens."""


def implements(cache: object, protocol: type) -> bool:
    """``isinstance(cache, protocol)`` for the protocols above, answered once
    per cache class (a runtime protocol check walks the protocol's members
    each time: tens of µs, several times per eviction)."""
    return _implements(type(cache), protocol)


@functools.cache
def _implements(cls: type, protocol: type) -> bool:
    return issubclass(cls, protocol)


@dataclass
class Released:
    """Memory one eviction stopped using: head-pages of kept blocks that no
    head took, the slots below the point in the block it falls in, and the
    blocks the scheduler frees once the step is done (``layer``: the layer
    whose copy of them; ``None``, every layer's).

    Built without reading the device: the pages no head took follow from
    ``free_pages`` (the pages the eviction could fill, handed out in order)
    and ``counts`` (each stream's kept tokens, in ``page_size`` pages), the
    block the point falls in is ``point_block`` (a one-element view of the
    block table, in the layers ``block_offsets`` apart); an observer that
    asks (the isolation check) reads them.
    """

    freed_blocks: torch.Tensor | None = None
    layer: int | None = None
    free_pages: torch.Tensor | None = None
    counts: torch.Tensor | None = None
    page_size: int = 1
    point_block: torch.Tensor | None = None
    point_slots: int = 0  # slots below the point in its block
    block_offsets: tuple[int, ...] = (0,)

    @property
    def unused_pages(self) -> torch.Tensor | None:
        if self.free_pages is None or self.counts is None:
            return self.free_pages
        used = int(((self.counts + (self.page_size - 1)) // self.page_size).sum())
        return self.free_pages[used:]

    @property
    def partial_blocks(self) -> list[tuple[int, int]]:
        """(block, slots below the point) per layer, where the point is inside a block."""
        if self.point_block is None or not self.point_slots:
            return []
        block = int(self.point_block[0])
        return [(block + offset, self.point_slots) for offset in self.block_offsets]


class EvictionObserver:
    """Told about each eviction's released memory; does nothing.

    A debug observer (the isolation check that fills released memory with NaN)
    overrides :meth:`released`; the engine calls it once per eviction and has
    no other debug path.
    """

    def released(self, cache: CacheOps, released: Released) -> None:
        pass
