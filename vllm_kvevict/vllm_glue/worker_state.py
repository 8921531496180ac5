"""Worker side: per-request side buffers that live beside the KV cache.

* ``positions[layer, row, head, i]``: original position of the token in slot
  ``frontier + i`` of the compacted part of the region (slots below the last
  eviction point). Slots at or after the last eviction point hold new tokens,
  whose position is their slot. Needed for the sinks, the causal mask of the
  observation queries, and every position-aware policy.
* ``query_ring[layer, row, pos % W]``: the last ``W`` post-RoPE queries, for
  query-based policies (SnapKV's observation window at decode time).

Rows are assigned per request id and reused after the request finishes. A
request that starts over (new, or recomputed after preemption) rewrites its
row from position 0, and nothing reads a row beyond what the current run has
written, so rows need no clearing.
"""

from __future__ import annotations

import torch


class WorkerEvictionState:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        num_q_heads: int,
        head_dim: int,
        retained_capacity: int,
        query_window: int,
        query_dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.num_q_heads = num_q_heads
        self.head_dim = head_dim
        self.retained_capacity = retained_capacity
        self.query_window = query_window
        self.query_dtype = query_dtype
        self.device = device
        self.row_of: dict[str, int] = {}
        self.free_rows: list[int] = []
        self.num_rows = 0
        self.positions = torch.empty(0)
        self.query_ring = torch.empty(0)
        self._grow(8)

    def _grow(self, num_rows: int) -> None:
        positions = torch.zeros(
            (self.num_layers, num_rows, self.num_kv_heads, self.retained_capacity),
            dtype=torch.int64,
            device=self.device,
        )
        if self.num_rows:
            positions[:, : self.num_rows] = self.positions
        self.positions = positions
        if self.query_window:
            ring = torch.zeros(
                (self.num_layers, num_rows, self.query_window, self.num_q_heads, self.head_dim),
                dtype=self.query_dtype,
                device=self.device,
            )
            if self.num_rows:
                ring[:, : self.num_rows] = self.query_ring
            self.query_ring = ring
        self.free_rows.extend(range(num_rows - 1, self.num_rows - 1, -1))
        self.num_rows = num_rows

    def row(self, req_id: str) -> int:
        row = self.row_of.get(req_id)
        if row is None:
            if not self.free_rows:
                self._grow(self.num_rows * 2)
            row = self.free_rows.pop()
            self.row_of[req_id] = row
        return row

    def release(self, req_ids: set[str]) -> None:
        for req_id in req_ids:
            row = self.row_of.pop(req_id, None)
            if row is not None:
                self.free_rows.append(row)
