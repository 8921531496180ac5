"""One request reaching one eviction point in a step, and where its tokens are."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvevict.policies.base import ScoringInputs

if TYPE_CHECKING:
    from vllm_kvevict.moments import EvictedMoments


@dataclass
class EvictionPoint:
    """A request that reaches eviction point ``point`` in this step."""

    request_id: str
    batch_index: int
    state_row: int
    query_start: int  # index of the request's first token in the batch
    tokens_before: int  # tokens processed before this step
    last_point_before: int  # last eviction point at or below tokens_before
    frontier_before: int
    point: int
    frontier_after: int
    segment_end: int  # the step's tokens in [point, segment_end) attend after this eviction
    # head_pages storage: whether the frontier moves (the only points that
    # compact), and the first slot of the standard region when this runs.
    compacts: bool = False
    region_start: int = 0
    # The slots [0, protected_prefix) are never evicted (prefix_caching shared).
    protected_prefix: int = 0
    backend_data: Any = None  # what the backend needs for the segment's attention

    @property
    def slots_segment_region(self) -> tuple[int, int]:
        """slots storage: the protected-prefix tokens the tokens after the
        point read, and where their standard region starts: the prefix and
        the new frontier, or ``(0, 0)`` while they lie in the prefix (the
        frontier is then the prefix's end, nothing evicted)."""
        if self.point >= self.protected_prefix:
            return self.protected_prefix, self.frontier_after
        return 0, 0

    @property
    def segment_tokens(self) -> slice:
        """Batch indices of the tokens that attend after this eviction."""
        first = self.query_start + self.point - self.tokens_before
        return slice(first, first + self.segment_end - self.point)


@dataclass
class StreamRows:
    """One request's side buffers in one layer (views): per KV head the
    original positions of its compacted tokens, and with head-pages its page
    table, compacted length and evicted-token moments."""

    positions: torch.Tensor  # [H, capacity] int32
    pages: torch.Tensor | None = None  # [H, max_pages] int32 head-page ids
    lens: torch.Tensor | None = None  # [H] int32
    moments: "EvictedMoments | None" = None


ScoringInputsFor = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, "EvictedMoments | None"], ScoringInputs
]
"""``(keys, values, positions, evicted)`` → the policy's inputs: the backend
adds the observation queries and the model parts the policy reads."""


@dataclass
class LayerEviction:
    """One request's eviction point in one layer: what the engine moves for
    it (with ``slots`` storage ``rows`` holds the positions alone)."""

    ev: EvictionPoint
    rows: StreamRows
    block_row: torch.Tensor  # the request's row of the block table
    scoring_inputs: ScoringInputsFor


def observation_queries(
    ring: torch.Tensor, query: torch.Tensor, ev: EvictionPoint
) -> tuple[torch.Tensor, torch.Tensor]:
    """The queries of positions ``[point - W, point)``, ``[Hq, W, D]``, and their positions.

    Positions processed in this step come from its ``query [T, Hq, D]``;
    earlier ones from ``ring [W, Hq, D]`` (position ``p`` at ``p % W``), which
    the layer has not updated yet this step. Which is which follows from the
    point alone, so nothing is read back from the device.

    The serving path takes every point's window at once
    (:func:`observation_queries_many`); this one-point form is its reference.
    """
    window = ring.shape[0]
    first = max(0, ev.point - window)
    fresh = min(max(ev.tokens_before, first), ev.point)  # the first position of this step's
    positions = torch.arange(first, ev.point, device=query.device)
    from_ring = ring.index_select(0, positions[: fresh - first] % window).to(query.dtype)
    start = ev.query_start + fresh - ev.tokens_before
    gathered = torch.cat([from_ring, query[start : start + ev.point - fresh]])
    return gathered.transpose(0, 1), positions


@dataclass
class ObservationRows:
    """Where the observation queries of several points are: per window row,
    its row in the layer's query rings (``ring_row``, where ``from_ring``) or
    in the step's queries (``query_row``), and its position; ``spans``: each
    point's ``(first, count)`` of them. The same for every layer of a step."""

    ring_row: torch.Tensor  # [N] int64
    query_row: torch.Tensor  # [N] int64
    from_ring: torch.Tensor  # [N] bool
    positions: torch.Tensor  # [N] int64
    spans: list[tuple[int, int]]


def observation_rows(evs: Sequence[EvictionPoint], window: int, device: torch.device) -> ObservationRows:
    """The rows :func:`observation_queries` reads for each of ``evs`` (a ring
    of ``window`` rows per state row), from the points alone: one upload."""
    ring_rows: list[int] = []
    query_rows: list[int] = []
    from_ring: list[int] = []
    positions: list[int] = []
    spans = []
    for ev in evs:
        first = max(0, ev.point - window)
        fresh = min(max(ev.tokens_before, first), ev.point)
        spans.append((len(positions), ev.point - first))
        for p in range(first, ev.point):
            ring = p < fresh
            ring_rows.append(ev.state_row * window + p % window if ring else 0)
            query_rows.append(0 if ring else ev.query_start + p - ev.tokens_before)
            from_ring.append(int(ring))
            positions.append(p)
    host = torch.tensor([ring_rows, query_rows, from_ring, positions], dtype=torch.int64).to(device)
    return ObservationRows(host[0], host[1], host[2].bool(), host[3], spans)


def observation_queries_many(
    rings: torch.Tensor, query: torch.Tensor, rows: ObservationRows
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """:func:`observation_queries` of several points of one layer at once:
    ``rings [rows, W, Hq, D]`` the layer's query rings (a point's at its
    ``state_row``), ``query [T, Hq, D]`` the step's, ``rows`` where each
    point's window is (:func:`observation_rows`). One gather from the rings
    and one from the step's queries for every point; each point's queries
    ``[Hq, W_i, D]`` and positions ``[W_i]`` are views of the result."""
    ringed = rings.reshape(-1, *rings.shape[2:]).index_select(0, rows.ring_row).to(query.dtype)
    gathered = torch.where(rows.from_ring[:, None, None], ringed, query.index_select(0, rows.query_row))
    queries = gathered.transpose(0, 1)  # [Hq, sum W_i, D]
    return [
        (queries[:, first : first + count], rows.positions[first : first + count]) for first, count in rows.spans
    ]
