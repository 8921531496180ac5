"""When eviction happens and which blocks a request still holds.

Both sides of vLLM use this module and nothing else to agree on memory:

* the scheduler's :class:`~vllm_kvevict.plugin.scheduler.manager.EvictionManager`
  frees every block below :meth:`EvictionSchedule.frontier`;
* the worker's attention backend compacts the retained tokens of every
  (layer, KV head) into the slots ``[frontier, P)`` inside the forward pass
  that reaches eviction point ``P``.

Everything here is a pure function of the number of processed tokens ``n`` and
the prompt length, so the two processes agree without any feedback channel
(vLLM never tells the worker which blocks were freed, and the worker never
tells the scheduler what it evicted).

Eviction points
    * ``per_chunk`` prefill: every ``prefill_interval`` prompt tokens (by
      default one scheduler chunk, ``--max-num-batched-tokens``) and the end
      of the prompt;
    * ``end_of_prompt`` prefill: only the prompt length;
    * ``hybrid`` prefill: ``end_of_prompt`` up to a prompt length, beyond it
      ``per_chunk``;
    * decode: ``prompt_len + k * decode_interval`` for ``k >= 1`` (every
      ``decode_interval`` decode steps).

    The points depend on the request alone, never on how the scheduler cut
    its steps: a step that crosses several points (a chunk shared with other
    requests, or a preempted request recomputing its generated tokens) applies
    each of them in turn inside its forward pass, so a request's output does
    not depend on the load it ran under.

Storage rule
    After eviction at point ``P`` each KV head keeps the tokens in slots
    ``[F, P)`` where ``F = floor((P - budget) / block_size) * block_size``:
    at least ``budget`` tokens, and as many more (fewer than one block) as
    fill the block the frontier falls in. That block is held by the request
    anyway, so the extra tokens cost no memory and keep the retained region
    block-aligned, which lets the stock paged kernels read it through a
    shifted block table.

Protected prefix
    With a protected prefix of ``p`` tokens (``prefix_caching: shared``: the
    prompt's first whole blocks, at most ``max_protected_prefix``, never its
    last token) the slots ``[0, p)`` are never evicted, compacted into or
    freed: they stay in vLLM's prefix cache, shared by the requests that
    find them there. The rule above applies to the tokens after them,
    ``F = p + floor((P - p - budget) / block_size) * block_size``; a request
    holds ``[0, p)`` and ``[F, n)``, and the blocks ``[p / bs, F / bs)`` are
    freed. ``p = 0`` is the rule above.

Per request
    A request may ask for its own budget (at most the server's) or opt out
    (``kv_eviction`` in its extra arguments, :class:`~vllm_kvevict.request_settings.RequestEviction`).
    Its schedule is the server's with that budget, or :data:`NEVER_EVICTS`
    (frontier 0, no eviction point), built by
    :func:`~vllm_kvevict.request_settings.request_schedule` from the request's
    own arguments on both sides.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

PrefillMode = Literal["per_chunk", "end_of_prompt", "hybrid"]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class EvictionSchedule:
    evicts: ClassVar[bool] = True
    budget: int
    """Minimum tokens retained per KV head after an eviction."""
    decode_interval: int
    """Decode steps between two decode-time evictions."""
    block_size: int
    prefill_mode: PrefillMode = "per_chunk"
    """``per_chunk``: evict after every prefill chunk (memory bounded by budget
    + chunk); ``end_of_prompt``: keep the whole prompt until its last chunk,
    then evict once, so query-based policies score with the question;
    ``hybrid``: ``end_of_prompt`` for prompts of at most
    ``end_of_prompt_max_tokens``, ``per_chunk`` for longer ones."""
    end_of_prompt_max_tokens: int = 0
    prefill_interval: int = 512
    """``per_chunk`` prefill: prompt tokens between two evictions."""
    max_protected_prefix: int = 0
    """Most prompt tokens never evicted (whole blocks of them; 0: none)."""

    def __post_init__(self) -> None:
        if min(self.budget, self.decode_interval, self.block_size, self.prefill_interval) < 1:
            raise ValueError(f"invalid eviction schedule {self}")
        if self.max_protected_prefix < 0:
            raise ValueError(f"invalid eviction schedule {self}")

    def protected_prefix(self, prompt_len: int) -> int:
        """Tokens at the start of a prompt of ``prompt_len`` that are never
        evicted: whole blocks, at most ``max_protected_prefix``, never the
        prompt's last token (vLLM computes it rather than take it from its
        prefix cache)."""
        if not self.max_protected_prefix:
            return 0
        return min(self.max_protected_prefix, prompt_len - 1) // self.block_size * self.block_size

    def holds_whole_prompt(self, prompt_len: int) -> bool:
        """Whether this prompt is evicted once, at its end."""
        if self.prefill_mode == "hybrid":
            return prompt_len <= self.end_of_prompt_max_tokens
        return self.prefill_mode == "end_of_prompt"

    def last_eviction_point(self, n: int, prompt_len: int) -> int:
        """The last eviction point at or below ``n`` processed tokens."""
        if n < prompt_len:
            if self.holds_whole_prompt(prompt_len):
                return 0
            return n // self.prefill_interval * self.prefill_interval
        return prompt_len + (n - prompt_len) // self.decode_interval * self.decode_interval

    def frontier_at_point(self, point: int, prompt_len: int) -> int:
        """First live slot after the protected prefix once evicted at
        ``point`` (block-aligned; the prefix's end while nothing is evicted)."""
        prefix = self.protected_prefix(prompt_len)
        return prefix + max(0, (point - prefix - self.budget) // self.block_size) * self.block_size

    def frontier(self, n: int, prompt_len: int) -> int:
        """First live slot after the protected prefix once ``n`` tokens have
        been processed.

        Every slot between the prefix and it belongs to an evicted token, so
        the blocks ``[protected_prefix // block_size, frontier // block_size)``
        can be returned to the pool.
        """
        return self.frontier_at_point(self.last_eviction_point(n, prompt_len), prompt_len)

    def eviction_points_in_step(
        self, n_before: int, n_after: int, prompt_len: int
    ) -> list[int]:
        """The eviction points in ``(n_before, n_after]``, in order.

        Each is applied after the attention of the tokens before it and before
        the attention of the tokens after it.
        """
        points: list[int] = []
        if n_before < prompt_len and not self.holds_whole_prompt(prompt_len):
            step = self.prefill_interval
            first = (n_before // step + 1) * step
            points.extend(range(first, min(n_after, prompt_len - 1) + 1, step))
        if n_before < prompt_len <= n_after:
            points.append(prompt_len)
        every = self.decode_interval
        first_decode = max(n_before - prompt_len, 0) // every + 1
        points.extend(range(prompt_len + first_decode * every, n_after + 1, every))
        return points

    def max_blocks_per_request(self, max_step_tokens: int) -> int | None:
        """Most blocks a request holds at once, for admission and pool sizing.

        None in ``end_of_prompt`` mode: the whole prompt is held during prefill.
        In ``hybrid`` mode a held prompt has at most ``end_of_prompt_max_tokens``
        tokens, all of them allocated before its single eviction.

        When a step over ``(n, n + c]`` is allocated, the request holds slots
        ``[F(n), n + c)``. ``n - P_e(n) <= max(decode_interval, prefill_interval) - 1``
        and ``P_e(n) - F(n) <= budget + block_size - 1``, so the span is at most
        ``budget + max(decode_interval, prefill_interval) + c + block_size - 2`` tokens
        from a block-aligned start, after the protected prefix's blocks.
        """
        if self.prefill_mode == "end_of_prompt":
            return None
        gap = max(self.decode_interval, self.prefill_interval)
        span = self.budget + gap + max_step_tokens + self.block_size - 2
        bound = cdiv(span, self.block_size) + self.max_protected_prefix // self.block_size
        if self.prefill_mode == "hybrid":
            bound = max(bound, cdiv(self.end_of_prompt_max_tokens, self.block_size))
        return bound

    @property
    def min_retained_blocks(self) -> int:
        """Fewest blocks ``P // block_size - F // block_size`` an eviction at
        ``P`` retains: with head_pages storage, a head's equal share of the
        retained pages."""
        return self.budget // self.block_size

    def max_head_pages(self, streams: int, max_model_len: int | None = None) -> int:
        """Page-table width of one (layer, KV head) with head_pages storage.

        After an eviction a request's compacted tokens fill the blocks
        ``[F // block_size, P // block_size)``, at most
        ``min_retained_blocks + 1`` of them, and one head may take every
        head-page that ``streams`` heads hold in them (the layer's KV heads,
        or every layer's when one ranking spans the layers). ``max_model_len``,
        when given, caps it at a whole sequence.
        """
        pages = streams * (self.min_retained_blocks + 1)
        if max_model_len is not None:
            pages = min(pages, cdiv(max_model_len, self.block_size))
        return pages

    def retained_capacity(self, max_head_pages: int = 0) -> int:
        """Largest number of compacted tokens a head can hold (side buffers):
        ``budget + block_size`` in its slots, or ``max_head_pages`` whole
        pages with head_pages storage (``max_head_pages > 0``)."""
        if max_head_pages:
            return max_head_pages * self.block_size
        return self.budget + self.block_size


@dataclass(frozen=True)
class NeverEvicts:
    """The schedule of a request that never evicts (``kv_eviction: "off"``):
    no eviction point, its frontier and protected prefix at 0, and admitted
    only with the blocks of its whole sequence. :data:`NEVER_EVICTS` is the
    one instance."""

    budget: ClassVar[None] = None
    """No budget: every token is kept."""
    evicts: ClassVar[bool] = False

    def protected_prefix(self, prompt_len: int) -> int:
        return 0

    def last_eviction_point(self, n: int, prompt_len: int) -> int:
        return 0

    def frontier_at_point(self, point: int, prompt_len: int) -> int:
        return 0

    def frontier(self, n: int, prompt_len: int) -> int:
        return 0

    def eviction_points_in_step(self, n_before: int, n_after: int, prompt_len: int) -> list[int]:
        return []

    def max_blocks_per_request(self, max_step_tokens: int) -> None:
        return None


NEVER_EVICTS = NeverEvicts()

Schedule = EvictionSchedule | NeverEvicts
"""A request's schedule: the server's (perhaps with the request's own budget)
or :data:`NEVER_EVICTS`."""
