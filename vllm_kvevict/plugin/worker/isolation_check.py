"""The isolation check (``poison_freed_blocks``): memory eviction gives up is
filled with NaN, and attention outputs holding NaN are counted.

Every block the scheduler is about to return to vLLM's pool (below a moved
frontier, or all of a request's blocks when it ends or is preempted), every
head-page a compaction left unused and the slots below an eviction point in
the block it falls in are poisoned; a later read of any of them by any
request shows up as NaN in an output. Serving without the check runs
:class:`StepObserver`, whose hooks do nothing: the hot path makes one call per
hook and has no debug branch.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from vllm_kvevict.eviction.cache_ops import CacheOps, EvictionObserver, Released
from vllm_kvevict.schedule import cdiv


@runtime_checkable
class PoisonableCache(Protocol):
    """The writes the check makes besides the engine's (both backends' caches have them)."""

    def clear_slots(self, slots: torch.Tensor) -> None:
        """Zeros into the flat slot ids ``slots`` (``block * bs + offset``), every head."""

    def poison_pages(self, pages: torch.Tensor) -> None:
        """NaN into the head-pages ``pages``."""

    def poison_standard_prefix(self, block: int, num_slots: int) -> None:
        """NaN into the first ``num_slots`` slots of ``block``, every head, K and V."""


class StepObserver(EvictionObserver):
    """Hooks of a serving step; the defaults do nothing."""

    def request_planned(
        self, request_id: str, block_row: torch.Tensor, frontier: int, num_tokens: int
    ) -> None:
        """A request of the step holds ``block_row``'s blocks from ``frontier`` to ``num_tokens``."""

    def step_planned(self) -> None:
        """Every request of the step is planned."""

    def layer_started(self, layer_index: int, kv_cache: torch.Tensor, cache: Any) -> None:
        """Before a layer's attention (after vLLM wrote the step's tokens)."""

    def layer_finished(self, output: torch.Tensor) -> None:
        """After a layer's attention and evictions, with the step's outputs."""

    def requests_released(self, request_ids: set[str]) -> None:
        """Requests that finished, were aborted or were preempted."""


class PoisonFreedBlocks(StepObserver):
    def __init__(self, block_size: int, counters: Any) -> None:
        self.block_size = block_size
        self.counters = counters  # .blocks_poisoned, .nan_outputs
        self.kv_caches: dict[int, torch.Tensor] = {}  # every layer's, seen by its first forward
        self.held_blocks: dict[str, torch.Tensor] = {}  # each request's blocks after its last step
        self._tail_slots: list[torch.Tensor] = []
        self.unwritten_tail_slots: torch.Tensor | None = None

    def request_planned(
        self, request_id: str, block_row: torch.Tensor, frontier: int, num_tokens: int
    ) -> None:
        bs = self.block_size
        # What the request holds once this step is done; all of it goes back
        # to the pool when the request ends or is preempted.
        self.held_blocks[request_id] = block_row[frontier // bs : cdiv(num_tokens, bs)].clone()
        if num_tokens % bs:
            last_block = int(block_row[num_tokens // bs])
            self._tail_slots.append(last_block * bs + torch.arange(num_tokens % bs, bs))

    def step_planned(self) -> None:
        tails, self._tail_slots = self._tail_slots, []
        self.unwritten_tail_slots = torch.cat(tails) if tails else None

    def layer_started(self, layer_index: int, kv_cache: torch.Tensor, cache: Any) -> None:
        self.kv_caches.setdefault(layer_index, kv_cache)
        if self.unwritten_tail_slots is not None:
            # vLLM's kernel reads a request's last block whole and masks the
            # slots past seq_len; 0 * NaN would still be NaN. A new block may
            # be a poisoned one, so clear its unwritten tail (as vLLM zeroes
            # new blocks when stale bytes could decode to NaN).
            cache.clear_slots(self.unwritten_tail_slots)

    def layer_finished(self, output: torch.Tensor) -> None:
        out = output.reshape(output.shape[0], -1)
        self.counters.nan_outputs += int(torch.isnan(out).any(dim=-1).sum())

    def released(self, cache: CacheOps, released: Released) -> None:
        assert isinstance(cache, PoisonableCache)
        if released.unused_pages is not None:
            cache.poison_pages(released.unused_pages)
        for block, num_slots in released.partial_blocks:
            cache.poison_standard_prefix(block, num_slots)
        if released.freed_blocks is not None:
            # The scheduler returns these to the pool once this step is done.
            self.poison(released.freed_blocks, released.layer)

    def requests_released(self, request_ids: set[str]) -> None:
        for request_id in request_ids:
            blocks = self.held_blocks.pop(request_id, None)
            if blocks is not None:
                self.poison(blocks)  # vLLM returns all of them to the pool in this same step

    def poison(self, block_ids: torch.Tensor, layer_index: int | None = None) -> None:
        """Fill blocks (every head, K and V) with NaN in one layer or all of them."""
        if block_ids.numel() == 0:
            return
        layers = self.kv_caches if layer_index is None else {layer_index: self.kv_caches[layer_index]}
        for kv_cache in layers.values():
            kv_cache[block_ids.to(kv_cache.device).long()] = float("nan")
        if layer_index in (None, 0):
            self.counters.blocks_poisoned += int(block_ids.numel())
