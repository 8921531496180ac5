"""The eviction engine on a plain torch cache, outside vLLM.

The engine reaches a cache only through ``CacheOps``; here that is a logical
``[blocks, H, bs, D]`` cache written in a few lines, so what the engine keeps,
where it writes it and what it folds into the moments are checked against
brute force: each head's top tokens by the policy's score, the original keys
and values at the kept positions, and the moments of the dropped tokens
computed directly in fp64.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vllm_kvevict.eviction.cache_ops import EvictionObserver, Released
from vllm_kvevict.eviction.allocation import AdaKVAllocation, UniformAllocation
from vllm_kvevict.eviction.head_pages import compact_head_pages
from vllm_kvevict.eviction.point import EvictionPoint, StreamRows
from vllm_kvevict.eviction.select import KeepRule, choose_kept
from vllm_kvevict.eviction.slots import evict_slots
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.policies import ScoringInputs, make_policy


class LogicalCache:
    """CacheOps over logical ``keys, values [blocks, H, bs, D]``; head-page ``b * H + s``."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys, self.values = keys, values

    @property
    def num_heads(self) -> int:
        return self.keys.shape[1]

    @property
    def block_size(self) -> int:
        return self.keys.shape[2]

    def _slots(self, block_row: torch.Tensor, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        slots = torch.arange(start, end)
        return block_row[slots // self.block_size].long(), slots % self.block_size

    def read_slots(self, block_row, start, end):
        blocks, offsets = self._slots(block_row, start, end)
        return self.keys[blocks, :, offsets].transpose(0, 1), self.values[blocks, :, offsets].transpose(0, 1)

    def write_slots(self, block_row, start, keys, values):
        blocks, offsets = self._slots(block_row, start, start + keys.shape[1])
        self.keys[blocks, :, offsets] = keys.transpose(0, 1)
        self.values[blocks, :, offsets] = values.transpose(0, 1)

    def _pages(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(-1, self.block_size, cache.shape[-1])

    def read_pages(self, pages, length):
        chosen = pages[: -(-length // self.block_size)].long()
        head_dim = self.keys.shape[-1]
        return (
            self._pages(self.keys)[chosen].reshape(-1, head_dim)[:length],
            self._pages(self.values)[chosen].reshape(-1, head_dim)[:length],
        )

    def write_pages(self, pages, keys, values):
        for cache, tokens in ((self.keys, keys), (self.values, values)):
            flat = self._pages(cache)
            for i, page in enumerate(pages.tolist()):
                part = tokens[i * self.block_size : (i + 1) * self.block_size]
                flat[page, : part.shape[0]] = part


class Recorder(EvictionObserver):
    def __init__(self) -> None:
        self.released_memory: list[Released] = []

    def released(self, cache, released):
        self.released_memory.append(released)


def _request(gen: torch.Generator, num_blocks: int, heads: int, bs: int, dim: int, point: int):
    keys = torch.randn(num_blocks, heads, bs, dim, generator=gen)
    values = torch.randn(num_blocks, heads, bs, dim, generator=gen)
    block_row = torch.randperm(num_blocks, generator=gen)[: -(-point // bs)].to(torch.int32)
    cache = LogicalCache(keys, values)
    all_keys, all_values = cache.read_slots(block_row, 0, point)  # [H, P, D] by position
    return cache, block_row, all_keys.clone(), all_values.clone()


def _inputs_for(scale: float):
    def inputs(keys, values, positions, evicted):
        return ScoringInputs(keys, values, positions, None, None, scale, evicted)

    return inputs


def test_engine_imports_neither_vllm_nor_a_device_backend() -> None:
    code = (
        "import sys\n"
        "import vllm_kvevict.eviction.slots, vllm_kvevict.eviction.head_pages\n"
        "import vllm_kvevict.eviction.global_pages, vllm_kvevict.eviction.select\n"
        "bad = [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.') or m == 'triton']\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("policy", ["knorm", "keydiff", "random"])
@pytest.mark.parametrize("seed", range(3))
def test_uniform_one_token_pages_keep_what_the_policys_select_keeps(policy: str, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    heads, live, dim = 3, 90, 16
    inputs = ScoringInputs(
        torch.randn(heads, live, dim, generator=gen), torch.randn(heads, live, dim, generator=gen),
        torch.arange(live).expand(heads, -1), None, None, dim**-0.5,
    )
    rule = KeepRule(make_policy(policy), UniformAllocation(), 4, 8)
    num_keep = int(torch.randint(12, live, (1,), generator=gen))
    counts, kept = choose_kept(rule, [inputs], [None], live, heads * num_keep, 1)
    assert counts.tolist() == [num_keep] * heads
    assert torch.equal(kept, rule.policy.select(inputs, num_keep, 4, 8, live))


@pytest.mark.parametrize("prefix", [0, 16])
@pytest.mark.parametrize("seed", range(4))
def test_slots_eviction_writes_the_kept_tokens_in_order(seed: int, prefix: int) -> None:
    """With a protected prefix (two blocks here) its slots are neither
    candidates nor rewritten nor freed: the tokens after it are chosen from."""
    gen = torch.Generator().manual_seed(seed)
    heads, bs, dim, point, frontier = 2, 8, 16, 80, 40
    cache, block_row, keys, values = _request(gen, 16, heads, bs, dim, point)
    positions_row = torch.zeros(heads, 128, dtype=torch.int64)
    ev = EvictionPoint("r", 0, 0, 0, point - 1, 0, prefix, point, frontier, point, protected_prefix=prefix)
    rule = KeepRule(make_policy("knorm"), UniformAllocation(), 4, 8)
    recorder = Recorder()
    counts = evict_slots(cache, rule, ev, positions_row, block_row, _inputs_for(dim**-0.5), 3, recorder)

    num_keep = point - frontier
    assert counts == [num_keep] * heads
    norms = keys.norm(dim=-1)  # knorm keeps the lowest norms; sinks and recent always
    for h in range(heads):
        protected = set(range(4)) | set(range(point - 8, point))
        rest = [
            p for p in torch.argsort(norms[h], stable=True).tolist() if p not in protected and p >= prefix
        ]
        expected = sorted({p for p in protected if p >= prefix} | set(rest[: num_keep - len(protected - set(range(prefix)))]))
        assert len(expected) == num_keep
        assert positions_row[h, :num_keep].tolist() == expected
        got_k, got_v = cache.read_slots(block_row, frontier, point)
        assert torch.equal(got_k[h], keys[h, expected]) and torch.equal(got_v[h], values[h, expected])
        prefix_k, prefix_v = cache.read_slots(block_row, 0, prefix)
        assert torch.equal(prefix_k[h], keys[h, :prefix]) and torch.equal(prefix_v[h], values[h, :prefix])
    (released,) = recorder.released_memory
    assert torch.equal(released.freed_blocks, block_row[prefix // bs : frontier // bs]) and released.layer == 3


@pytest.mark.parametrize("prefix", [0, 16])
@pytest.mark.parametrize("allocation", [UniformAllocation(), AdaKVAllocation(0.2)])
@pytest.mark.parametrize("covariance", ["full", "diagonal", "none"])
@pytest.mark.parametrize("seed", range(3))
def test_head_pages_compaction_against_brute_force(allocation, covariance: str, seed: int, prefix: int) -> None:
    """With a protected prefix (two blocks here) only the tokens after it are
    chosen from, folded or freed; its blocks are left as they are."""
    gen = torch.Generator().manual_seed(seed)
    heads, bs, dim, point, frontier = 3, 8, 16, 96, 48
    cache, block_row, keys, values = _request(gen, 20, heads, bs, dim, point)
    moments = EvictedMoments.zeros(None, heads, dim, covariance=covariance)
    rows = StreamRows(
        positions=torch.zeros(heads, 256, dtype=torch.int64),
        pages=torch.zeros(heads, 32, dtype=torch.int32),
        lens=torch.zeros(heads, dtype=torch.int32),
        moments=moments,
    )
    ev = EvictionPoint(
        "r", 0, 0, 0, point - 1, 0, prefix, point, frontier, point, compacts=True, protected_prefix=prefix
    )
    # Scale the heads' norms apart so AdaKV gives them different counts.
    spread = torch.tensor([0.5, 1.0, 2.0])[:, None, None]
    cache.keys.mul_(spread.view(1, heads, 1, 1))
    keys = keys * spread
    rule = KeepRule(make_policy("knorm"), allocation, 4, 8)
    recorder = Recorder()
    counts = compact_head_pages(
        cache, rule, ev, rows, block_row, _inputs_for(dim**-0.5), 0, recorder
    )

    total_pages = heads * (point // bs - frontier // bs)
    assert sum(-(-c // bs) for c in counts) <= total_pages
    assert rows.lens.tolist() == counts
    if isinstance(allocation, UniformAllocation):
        assert counts == [point - frontier] * heads
    else:
        assert len(set(counts)) > 1
    scores = -keys.norm(dim=-1)
    for h, count in enumerate(counts):
        protected = {p for p in set(range(4)) | set(range(point - 8, point)) if p >= prefix}
        rest = [
            p for p in torch.argsort(-scores[h], stable=True).tolist() if p not in protected and p >= prefix
        ]
        kept = sorted(protected | set(rest[: count - len(protected)]))
        assert rows.positions[h, :count].tolist() == kept
        got_k, got_v = cache.read_pages(rows.pages[h], count)
        assert torch.equal(got_k, keys[h, kept]) and torch.equal(got_v, values[h, kept])
        prefix_k, prefix_v = cache.read_slots(block_row, 0, prefix)
        assert torch.equal(prefix_k[h], keys[h, :prefix]) and torch.equal(prefix_v[h], values[h, :prefix])
        dropped = sorted(set(range(prefix, point)) - set(kept))
        k, v = keys[h, dropped].double(), values[h, dropped].double()
        assert float(moments.count[h]) == len(dropped)
        if not dropped:  # a head AdaKV let keep everything
            assert not moments.key_mean[h].any() and not moments.cross_cov[h].any()
            continue
        torch.testing.assert_close(moments.key_mean[h].double(), k.mean(0), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(moments.value_mean[h].double(), v.mean(0), rtol=1e-5, atol=1e-5)
        cross = (v - v.mean(0)).T @ (k - k.mean(0))
        expected = {"full": cross, "diagonal": cross.diagonal(), "none": cross.new_zeros(0)}[covariance]
        torch.testing.assert_close(moments.cross_cov[h].double(), expected, rtol=1e-4, atol=1e-4)
    (released,) = recorder.released_memory
    used = sum(-(-c // bs) for c in counts)
    assert released.unused_pages.numel() == total_pages - used
    assert torch.equal(released.freed_blocks, block_row[prefix // bs : frontier // bs])
    assert released.partial_blocks == [] and released.layer == 0
