"""EvictionSchedule checked against a step-by-step simulation of one request.

The simulation plays both processes: the worker applies the eviction points of
every step, in order (keeping ``p - frontier_at_point(p)`` tokens of those before ``p``
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
    # Half the cases protect a prefix (prefix_caching shared), often longer
    # than the prompt.
    protected = rng.choice([0, rng.randint(1, 300)])
    schedule = EvictionSchedule(
        budget, interval, block_size, mode, rng.randint(0, 400), rng.randint(1, 120), protected
    )
    return schedule, prompt_len, max_step_tokens, chunks, steps


def _simulate(schedule, prompt_len, max_step_tokens, steps, rng):
    """Returns (prefill points, decode points) and asserts the invariants at every boundary."""
    bs = schedule.block_size
    per_chunk = EvictionSchedule(
        schedule.budget, schedule.decode_interval, bs, "per_chunk",
        prefill_interval=schedule.prefill_interval,
        max_protected_prefix=schedule.max_protected_prefix,
    )
    # The protected prefix, computed here from its definition: the prompt's
    # first whole blocks, at most max_protected_prefix tokens, never its last token.
    prefix = 0
    while prefix + bs <= min(schedule.max_protected_prefix, prompt_len - 1):
        prefix += bs
    assert schedule.protected_prefix(prompt_len) == prefix
    slots = {}  # slot -> original position of the token stored there (one KV head)
    prefill_points, decode_points = [], []
    prev_frontier = 0
    n = 0

    def check_boundary(n):
        nonlocal prev_frontier
        frontier = schedule.frontier(n, prompt_len)
        assert frontier % bs == 0
        assert frontier >= max(prev_frontier, prefix), "frontier moved backwards or into the prefix"
        prev_frontier = frontier
        private = {slot: pos for slot, pos in slots.items() if slot >= prefix}
        if private:
            assert frontier <= min(private), "a live slot would be freed"
        # The prefix's slots hold their own tokens, never moved or freed.
        assert all(slots[slot] == slot for slot in range(min(n, prefix)))
        live = len(private)
        assert live == max(n - frontier, 0)
        assert live >= min(max(n - prefix, 0), schedule.budget), "fewer than budget tokens kept"
        # Every slot in [0, prefix) and [frontier, n) holds exactly one token;
        # none is later than its slot.
        assert sorted(slots) == list(range(min(n, prefix))) + list(range(frontier, n))
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
            end = _cdiv(n + c, bs)
            held = min(end, prefix // bs) + max(end - frontier // bs, 0)
            assert held <= limit, (n, c, held, limit)

    check_boundary(0)
    for c in steps:
        n_before, n_after = n, n + c
        for pos in range(n_before, n_after):
            slots[pos] = pos
        points = schedule.eviction_points_in_step(n_before, n_after, prompt_len)
        assert points == sorted(set(points))
        for point in points:
            assert n_before < point <= n_after
            if point <= prompt_len:
                prefill_points.append(point)
            else:
                decode_points.append(point)
            new_frontier = schedule.frontier_at_point(point, prompt_len)
            # Only the tokens after the prefix are candidates.
            num_keep = max(point - new_frontier, 0)
            before = sorted(pos for slot, pos in slots.items() if prefix <= slot < point)
            assert num_keep <= len(before), "asked to keep more tokens than are live"
            assert num_keep <= schedule.retained_capacity()
            # The choice depends on the point alone, as a policy's does on
            # the tokens before it: chunking must not change the outcome.
            kept = sorted(random.Random(point).sample(before, num_keep))
            slots = {slot: pos for slot, pos in slots.items() if slot < prefix or slot >= point}
            for i, pos in enumerate(kept):
                slots[new_frontier + i] = pos
        n = n_after
        check_boundary(n)
    return prefill_points, decode_points, n, slots


@pytest.mark.parametrize("seed", range(90))
def test_simulated_request_invariants(seed):
    """Frontier aligned, monotone, never past a live slot; budget kept; block cap holds;
    evictions exactly every prefill_interval prompt tokens and at the prompt end
    (per_chunk) or only at the prompt end (end_of_prompt), and every `decode_interval`
    decode steps, whatever the chunking."""
    rng = random.Random(seed)
    schedule, prompt_len, max_step_tokens, chunks, steps = _random_case(rng)
    prefill_points, decode_points, n_final, slots = _simulate(
        schedule, prompt_len, max_step_tokens, steps, rng
    )
    if not schedule.holds_whole_prompt(prompt_len):
        step = schedule.prefill_interval
        assert prefill_points == list(range(step, prompt_len, step)) + [prompt_len]
    else:
        assert prefill_points == [prompt_len]
    expected = []
    k = 1
    while prompt_len + k * schedule.decode_interval <= n_final:
        expected.append(prompt_len + k * schedule.decode_interval)
        k += 1
    assert decode_points == expected

    # The same request cut differently (one token per step, or everything in
    # one step, as a preempted request recomputes) ends in the same state.
    for other in ([1] * n_final, [n_final]):
        *_, other_slots = _simulate(schedule, prompt_len, n_final, other, rng)
        assert other_slots == slots


def test_hand_checked_values():
    """A few values worked out by hand from the storage rule."""
    s = EvictionSchedule(budget=10, decode_interval=4, block_size=4)
    # point 25: floor((25 - 10) / 4) * 4 = 12
    assert s.frontier_at_point(25, 20) == 12
    assert s.frontier_at_point(9, 20) == 0
    assert s.frontier(20, prompt_len=20) == 8
    # decode: points 24, 28 ... ; n = 27 -> last point 24 -> floor(14/4)*4 = 12
    assert s.frontier(27, prompt_len=20) == 12
    assert s.eviction_points_in_step(26, 27, 20) == []
    assert s.eviction_points_in_step(27, 28, 20) == [28]
    # recompute of a preempted request crossing several decode points: all of them
    assert s.eviction_points_in_step(20, 33, 20) == [24, 28, 32]
    # prefill every 8 tokens, then the prompt end, then decode points
    p = EvictionSchedule(budget=10, decode_interval=4, block_size=4, prefill_interval=8)
    assert p.eviction_points_in_step(0, 30, 20) == [8, 16, 20, 24, 28]
    assert p.eviction_points_in_step(3, 16, 20) == [8, 16]
    assert p.eviction_points_in_step(16, 17, 20) == []
    assert p.frontier(15, prompt_len=20) == 0  # last point 8 < budget
    assert p.frontier(17, prompt_len=20) == 4  # last point 16: floor(6/4)*4
    # span = 10 + max(4, 512) + 5 + 4 - 2 = 529 -> 133 blocks
    assert s.max_blocks_per_request(5) == 133
    # A protected prefix of at most 9 tokens: 8 (two whole blocks), or less
    # for a prompt whose last token would be in it; the budget counts after it.
    q = EvictionSchedule(budget=10, decode_interval=4, block_size=4, max_protected_prefix=9)
    assert q.protected_prefix(20) == 8 and q.protected_prefix(9) == 8
    assert q.protected_prefix(8) == 4 and q.protected_prefix(4) == 0
    assert q.frontier_at_point(25, 20) == 12  # 8 + floor((25 - 8 - 10) / 4) * 4
    assert q.frontier_at_point(21, 20) == 8 and q.frontier_at_point(5, 20) == 8
    assert q.frontier(20, prompt_len=20) == 8 and q.frontier(28, prompt_len=20) == 16
    assert q.max_blocks_per_request(5) == 133 + 2
    # span = 10 + max(4, 8) + 5 + 4 - 2 = 25 -> 7 blocks
    assert p.max_blocks_per_request(5) == 7


def test_end_of_prompt_hand_checked():
    """end_of_prompt: no eviction inside the prompt, then as per_chunk."""
    s = EvictionSchedule(budget=10, decode_interval=4, block_size=4, prefill_mode="end_of_prompt")
    assert s.frontier(19, prompt_len=20) == 0
    assert s.eviction_points_in_step(0, 19, 20) == []
    assert s.eviction_points_in_step(19, 20, 20) == [20]
    assert s.eviction_points_in_step(0, 20, 20) == [20]
    assert s.frontier(20, prompt_len=20) == 8
    assert s.frontier(27, prompt_len=20) == 12
    assert s.max_blocks_per_request(5) is None


def test_invalid_schedule_rejected():
    for args in [(0, 1, 1), (1, 0, 1), (1, 1, 0), (1, 1, 1, "per_chunk", 0, 0)]:
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
        worst = max(p - s.frontier_at_point(p, 2000) for p in range(0, 2000))
        assert s.retained_capacity() >= worst


@pytest.mark.parametrize("seed", range(5))
def test_head_page_capacities_cover_every_point(seed):
    """An eviction at ``p >= budget`` retains ``p // bs - frontier // bs``
    blocks: never fewer than min_retained_blocks (and sometimes exactly that),
    never more than one stream's max_head_pages."""
    rng = random.Random(2000 + seed)
    for _ in range(20):
        bs = rng.choice([1, 3, 8, 16, 32])
        s = EvictionSchedule(rng.randint(1, 300), rng.randint(1, 50), bs)
        spans = [p // bs - s.frontier_at_point(p, 2000) // bs for p in range(s.budget, 2000)]
        assert min(spans) == s.min_retained_blocks
        assert max(spans) <= s.max_head_pages(1)
        assert s.max_head_pages(6) == 6 * s.max_head_pages(1)
        assert s.max_head_pages(6, max_model_len=5 * bs) == min(6 * s.max_head_pages(1), 5)
        assert s.retained_capacity(s.max_head_pages(2)) == s.max_head_pages(2) * bs
