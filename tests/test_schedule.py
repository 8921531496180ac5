"""EvictionSchedule checked against a step-by-step simulation of one request.

The simulation plays both processes: the worker applies the eviction point of
every step (keeping ``p - frontier_at_point(p)`` tokens of those before ``p``
in the slots ``[F, p)``, the new tokens at their true slots), and the
scheduler allocates the blocks of the next step and frees those below
``frontier(n)``. Every invariant is computed from the simulated slots, not
from the schedule's own formulas.
"""

import random

import pytest

from vllm_kvevict.schedule import EvictionSchedule


def _cdiv(a, b):
    return -(-a // b)


def _random_case(rng):
    block_size = rng.choice([1, 2, 4, 8, 16, 32])
    budget = rng.randint(1, 5 * block_size + 40)
    interval = rng.randint(1, 40)
    prompt_len = rng.randint(1, 400)
    max_step_tokens = rng.randint(1, 96)
    decode_steps = rng.randint(0, 3 * interval + 50)
    chunks = []
    done = 0
    while done < prompt_len:
        c = rng.randint(1, min(max_step_tokens, prompt_len - done))
        chunks.append(c)
        done += c
    steps = chunks + [1] * decode_steps
    mode = rng.choice(["per_chunk", "end_of_prompt", "hybrid"])
    schedule = EvictionSchedule(budget, interval, block_size, mode, rng.randint(0, 400))
    return schedule, prompt_len, max_step_tokens, chunks, steps


def _simulate(schedule, prompt_len, max_step_tokens, steps, rng):
    """Returns (prefill points, decode points) and asserts the invariants at every boundary."""
    bs = schedule.block_size
    per_chunk = EvictionSchedule(schedule.budget, schedule.interval, bs, "per_chunk")
    slots = {}  # slot -> original position of the token stored there (one KV head)
    prefill_points, decode_points = [], []
    prev_frontier = 0
    n = 0

    def check_boundary(n):
        nonlocal prev_frontier
        frontier = schedule.frontier(n, prompt_len)
        assert frontier % bs == 0
        assert frontier >= prev_frontier, "frontier moved backwards"
        prev_frontier = frontier
        if slots:
            first_live = min(slots)
            assert frontier <= first_live, "a live slot would be freed"
        live = len(slots)
        assert live == n - frontier
        assert live >= min(n, schedule.budget), "fewer than budget tokens kept"
        # Every slot in [frontier, n) holds exactly one token; none is later than its slot.
        assert sorted(slots) == list(range(frontier, n))
        assert all(pos <= slot for slot, pos in slots.items())
        # Blocks held while the next step of c tokens is allocated. end_of_prompt
        # holds the whole prompt (no cap) until the prompt is done; from then on
        # the per_chunk cap holds too.
        if schedule.prefill_mode == "end_of_prompt":
            assert schedule.max_blocks_per_request(max_step_tokens) is None
            if n < prompt_len:
                return
        limit = per_chunk.max_blocks_per_request(max_step_tokens)
        if schedule.prefill_mode == "hybrid":
            # A held prompt is at most end_of_prompt_max_tokens long; the cap
            # covers it as well as the per_chunk bound.
            limit = schedule.max_blocks_per_request(max_step_tokens)
            if schedule.holds_whole_prompt(prompt_len) and n < prompt_len:
                for c in range(1, min(max_step_tokens, prompt_len - n) + 1):
                    assert _cdiv(n + c, bs) <= limit
                return
        for c in range(1, max_step_tokens + 1):
            held = _cdiv(n + c, bs) - frontier // bs
            assert held <= limit, (n, c, held, limit)

    check_boundary(0)
    for c in steps:
        n_before, n_after = n, n + c
        for pos in range(n_before, n_after):
            slots[pos] = pos
        point = schedule.eviction_point_in_step(n_before, n_after, prompt_len)
        if point is not None:
            assert n_before < point <= n_after
            if n_after <= prompt_len:
                prefill_points.append(point)
            else:
                decode_points.append(point)
            new_frontier = schedule.frontier_at_point(point)
            num_keep = point - new_frontier
            before = sorted(pos for slot, pos in slots.items() if slot < point)
            after = {slot: pos for slot, pos in slots.items() if slot >= point}
            assert 0 <= num_keep <= len(before), "asked to keep more tokens than are live"
            assert num_keep <= schedule.retained_capacity()
            kept = sorted(rng.sample(before, num_keep))
            slots = dict(after)
            for i, pos in enumerate(kept):
                slots[new_frontier + i] = pos
        n = n_after
        check_boundary(n)
    return prefill_points, decode_points, n


@pytest.mark.parametrize("seed", range(90))
def test_simulated_request_invariants(seed):
    """Frontier aligned, monotone, never past a live slot; budget kept; block cap holds;
    evictions exactly at chunk ends (per_chunk) or the prompt end (end_of_prompt)
    and every `interval` decode steps."""
    rng = random.Random(seed)
    schedule, prompt_len, max_step_tokens, chunks, steps = _random_case(rng)
    prefill_points, decode_points, n_final = _simulate(
        schedule, prompt_len, max_step_tokens, steps, rng
    )
    if not schedule.holds_whole_prompt(prompt_len):
        assert prefill_points == [sum(chunks[: i + 1]) for i in range(len(chunks))]
    else:
        assert prefill_points == [prompt_len]
    expected = []
    k = 1
    while prompt_len + k * schedule.interval <= n_final:
        expected.append(prompt_len + k * schedule.interval)
        k += 1
    assert decode_points == expected


def test_hand_checked_values():
    """A few values worked out by hand from the storage rule."""
    s = EvictionSchedule(budget=10, interval=4, block_size=4)
    # point 25: floor((25 - 10) / 4) * 4 = 12
    assert s.frontier_at_point(25) == 12
    assert s.frontier_at_point(9) == 0
    assert s.frontier(20, prompt_len=20) == 8
    # decode: points 24, 28 ... ; n = 27 -> last point 24 -> floor(14/4)*4 = 12
    assert s.frontier(27, prompt_len=20) == 12
    assert s.eviction_point_in_step(26, 27, 20) is None
    assert s.eviction_point_in_step(27, 28, 20) == 28
    # recompute of a preempted request crossing several decode points: the last one
    assert s.eviction_point_in_step(20, 33, 20) == 32
    # span = 10 + 4 + 5 + 4 - 2 = 21 -> 6 blocks
    assert s.max_blocks_per_request(5) == 6


def test_end_of_prompt_hand_checked():
    """end_of_prompt: no eviction inside the prompt, then as per_chunk."""
    s = EvictionSchedule(budget=10, interval=4, block_size=4, prefill_mode="end_of_prompt")
    assert s.frontier(19, prompt_len=20) == 0
    assert s.eviction_point_in_step(0, 19, 20) is None
    assert s.eviction_point_in_step(19, 20, 20) == 20
    assert s.eviction_point_in_step(0, 20, 20) == 20
    assert s.frontier(20, prompt_len=20) == 8
    assert s.frontier(27, prompt_len=20) == 12
    assert s.max_blocks_per_request(5) is None


def test_invalid_schedule_rejected():
    for args in [(0, 1, 1), (1, 0, 1), (1, 1, 0)]:
        with pytest.raises(ValueError):
            EvictionSchedule(*args)


@pytest.mark.parametrize("seed", range(5))
def test_retained_capacity_covers_every_point(seed):
    """retained_capacity() >= point - frontier_at_point(point) for all points."""
    rng = random.Random(1000 + seed)
    for _ in range(20):
        s = EvictionSchedule(
            rng.randint(1, 300), rng.randint(1, 50), rng.choice([1, 3, 8, 16, 32, 64])
        )
        worst = max(p - s.frontier_at_point(p) for p in range(0, 2000))
        assert s.retained_capacity() >= worst
