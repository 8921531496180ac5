"""Host reads and launches of one eviction step of the engine, counted on CPU.

On a GPU every read of a device value by the host (``.tolist()``, ``int(t)``,
``nonzero``, a boolean-mask index...) stalls the step until the device has
caught up, and every tensor op is a launch. The engine reads the device a
fixed number of times per call, however many requests and KV heads it
evicts: counted here by :func:`~vllm_kvevict.eviction.host_reads.count_host_reads`
on the cache the CUDA backend serves with
(:class:`~vllm_kvevict.plugin.backends.triton.cache.TritonPagedCache`: reads
and writes by flat address, compaction in place, SnapKV's window votes for
every request at once), whose Triton compaction and window-score kernels run
here as their torch references, counted as one launch each (and CriticalKV's
value factor, the GPU's kernel, likewise). With ``-s`` each
case prints its counts for 1, 4 and 16 requests.
"""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest
import torch

from vllm_kvevict.eviction.allocation import (
    AdaKVAllocation, GlobalAllocation, PyramidAllocation, UniformAllocation,
)
from vllm_kvevict.eviction.cache_ops import EvictionObserver
from vllm_kvevict.eviction.global_pages import PooledEviction, compact_global_many
from vllm_kvevict.eviction.head_pages import compact_head_pages, compact_head_pages_many, compact_layers_many
from vllm_kvevict.eviction.host_reads import HostReads, count_host_reads
from vllm_kvevict.eviction.point import (
    EvictionPoint, LayerEviction, ObservationRows, StreamRows, observation_queries, observation_queries_many,
    observation_rows,
)
from vllm_kvevict.eviction.select import KeepRule
from vllm_kvevict.eviction.slots import evict_slots_layers_many, evict_slots_many
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.plugin.backends.triton.cache import TritonPagedCache
from vllm_kvevict.policies import RotaryFrequencies, ScoringInputs, make_policy
from vllm_kvevict.policies import criticalkv
from vllm_kvevict.policies.h2o import H2OPolicy
from vllm_kvevict.policies.snapkv import SnapKVPolicy
from vllm_kvevict.triton_kernels.compact_head_pages import compact_head_pages_reference
from vllm_kvevict.triton_kernels import value_norms
from vllm_kvevict.triton_kernels.value_norms import projected_value_norms_reference
from vllm_kvevict.triton_kernels.window_scores import window_votes_reference

BLOCK, DIM, GROUP, WINDOW, BUDGET, SINKS, RECENT = 16, 16, 2, 8, 64, 4, 8
# Two eviction points: the first makes the heads' lengths differ (AdaKV),
# the second, counted, falls inside a block (a partial block released).
FIRST, SECOND = 160, 232
REQUESTS, HEADS = (1, 4, 16), (1, 4)
ROPE = RotaryFrequencies(1.0 / 10000 ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM))


@pytest.fixture(autouse=True)
def device_path():
    """The engine as it runs on a device: the CPU worker's shortcuts (the
    C++ selection, rounding on the host), which an engine started in this
    process may have switched on, off for the test."""
    from vllm_kvevict import top_k
    from vllm_kvevict.eviction import allocation

    native, host_rounding = top_k._native, allocation._host_rounding
    top_k.use_native_selection(None)
    allocation.round_on_host(False)
    yield
    top_k.use_native_selection(native)
    allocation.round_on_host(host_rounding)


def frontier(point: int) -> int:
    return (point - BUDGET) // BLOCK * BLOCK


def engine(site: str) -> bool:
    """The engine's sites (and its caches'), not a policy's or the test's."""
    return not site.startswith("policies/") and site != "outside"


def policy(site: str) -> bool:
    return site.startswith("policies/")


class Requests:
    """``num_requests`` requests' blocks in one cache of ``layers`` layers'
    blocks, their side-buffer rows and query rings."""

    def __init__(
        self, num_requests: int, num_heads: int, layers: int = 1, seed: int = 0, moments: bool = False
    ) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.num_heads, self.layers = num_heads, layers
        self.blocks_per_layer = num_requests * 16 + 4
        kv = torch.randn(self.blocks_per_layer * layers, num_heads, BLOCK, 2 * DIM, generator=gen)
        kv[..., :DIM] *= torch.exp(torch.randn(1, num_heads, 1, 1, generator=gen))  # heads attend apart
        self.reads: HostReads | None = None
        self.cache = TritonPagedCache(kv, compaction=self._compaction, window_scores=self._window_scores)
        order = torch.randperm(self.blocks_per_layer, generator=gen)
        self.block_rows = [order[r * 15 : (r + 1) * 15].to(torch.int32) for r in range(num_requests)]
        capacity = 2 * layers * num_heads * BUDGET // BLOCK
        self.rows = [
            [
                StreamRows(
                    torch.zeros(num_heads, capacity * BLOCK, dtype=torch.int64),
                    torch.zeros(num_heads, capacity, dtype=torch.int32),
                    torch.zeros(num_heads, dtype=torch.int32),
                    EvictedMoments.zeros(None, num_heads, DIM) if moments else None,
                )
                for _ in range(layers)
            ]
            for _ in range(num_requests)
        ]
        self.ring_table = torch.randn(num_requests, WINDOW, num_heads * GROUP, DIM, generator=gen)
        self.rings = list(self.ring_table.unbind(0))
        self.queries = torch.randn(num_requests, num_heads * GROUP, DIM, generator=gen)
        self.log_beta = -0.1 * torch.rand(kv.shape[0] * num_heads, BLOCK, generator=gen)
        self.offsets = [layer * self.blocks_per_layer for layer in range(layers)]
        # [Hq, D, d_model]: a view of an o_proj weight's transpose, as the server passes it
        self.projection = torch.randn(24, num_heads * GROUP * DIM, generator=gen).t().reshape(-1, DIM, 24)
        # The other layers' own windows and output projections (the pooled layers' ranking).
        self.layer_rings = [self.ring_table] + [
            torch.randn(num_requests, WINDOW, num_heads * GROUP, DIM, generator=gen) for _ in range(layers - 1)
        ]
        self.layer_queries = [self.queries] + [
            torch.randn(num_requests, num_heads * GROUP, DIM, generator=gen) for _ in range(layers - 1)
        ]
        self.projections = [self.projection] + [
            torch.randn(24, num_heads * GROUP * DIM, generator=gen).t().reshape(-1, DIM, 24)
            for _ in range(layers - 1)
        ]

    def _compaction(self, *args: object) -> None:
        """The Triton compaction's stand-in: its torch twin, one launch."""
        if self.reads is None:
            compact_head_pages_reference(*args)  # type: ignore[arg-type]
            return
        with self.reads.one_launch("compact_head_pages (Triton)"):
            compact_head_pages_reference(*args)  # type: ignore[arg-type]

    def _window_scores(self, *args: object, **kwargs: object) -> torch.Tensor:
        """The Triton window-score kernels' stand-in: their torch reference, one launch."""
        if self.reads is None:
            return window_votes_reference(*args, **kwargs)  # type: ignore[arg-type]
        with self.reads.one_launch("window_votes (Triton)"):
            return window_votes_reference(*args, **kwargs)  # type: ignore[arg-type]

    def point(self, r: int, point: int, last: int, compacts: bool = True) -> EvictionPoint:
        """Request ``r`` reaching ``point`` in a decode step (its one new token)."""
        return EvictionPoint(
            f"r{r}", r, r, r, point - 1, last, frontier(last) if last else 0, point, frontier(point),
            point, compacts=compacts, region_start=last,
        )

    def observation(self, r: int, ev: EvictionPoint) -> tuple[torch.Tensor, torch.Tensor]:
        """The point's observation queries, as the backend takes them: the
        ring, and the step's one query."""
        return observation_queries(self.rings[r], self.queries, ev)

    def scoring_inputs(self, r: int, ev: EvictionPoint, window=None, layer: int = 0):
        """Request ``r``'s inputs at ``ev`` in ``layer``: its observation
        queries (``window``, or gathered for it alone) and the layer's
        output projection."""
        if window is None:
            window = observation_queries(self.layer_rings[layer][r], self.layer_queries[layer], ev)
        queries, query_positions = window

        def inputs(keys, values, positions, evicted):
            return ScoringInputs(
                keys, values, positions, queries, query_positions, DIM**-0.5, evicted, rotary=ROPE,
                output_projection=self.projections[layer],
            )

        return inputs

    def layer_cache(self, layer: int) -> TritonPagedCache:
        """Layer ``layer``'s own cache: its blocks of the pool."""
        blocks = slice(layer * self.blocks_per_layer, (layer + 1) * self.blocks_per_layer)
        return TritonPagedCache(
            self.cache.kv_cache[blocks], compaction=self._compaction, window_scores=self._window_scores
        )

    def observation_rows(self, point: int, last: int) -> ObservationRows:
        """Where every request's window is at ``point``: found once per step
        for every layer."""
        return observation_rows([self.point(r, point, last) for r in range(len(self.rows))], WINDOW, self.queries.device)

    def layer_evictions(
        self, point: int, last: int, layer: int = 0, rows: ObservationRows | None = None
    ) -> list[LayerEviction]:
        """Every request at ``point``, their observation queries gathered at
        once (from ``rows``, or found now), as the backend gathers a wave's."""
        evs = [self.point(r, point, last) for r in range(len(self.rows))]
        rows = rows if rows is not None else self.observation_rows(point, last)
        windows = observation_queries_many(self.ring_table, self.queries, rows)
        return [
            LayerEviction(ev, self.rows[r][layer], self.block_rows[r], self.scoring_inputs(r, ev, window))
            for r, (ev, window) in enumerate(zip(evs, windows))
        ]

    def pooled(self, point: int, last: int) -> list[PooledEviction]:
        """Every request at ``point``, ranked over every layer."""
        return [self.pooled_point(self.point(r, point, last)) for r in range(len(self.rows))]

    def pooled_point(self, ev: EvictionPoint) -> PooledEviction:
        """Request ``ev.state_row``'s point over every layer: each layer's own
        observation queries and output projection."""
        r = ev.state_row
        observation = [
            observation_queries(rings[r], queries, ev) for rings, queries in zip(self.layer_rings, self.layer_queries)
        ]
        parts = [{"output_projection": projection} for projection in self.projections]
        return PooledEviction(
            ev, self.rows[r], self.block_rows[r], ev.region_start, ev.frontier_before, observation, parts
        )


def head_pages_step(num_requests: int, num_heads: int, allocation, name: str = "snapkv") -> HostReads:
    requests = Requests(num_requests, num_heads, moments=make_policy(name).needs_moments)
    rule = KeepRule(make_policy(name), allocation, SINKS, RECENT)
    observer = EvictionObserver()
    compact_head_pages_many(requests.cache, rule, requests.layer_evictions(FIRST, 0), 0, observer)
    windows = requests.observation_rows(SECOND, FIRST)  # once per step, for every layer
    with count_host_reads() as reads, value_norms_kernel(requests):
        requests.reads = reads
        compact_head_pages_many(requests.cache, rule, requests.layer_evictions(SECOND, FIRST, rows=windows), 0,
                                observer)
    return reads


@contextlib.contextmanager
def value_norms_kernel(requests: Requests):
    """CriticalKV's value factor as a GPU computes it: the Triton kernel's
    stand-in, its torch reference, counted as one launch."""

    def kernel(values: torch.Tensor, output_projection: torch.Tensor) -> torch.Tensor:
        assert requests.reads is not None
        with requests.reads.one_launch("projected_value_norms (Triton)"):
            return projected_value_norms_reference(values, output_projection)

    with mock.patch.object(criticalkv, "_fused_value_norms", lambda values: True), \
            mock.patch.object(value_norms, "projected_value_norms", kernel):
        yield


def slots_step(num_requests: int, num_heads: int) -> HostReads:
    requests = Requests(num_requests, num_heads)
    rule = KeepRule(make_policy("snapkv"), UniformAllocation(), SINKS, RECENT)
    observer = EvictionObserver()
    evict_slots_many(requests.cache, rule, requests.layer_evictions(FIRST, 0), 0, observer)
    windows = requests.observation_rows(SECOND, FIRST)  # once per step, for every layer
    with count_host_reads() as reads:
        requests.reads = reads
        evict_slots_many(requests.cache, rule, requests.layer_evictions(SECOND, FIRST, rows=windows), 0, observer)
    return reads


def global_step(num_requests: int, num_heads: int, allocation, name: str) -> HostReads:
    """Three layers ranked together (the ranking after a step's last layer)."""
    requests = Requests(num_requests, num_heads, layers=3)
    rule = KeepRule(make_policy(name), allocation, SINKS, RECENT)
    observer = EvictionObserver()
    args = requests.offsets, requests.log_beta, DIM**-0.5, observer
    compact_global_many(requests.cache, rule, requests.pooled(FIRST, 0), *args)
    pooled = requests.pooled(SECOND, FIRST)  # the windows: gathered in each layer's forward
    with count_host_reads() as reads, value_norms_kernel(requests):
        requests.reads = reads
        compact_global_many(requests.cache, rule, pooled, *args)
    return reads


def layers_step(num_requests: int, num_heads: int, name: str) -> HostReads:
    """Three layers' evictions at the step's end as one batch on the pool
    (the backend hands the compacted lengths, read once per step)."""
    requests = Requests(num_requests, num_heads, layers=3, moments=make_policy(name).needs_moments)
    rule = KeepRule(make_policy(name), AdaKVAllocation(0.2), SINKS, RECENT)
    observer = EvictionObserver()

    def evictions(point: int, last: int, layer: int) -> list[LayerEviction]:
        evs = [requests.point(r, point, last) for r in range(num_requests)]
        return [
            LayerEviction(ev, requests.rows[r][layer], requests.block_rows[r], requests.scoring_inputs(r, ev, layer=layer))
            for r, ev in enumerate(evs)
        ]

    for layer in range(3):
        compact_head_pages_many(requests.layer_cache(layer), rule, evictions(FIRST, 0, layer), layer, observer)
    batch = [e for layer in range(3) for e in evictions(SECOND, FIRST, layer)]  # the windows: in each forward
    layers = [layer for layer in range(3) for _ in range(num_requests)]
    lengths = [e.rows.lens.tolist() for e in batch]
    with count_host_reads() as reads, value_norms_kernel(requests):
        requests.reads = reads
        kept = compact_layers_many(
            requests.cache, rule, batch, layers, [requests.offsets[layer] for layer in layers], observer, lengths
        )
    assert kept is not None
    return reads


def slots_layers_step(num_requests: int, num_heads: int) -> HostReads:
    """Three layers' slots evictions at the step's end as one batch on the pool."""
    requests = Requests(num_requests, num_heads, layers=3)
    rule = KeepRule(make_policy("snapkv"), UniformAllocation(), SINKS, RECENT)
    observer = EvictionObserver()

    def evictions(point: int, last: int, layer: int) -> list[LayerEviction]:
        evs = [requests.point(r, point, last) for r in range(num_requests)]
        return [
            LayerEviction(ev, StreamRows(requests.rows[r][layer].positions), requests.block_rows[r],
                          requests.scoring_inputs(r, ev, layer=layer))
            for r, ev in enumerate(evs)
        ]

    for layer in range(3):
        evict_slots_many(requests.layer_cache(layer), rule, evictions(FIRST, 0, layer), layer, observer)
    batch = [e for layer in range(3) for e in evictions(SECOND, FIRST, layer)]  # the windows: in each forward
    layers = [layer for layer in range(3) for _ in range(num_requests)]
    with count_host_reads() as reads:
        requests.reads = reads
        kept = evict_slots_layers_many(
            requests.cache, rule, batch, layers, [requests.offsets[layer] for layer in layers], observer
        )
    assert kept is not None
    return reads


# case: (its eviction step, the engine's host reads per call). Head pages with
# SnapKV: the selection's read, the counts read back (the test does not pass
# them), and one copy of the requests' points, budgets and window sizes to
# the device; slots with SnapKV: the copy and the selection's read; the
# pooled layers (global pages) the same three for every request and layer;
# every layer's evictions at the step's end the copy and the selection's
# read for every request and layer (the backend passes the lengths). SnapKV
# then reads nothing: the window-score kernel votes (TOVA's from the last
# query); KeyDiff's keys are read by address in one gather.
CASES = {
    "head_pages, SnapKV, uniform": (lambda r, h: head_pages_step(r, h, UniformAllocation()), 3),
    "head_pages, AdaKV + SnapKV": (lambda r, h: head_pages_step(r, h, AdaKVAllocation(0.2)), 3),
    "head_pages, TOVA": (lambda r, h: head_pages_step(r, h, UniformAllocation(), "tova"), 3),
    "head_pages, AdaKV + KeyDiff": (lambda r, h: head_pages_step(r, h, AdaKVAllocation(0.2), "keydiff"), 3),
    "head_pages, AdaKV + Expected Attention": (
        lambda r, h: head_pages_step(r, h, AdaKVAllocation(0.2), "expected_attention"), 3
    ),
    "head_pages, MomentKV (AdaKV, moments)": (
        lambda r, h: head_pages_step(r, h, AdaKVAllocation(0.2), "momentkv"), 3
    ),
    "head_pages, AdaKV + CriticalKV (Expected Attention)": (
        lambda r, h: head_pages_step(r, h, AdaKVAllocation(0.2), "criticalkv"), 3
    ),
    "head_pages, AdaKV + DefensiveKV": (
        lambda r, h: head_pages_step(r, h, AdaKVAllocation(0.2), "defensivekv"), 3
    ),
    "slots, SnapKV": (slots_step, 2),
    "slots, 3 layers at the step's end, SnapKV": (slots_layers_step, 2),
    "head_pages, 3 layers at the step's end, AdaKV + SnapKV": (lambda r, h: layers_step(r, h, "snapkv"), 2),
    "head_pages, 3 layers at the step's end, MomentKV": (lambda r, h: layers_step(r, h, "momentkv"), 2),
    "head_pages, 3 layers at the step's end, AdaKV + DefensiveKV": (
        lambda r, h: layers_step(r, h, "defensivekv"), 2
    ),
    "global pages, learned (global)": (lambda r, h: global_step(r, h, GlobalAllocation(), "learned"), 3),
    "global pages, PyramidKV": (lambda r, h: global_step(r, h, PyramidAllocation(2.0), "pyramidkv"), 3),
    "global pages, Layer-DefensiveKV": (
        lambda r, h: global_step(r, h, GlobalAllocation(), "layer_defensivekv"), 3
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_host_reads_do_not_grow_with_requests_or_heads(case: str) -> None:
    """The engine's host reads per call are the same for 1, 4 and 16
    requests and for 1 and 4 KV heads; the counts (host reads, launches: the
    engine's, then the policy's) are printed for the table."""
    step, expected = CASES[case]
    counts = {(r, h): step(r, h) for h in HEADS for r in REQUESTS}
    for h in HEADS:
        print(
            f"\n{case}, {h} KV head(s): "
            + " | ".join(
                f"{r} req: {counts[r, h].syncs(engine)} reads + {counts[r, h].syncs(policy)} in the policy, "
                f"{counts[r, h].launches(engine)} launches + {counts[r, h].launches(policy)} in the policy"
                for r in REQUESTS
            )
        )
    sites = counts[REQUESTS[-1], HEADS[-1]]
    print("   where (16 requests, 4 heads):\n" + sites.table())
    for (r, h), reads in counts.items():
        assert reads.syncs(engine) == expected, (case, r, h, reads.table())


def test_a_step_of_many_requests_keeps_what_each_alone_keeps() -> None:
    """Evicting the requests together keeps, writes and records the same as
    evicting each alone."""
    rule = KeepRule(make_policy("snapkv"), AdaKVAllocation(0.2), SINKS, RECENT)
    together, alone = Requests(6, 3, seed=5), Requests(6, 3, seed=5)
    observer = EvictionObserver()
    for point, last in ((FIRST, 0), (SECOND, FIRST)):
        kept = compact_head_pages_many(together.cache, rule, together.layer_evictions(point, last), 0, observer)
        for r, eviction in enumerate(alone.layer_evictions(point, last)):
            counts = compact_head_pages(
                alone.cache, rule, eviction.ev, eviction.rows, eviction.block_row, eviction.scoring_inputs,
                0, observer,
            )
            assert kept[r].tolist() == counts
    assert torch.equal(together.cache.kv_cache, alone.cache.kv_cache)
    for rows_together, rows_alone in zip(together.rows, alone.rows):
        for a, b in zip(rows_together, rows_alone):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.pages, b.pages)
            assert torch.equal(a.lens, b.lens)


class HeadByHeadSnapKV(SnapKVPolicy):
    """SnapKV attending with the window queries itself, head by head."""

    reads_window_votes = False


@pytest.mark.parametrize("pooling", ["max", "avg"])
def test_window_votes_for_every_request_keep_what_head_by_head_scoring_keeps(pooling: str) -> None:
    """SnapKV from the cache's window votes of every request and head at once
    keeps, writes and records what SnapKV attending head by head keeps, on
    heads of different lengths (AdaKV), through two eviction points; the
    policy then reads nothing back."""
    policies = SnapKVPolicy(kernel_size=7, pooling=pooling), HeadByHeadSnapKV(kernel_size=7, pooling=pooling)
    voted, head_by_head = Requests(5, 3, seed=11), Requests(5, 3, seed=11)
    observer = EvictionObserver()
    for point, last in ((FIRST, 0), (SECOND, FIRST)):
        kept = []
        for requests, policy in zip((voted, head_by_head), policies):
            rule = KeepRule(policy, AdaKVAllocation(0.2), SINKS, RECENT)
            with count_host_reads() as reads:
                kept.append(compact_head_pages_many(requests.cache, rule, requests.layer_evictions(point, last), 0,
                                                    observer))
            if requests is voted:
                assert reads.syncs(lambda site: site.startswith("policies/")) == 0, reads.table()
        assert [k.tolist() for k in kept[0]] == [k.tolist() for k in kept[1]]
        assert len({tuple(k.tolist()) for k in kept[0]}) > 1  # the requests keep differently
    assert torch.equal(voted.cache.kv_cache, head_by_head.cache.kv_cache)
    assert any(len(set(rows[0].lens.tolist())) > 1 for rows in voted.rows)  # heads of different lengths
    for rows_voted, rows_alone in zip(voted.rows, head_by_head.rows):
        for a, b in zip(rows_voted, rows_alone):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.pages, b.pages)
            assert torch.equal(a.lens, b.lens)


class HeadByHeadH2O(H2OPolicy):
    """H2O summing the window's attention itself, head by head."""

    reads_window_votes = False


def request_by_request(policy):
    """``policy`` scoring each request alone from its own inputs: attending
    with its window queries itself (no votes), its rows never stacked with
    another request's."""
    alone = type(f"Alone{type(policy).__name__}", (type(policy),),
                 {"reads_window_votes": False, "scores_rows_apart": False, "scores_stacked_requests": False})
    return alone(**{f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.init})


@pytest.mark.parametrize(
    "policy",
    ["snapkv", "h2o", "tova", "knorm", "keydiff", "streamingllm", "expected_attention", "momentkv", "snapkv+moments",
     "criticalkv", "criticalkv+snapkv", "random", "defensivekv"],
)
@pytest.mark.parametrize("allocation", [AdaKVAllocation(0.2), UniformAllocation()], ids=["adakv", "uniform"])
def test_requests_at_their_own_points_and_budgets_keep_what_each_keeps_alone(allocation, policy: str) -> None:
    """The requests of a step evicted as one batch, each at its own point
    with its own budget, some compacting for the first time while others
    compact again, keep, write and record what the policy scoring each
    request alone keeps: attending head by head (SnapKV; H2O, whose sum over
    the window is the votes times W; TOVA, the last query's attention), or
    from each request's own tokens (Knorm, KeyDiff, StreamingLLM; random, by
    each row's KV head) and window
    (Expected Attention, the statistics of each request's queries; MomentKV,
    each request's moments and rounds, the evicted tokens folded into its
    moments; SnapKV with moment_correction, its evicted tokens folded;
    CriticalKV on Expected Attention or on SnapKV's votes, each request's
    two stages and value factor)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    budgets = [48, 64, 96, 64, 32, 80]
    firsts = [int(torch.randint(96, 160, (), generator=gen)) for _ in budgets]
    seconds = [first + int(torch.randint(8, 80, (), generator=gen)) for first in firsts]
    seed = int(torch.randint(0, 1000, (), generator=gen))
    name, _, variant = policy.partition("+")
    options = {"kernel_size": 7} if name == "snapkv" else {"base": variant} if name == "criticalkv" and variant else {}
    voting = make_policy(name, options)
    moments = voting.needs_moments or variant == "moments"
    together, alone = (Requests(len(budgets), 3, seed=seed, moments=moments) for _ in range(2))
    attending = request_by_request(voting)
    voted = KeepRule(voting, allocation, SINKS, RECENT)
    head_by_head = KeepRule(attending, allocation, SINKS, RECENT)
    observer = EvictionObserver()

    def point(requests: Requests, r: int, at: int, last: int) -> LayerEviction:
        cut = lambda p: (p - budgets[r]) // BLOCK * BLOCK if p else 0  # noqa: E731
        ev = EvictionPoint(
            f"r{r}", r, r, r, at - 1, last, cut(last), at, cut(at), at, compacts=True, region_start=last,
        )
        return LayerEviction(ev, requests.rows[r][0], requests.block_rows[r], requests.scoring_inputs(r, ev))

    steps = [  # (request, point, last point)
        [(r, firsts[r], 0) for r in (0, 1, 2, 3)],
        [(0, seconds[0], firsts[0]), (4, firsts[4], 0), (2, seconds[2], firsts[2]), (5, firsts[5], 0),
         (3, seconds[3], firsts[3])],
    ]
    for step in steps:
        with count_host_reads() as reads:
            together.reads = reads
            batch = compact_head_pages_many(
                together.cache, voted, [point(together, r, at, last) for r, at, last in step], 0, observer
            )
        together.reads = None
        # One batch: one compaction launch for every request of the step.
        assert reads.launches(lambda site: site.startswith("compact_head_pages")) == 1, reads.table()
        for (r, at, last), counts in zip(step, batch):
            (want,) = compact_head_pages_many(alone.cache, head_by_head, [point(alone, r, at, last)], 0, observer)
            assert counts.tolist() == want.tolist(), (r, at, last)
    assert torch.equal(together.cache.kv_cache, alone.cache.kv_cache)
    for rows_together, rows_alone in zip(together.rows, alone.rows):
        for a, b in zip(rows_together, rows_alone):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.pages, b.pages)
            assert torch.equal(a.lens, b.lens)
            if a.moments is not None:
                assert bool(a.moments.count.gt(0).any())  # evicted tokens folded
                for got, want in zip(a.moments._buffers(), b.moments._buffers()):
                    assert torch.equal(got, want)


def kept_tokens(requests: Requests, pooled: bool = True) -> list[torch.Tensor]:
    """Each stream's compacted tokens, read through its page table (what
    attention reads: the rest of a last page, and the blocks freed, are
    zeroed by the request-by-request write and left as they were by the
    compaction kernel): of the pool's head-pages (``pooled``), or of each
    layer's own."""
    kept = []
    for layers in requests.rows:
        for layer, rows in enumerate(layers):
            cache = requests.cache if pooled else requests.layer_cache(layer)
            for lens, pages in zip(rows.lens.tolist(), rows.pages.tolist()):
                keys, values = cache.read_pages(torch.tensor(pages[: -(-lens // BLOCK)]), lens)
                kept.append(torch.cat([keys, values], dim=-1))
    return kept


POOLED = {  # case: (policy, its options, allocation)
    "learned": ("learned", {}, GlobalAllocation()),
    "learned, a floor per stream": ("learned", {}, GlobalAllocation(floor=6)),
    "layer_defensivekv": ("layer_defensivekv", {}, GlobalAllocation()),
    "defensivekv, a floor per stream": ("defensivekv", {}, GlobalAllocation(floor=4)),
    "pyramidkv": ("pyramidkv", {"kernel_size": 7}, PyramidAllocation(1.5)),
    "tova, pyramid": ("tova", {}, PyramidAllocation(2.0)),
    "knorm, pyramid": ("knorm", {}, PyramidAllocation(1.5)),
    "random, pyramid": ("random", {}, PyramidAllocation(1.5)),
}


@pytest.mark.parametrize("case", list(POOLED))
def test_pooled_requests_at_their_own_points_and_budgets_keep_what_each_keeps_alone(case: str) -> None:
    """The pooled layers' ranking (every layer and KV head of a request at
    once: the global top-B, PyramidKV's layer budgets) of a step's requests
    as one batch, each at its own point with its own budget, some compacting
    for the first time while others compact again, each layer with its own
    window and output projection, keeps, writes and records what the policy
    ranking each request alone keeps (attending with its windows itself,
    its rows never stacked): the same counts per layer and head, cache,
    page tables, positions and (the learned policy's) log β pages, in one
    compaction launch for every request and layer."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    budgets = [48, 64, 96, 64, 32, 80]
    firsts = [int(torch.randint(96, 160, (), generator=gen)) for _ in budgets]
    seconds = [first + int(torch.randint(8, 80, (), generator=gen)) for first in firsts]
    seed = int(torch.randint(0, 1000, (), generator=gen))
    name, options, allocation = POOLED[case]
    policy = make_policy(name, options)
    together, alone = (Requests(len(budgets), 3, layers=3, seed=seed) for _ in range(2))
    for requests in (together, alone):  # the learned policy's layers retain on scales of their own
        requests.log_beta.view(3, -1, BLOCK).mul_(torch.tensor([0.2, 1.0, 5.0])[:, None, None])
    batched = KeepRule(policy, allocation, SINKS, RECENT)
    each = KeepRule(request_by_request(policy), allocation, SINKS, RECENT)
    observer = EvictionObserver()

    def point(requests: Requests, r: int, at: int, last: int) -> PooledEviction:
        cut = lambda p: (p - budgets[r]) // BLOCK * BLOCK if p else 0  # noqa: E731
        ev = EvictionPoint(
            f"r{r}", r, r, r, at - 1, last, cut(last), at, cut(at), at, compacts=True, region_start=last,
        )
        return requests.pooled_point(ev)

    steps = [  # (request, point, last point)
        [(r, firsts[r], 0) for r in (0, 1, 2, 3)],
        [(0, seconds[0], firsts[0]), (4, firsts[4], 0), (2, seconds[2], firsts[2]), (5, firsts[5], 0),
         (3, seconds[3], firsts[3])],
    ]
    for step in steps:
        pooled = [point(together, r, at, last) for r, at, last in step]
        with count_host_reads() as reads, value_norms_kernel(together):
            together.reads = reads
            batch = compact_global_many(
                together.cache, batched, pooled, together.offsets, together.log_beta, DIM**-0.5, observer
            )
        together.reads = None
        # One batch: one compaction launch for every request and layer of the step.
        assert reads.launches(lambda site: site.startswith("compact_head_pages")) == 1, reads.table()
        for (r, at, last), per_layer in zip(step, batch):
            (want,) = compact_global_many(
                alone.cache, each, [point(alone, r, at, last)], alone.offsets, alone.log_beta, DIM**-0.5, observer
            )
            assert [c.tolist() for c in per_layer] == [c.tolist() for c in want], (r, at, last)
    assert all(torch.equal(a, b) for a, b in zip(kept_tokens(together), kept_tokens(alone)))
    if policy.needs_log_beta:
        assert torch.equal(together.log_beta, alone.log_beta)
    differ = False
    for rows_together, rows_alone in zip(together.rows, alone.rows):
        for a, b in zip(rows_together, rows_alone):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.pages, b.pages)
            assert torch.equal(a.lens, b.lens)
        differ |= len({tuple(rows.lens.tolist()) for rows in rows_together}) > 1
    assert differ  # the layers keep different numbers of tokens


@pytest.mark.parametrize(
    "policy", ["snapkv", "expected_attention", "momentkv", "criticalkv", "defensivekv", "keydiff", "tova"]
)
def test_every_layers_evictions_at_a_steps_end_keep_what_each_layer_keeps(policy: str) -> None:
    """A step's evictions of every layer, run as one batch after the last
    layer on the pool of every layer's blocks (each request at its own point
    and budget, each layer with its own window and output projection, its
    moments where the policy folds them), keep, write and record what each
    layer's own batch on its own cache keeps: the same counts, page tables
    (in the layer's own block ids), positions, kept tokens and moments, in
    one compaction launch for every layer."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    budgets = [48, 64, 96, 64]
    firsts = [int(torch.randint(96, 160, (), generator=gen)) for _ in budgets]
    seconds = [first + int(torch.randint(8, 80, (), generator=gen)) for first in firsts]
    seed = int(torch.randint(0, 1000, (), generator=gen))
    rules = KeepRule(make_policy(policy), AdaKVAllocation(0.2), SINKS, RECENT)
    moments = rules.policy.needs_moments
    together, apart = (Requests(len(budgets), 3, layers=3, seed=seed, moments=moments) for _ in range(2))
    observer = EvictionObserver()

    def evictions(requests: Requests, layer: int, step: list[tuple[int, int, int]]) -> list[LayerEviction]:
        cut = lambda r, p: (p - budgets[r]) // BLOCK * BLOCK if p else 0  # noqa: E731
        points = [
            EvictionPoint(f"r{r}", r, r, r, at - 1, last, cut(r, last), at, cut(r, at), at, compacts=True,
                          region_start=last)
            for r, at, last in step
        ]
        return [
            LayerEviction(ev, requests.rows[ev.state_row][layer], requests.block_rows[ev.state_row],
                          requests.scoring_inputs(ev.state_row, ev, layer=layer))
            for ev in points
        ]

    steps = [
        [(r, firsts[r], 0) for r in range(4)],
        [(0, seconds[0], firsts[0]), (2, seconds[2], firsts[2]), (3, seconds[3], firsts[3])],
    ]
    for step in steps:
        batch = [e for layer in range(3) for e in evictions(together, layer, step)]
        layers = [layer for layer in range(3) for _ in step]
        lengths = [e.rows.lens.tolist() for e in batch]
        with count_host_reads() as reads, value_norms_kernel(together):
            together.reads = reads
            kept = compact_layers_many(
                together.cache, rules, batch, layers, [together.offsets[layer] for layer in layers], observer,
                lengths,
            )
        together.reads = None
        assert kept is not None
        assert reads.launches(lambda site: site.startswith("compact_head_pages")) == 1, reads.table()
        want = [
            counts for layer in range(3)
            for counts in compact_head_pages_many(apart.layer_cache(layer), rules, evictions(apart, layer, step),
                                                  layer, observer)
        ]
        assert [k.tolist() for k in kept] == [w.tolist() for w in want]
    assert all(torch.equal(a, b) for a, b in zip(kept_tokens(together, False), kept_tokens(apart, False)))
    differ = False
    for rows_together, rows_apart in zip(together.rows, apart.rows):
        for a, b in zip(rows_together, rows_apart):
            assert torch.equal(a.positions, b.positions) and torch.equal(a.pages, b.pages)
            assert torch.equal(a.lens, b.lens)
            assert int(a.pages.max()) < together.blocks_per_layer * together.num_heads  # the layer's own ids
            if a.moments is not None:
                assert bool(a.moments.count.gt(0).any())
                for got, expected in zip(a.moments._buffers(), b.moments._buffers()):
                    assert torch.equal(got, expected)
        differ |= len({tuple(rows.positions.flatten().tolist()) for rows in rows_together}) > 1
    assert differ  # the layers keep different tokens


@pytest.mark.parametrize("name", ["streamingllm", "random", "keydiff"])
def test_the_policies_of_positions_read_no_key_or_value(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """StreamingLLM and random score a batch from the tokens' positions
    (and KV heads) alone: the cache's read by address is never called, and
    they keep what they keep when it is (KeyDiff, which scores keys, reads)."""
    rule = KeepRule(make_policy(name), AdaKVAllocation(0.2), SINKS, RECENT)
    reading, blind = Requests(4, 3, seed=3), Requests(4, 3, seed=3)
    reads: list[int] = []
    original = TritonPagedCache.read_tokens

    def counted(self, *args):
        reads.append(1)
        return original(self, *args)

    observer = EvictionObserver()
    for point, last in ((FIRST, 0), (SECOND, FIRST)):
        monkeypatch.setattr(TritonPagedCache, "read_tokens", counted)
        kept = compact_head_pages_many(blind.cache, rule, blind.layer_evictions(point, last), 0, observer)
        monkeypatch.undo()
        if name == "keydiff":
            assert reads
            return
        assert not reads
        rows_rule = KeepRule(request_by_request(make_policy(name)), AdaKVAllocation(0.2), SINKS, RECENT)
        want = compact_head_pages_many(reading.cache, rows_rule, reading.layer_evictions(point, last), 0, observer)
        assert [k.tolist() for k in kept] == [w.tolist() for w in want]
    assert torch.equal(blind.cache.kv_cache, reading.cache.kv_cache)


@pytest.mark.parametrize("policy", ["snapkv", "tova", "keydiff", "random"])
def test_slots_of_requests_at_their_own_points_keep_what_each_keeps_alone(policy: str) -> None:
    """The slots storage's batch (the window-score kernel's votes, or the
    tokens read by address; one compaction launch) keeps, writes and records
    what the policy scoring each request alone keeps (SnapKV and TOVA
    attending head by head, KeyDiff from the request's own keys, random
    by each row's KV head): requests
    at their own points and budgets, one whose frontier stays in its block
    (positions only), over two eviction points."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    budgets = [48, 64, 96, 64, 32]
    seed = int(torch.randint(0, 1000, (), generator=gen))
    together, alone = Requests(len(budgets), 3, seed=seed), Requests(len(budgets), 3, seed=seed)
    voting = make_policy(policy, {"kernel_size": 7} if policy == "snapkv" else {})
    voted = KeepRule(voting, UniformAllocation(), SINKS, RECENT)
    head_by_head = KeepRule(request_by_request(voting), UniformAllocation(), SINKS, RECENT)
    observer = EvictionObserver()

    def point(requests: Requests, r: int, at: int, last: int) -> LayerEviction:
        cut = lambda p: max((p - budgets[r]) // BLOCK * BLOCK, 0) if p else 0  # noqa: E731
        ev = EvictionPoint(f"r{r}", r, r, r, at - 1, last, cut(last), at, cut(at), at)
        return LayerEviction(ev, StreamRows(requests.rows[r][0].positions), requests.block_rows[r],
                             requests.scoring_inputs(r, ev))

    firsts = [int(torch.randint(100, 150, (), generator=gen)) for _ in budgets[:4]] + [128]
    steps = [  # (request, point, last point); request 4's second point stays in its frontier's block
        [(r, firsts[r], 0) for r in range(len(budgets))],
        [(r, firsts[r] + int(torch.randint(20, 80, (), generator=gen)), firsts[r]) for r in range(4)]
        + [(4, firsts[4] + 1, firsts[4])],
    ]
    for step in steps:
        with count_host_reads() as reads:
            together.reads = reads
            batch = evict_slots_many(together.cache, voted, [point(together, r, at, last) for r, at, last in step],
                                     0, observer)
        together.reads = None
        assert reads.launches(lambda site: site.startswith("compact_head_pages")) == 1, reads.table()
        for (r, at, last), got in zip(step, batch):
            (want,) = evict_slots_many(alone.cache, head_by_head, [point(alone, r, at, last)], 0, observer)
            assert got == want, (r, at, last)
    assert batch[-1] is None and batch[0] is not None
    assert torch.equal(together.cache.kv_cache, alone.cache.kv_cache)
    for rows_together, rows_alone in zip(together.rows, alone.rows):
        assert torch.equal(rows_together[0].positions, rows_alone[0].positions)


@pytest.mark.parametrize("policy", ["snapkv", "tova", "keydiff", "expected_attention"])
def test_slots_of_every_layer_at_a_steps_end_keep_what_each_layer_keeps(policy: str) -> None:
    """The slots storage's evictions of every layer at a step's end, run as
    one batch on the pool of every layer's blocks (each layer with its own
    window), keep, write and record what each layer's own batch keeps on
    its own cache: the same counts, positions and cache, in one compaction
    launch for every layer; one request's frontier stays in its block
    (positions only)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    budgets = [48, 64, 96, 32]
    seed = int(torch.randint(0, 1000, (), generator=gen))
    together, apart = (Requests(len(budgets), 3, layers=3, seed=seed) for _ in range(2))
    rule = KeepRule(make_policy(policy, {"kernel_size": 7} if policy == "snapkv" else {}), UniformAllocation(),
                    SINKS, RECENT)
    observer = EvictionObserver()

    def evictions(requests: Requests, layer: int, step: list[tuple[int, int, int]]) -> list[LayerEviction]:
        cut = lambda r, p: max((p - budgets[r]) // BLOCK * BLOCK, 0) if p else 0  # noqa: E731
        out = []
        for r, at, last in step:
            ev = EvictionPoint(f"r{r}", r, r, r, at - 1, last, cut(r, last), at, cut(r, at), at)
            out.append(LayerEviction(ev, StreamRows(requests.rows[r][layer].positions), requests.block_rows[r],
                                     requests.scoring_inputs(r, ev, layer=layer)))
        return out

    firsts = [int(torch.randint(100, 150, (), generator=gen)) for _ in budgets[:3]] + [128]
    steps = [
        [(r, firsts[r], 0) for r in range(len(budgets))],
        [(r, firsts[r] + int(torch.randint(20, 80, (), generator=gen)), firsts[r]) for r in range(3)]
        + [(3, firsts[3] + 1, firsts[3])],
    ]
    for step in steps:
        batch = [e for layer in range(3) for e in evictions(together, layer, step)]
        layers = [layer for layer in range(3) for _ in step]
        with count_host_reads() as reads:
            together.reads = reads
            got = evict_slots_layers_many(
                together.cache, rule, batch, layers, [together.offsets[layer] for layer in layers], observer
            )
        together.reads = None
        assert got is not None
        assert reads.launches(lambda site: site.startswith("compact_head_pages")) == 1, reads.table()
        want = [
            counts for layer in range(3)
            for counts in evict_slots_many(apart.layer_cache(layer), rule, evictions(apart, layer, step), layer,
                                           observer)
        ]
        assert got == want
    assert got[-1] is None and got[0] is not None
    assert torch.equal(together.cache.kv_cache, apart.cache.kv_cache)
    for rows_together, rows_apart in zip(together.rows, apart.rows):
        for a, b in zip(rows_together, rows_apart):
            assert torch.equal(a.positions, b.positions)
    assert len({tuple(rows.positions.flatten().tolist()) for rows in together.rows[0]}) > 1  # layers apart


def test_a_waves_observation_queries_are_each_points_own() -> None:
    """The observation queries of several points gathered at once equal each
    point's own (:func:`observation_queries`): windows from the ring, from
    the step's queries and across both, shorter than the ring at the start."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    rings = torch.randn(6, WINDOW, 4, DIM, generator=gen)
    query = torch.randn(64, 4, DIM, generator=gen).double()  # the ring's rows take its dtype
    evs, start = [], 0
    for r in range(6):
        point = int(torch.randint(1, 40, (), generator=gen))
        before = int(torch.randint(max(0, point - 12), point, (), generator=gen))
        evs.append(EvictionPoint(f"r{r}", r, (r * 5) % 6, start, before, 0, 0, point, 0, point))
        start += point - before
    rows = observation_rows(evs, WINDOW, query.device)
    for (queries, positions), ev in zip(observation_queries_many(rings, query, rows), evs):
        want_queries, want_positions = observation_queries(rings[ev.state_row], query, ev)
        assert queries.dtype == torch.float64
        assert torch.equal(queries, want_queries) and torch.equal(positions, want_positions)


def test_the_counter_sees_every_kind_of_host_read() -> None:
    """What the counter counts as a host read, and what it does not."""
    t = torch.arange(6)
    with count_host_reads() as reads:
        t.tolist(), t[0].item(), int(t[1]), bool(t[2]), float(t[3]), t[: t[4]]  # noqa: B018
        t.nonzero(), t[t > 2], torch.tensor([1, 2]), torch.repeat_interleave(t, t)  # noqa: B018
    assert reads.syncs() == 10, reads.table()
    with count_host_reads() as reads:
        t.topk(3), t.cumsum(0), t.clamp(max=3), t[1:3], torch.arange(3)  # noqa: B018
        torch.repeat_interleave(t, t, output_size=15), torch.where(t > 2, t, 0)  # noqa: B018
        torch.zeros(6, dtype=torch.long).scatter_(0, t.flip(0), t)
    assert reads.syncs() == 0, reads.table()
    assert reads.launches() >= 8


@pytest.mark.parametrize("seed", range(3))
def test_the_triton_caches_reads_and_writes_by_address_are_its_per_head_ones(seed: int) -> None:
    """:meth:`TritonPagedCache.read_tokens` and :meth:`~TritonPagedCache.write_heads`
    (one gather, one scatter) read and write what the per-head reads and
    writes do, on a strided view of the cache."""
    from vllm_kvevict.eviction.head_pages import block_head_pages, gather_live, page_tables
    from vllm_kvevict.schedule import cdiv

    gen = torch.Generator().manual_seed(seed)
    heads, num_blocks = 3, 40
    storage = torch.randn(num_blocks, BLOCK, heads, 2 * DIM, generator=gen)  # vLLM's [blocks, bs, H, 2D]
    by_address = TritonPagedCache(storage.clone().permute(0, 2, 1, 3))
    head_by_head = TritonPagedCache(storage.clone().permute(0, 2, 1, 3))
    block_row = torch.randperm(num_blocks, generator=gen)[:12].to(torch.int32)
    lens = torch.tensor([37, 0, 20], dtype=torch.int32)
    pages = torch.zeros(heads, 8, dtype=torch.int32)
    pages[:, :3] = block_head_pages(block_row[8:11], heads).view(heads, 3)
    positions = torch.arange(heads * 64).view(heads, 64)
    got = gather_live(by_address, pages, lens, positions, block_row, 90, 150)
    for h, length in enumerate(lens.tolist()):
        keys, values = head_by_head.read_pages(pages[h], length)
        slot_keys, slot_values = head_by_head.read_slots(block_row, 90, 150)
        assert torch.equal(got.keys[h, :length], keys) and torch.equal(got.values[h, :length], values)
        assert torch.equal(got.keys[h, length : length + 60], slot_keys[h])
        assert torch.equal(got.values[h, length : length + 60], slot_values[h])
        assert not got.keys[h, length + 60 :].any() and not got.values[h, length + 60 :].any()
    kept = torch.stack([torch.randperm(got.keys.shape[1], generator=gen)[:40].sort().values for _ in range(heads)])
    counts = torch.tensor([40, 0, 17])
    kept[2, 17:] = -1
    table = page_tables(block_head_pages(block_row[:4], heads), counts, BLOCK, 8)
    by_address.write_heads(got.keys, got.values, kept, counts, table)
    for h, count in enumerate(counts.tolist()):
        index = kept[h, :count]
        head_by_head.write_pages(table[h, : cdiv(count, BLOCK)], got.keys[h, index], got.values[h, index])
    assert torch.equal(by_address.kv_cache, head_by_head.kv_cache)
