"""`kvevict eval`: what an eviction setting costs on long-context tasks, through
the real serving path.

RULER tasks are generated offline (``ruler.py``) at each requested length with
the served model's tokenizer, plus a needle depth x length grid, and sent as
greedy completions to OpenAI-compatible endpoints: servers given by URL (any
`vllm serve`, with or without ``--kv-eviction``), or servers this tool starts
itself, one per setting and length, for ``full`` and ``POLICY@FRACTION``
settings. Predictions are scored with RULER's own metrics. When a ``full``
setting is present, every other setting's next-token distributions are compared
with it (KL, see ``quality.py``).

Every score is a mean over samples (20 per task, 3 per grid cell by default)
with its 95% percentile-bootstrap interval (``stats.py``). ``--compare A B``
gives A - B on the samples both settings answered, paired by sample, per task
and over tasks, with its paired bootstrap interval and whether it excludes 0.

Every finished sample is appended to ``OUT/samples.jsonl`` at once, keyed by
setting, length and sample, with the setting's exact server configuration, so
an interrupted run resumes where it stopped and a changed setting is rerun;
``--report-only`` rebuilds the outputs (and comparisons) from that file alone.
Outputs: ``results.csv``, ``results.md`` (task table, needle grid,
comparisons), ``comparisons.csv``, ``accuracy_vs_kept.png`` and
``needle_grid.png``.

    kvevict eval --setting full --setting snapkv@0.5 --setting momentkv@0.5 --lengths 4096
    kvevict eval --setting mine=http://gpu-host:8000 --lengths 4096,8192 --tokenizer MODEL
    kvevict eval --setting snapkv@0.5 --kv-eviction-config '{"prefill_mode": "per_chunk"}'
    kvevict eval --out kvevict-eval --report-only --compare snapkv@0.5 full --compare momentkv@0.5 snapkv@0.5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import shlex
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import openai
import requests

from vllm_kvevict.evaluation.client import openai_client
from vllm_kvevict.evaluation.quality import KL_POSITIONS, Completion, compare_to_full, parse_completion
from vllm_kvevict.evaluation.records import RecordLog, SampleRecord, prompt_sha
from vllm_kvevict.evaluation.ruler import DEFAULT_TASKS, RulerSample
from vllm_kvevict.evaluation.server import scrape_metrics, served_model
from vllm_kvevict.evaluation.settings import (
    add_kv_eviction_config_argument,
    DEFAULT_BLOCK_SIZE,
    FULL,
    ServingSetting,
    eviction_config,
    flag_value,
    parse_setting,
    check_running_servers,
    parse_settings,
    pyplot,
)
from vllm_kvevict.evaluation.stats import (
    Interval,
    bootstrap_mean_interval,
    paired_difference_interval,
    stratified_bootstrap,
)

# CPU defaults for the servers this tool starts (fp32, chunked prefill of 512);
# --server-args replaces them (e.g. for a GPU).
DEFAULT_SERVER_ARGS = (
    "--dtype float32 --block-size 32 --max-num-batched-tokens 512 --max-num-seqs 4 "
    "--enforce-eager --kv-cache-memory-bytes 1500000000"
)
DEFAULT_SETTINGS = (FULL, "snapkv@0.5", "snapkv@0.2")
GRID_TASK_PREFIX = "needle@"
SAMPLES_PER_TASK = 20
GRID_SAMPLES = 3  # per needle depth x length cell


# ---------------------------------------------------------------- records


def signature(setting: ServingSetting, eviction: dict[str, Any] | None, server_args: str) -> str:
    payload = {"url": setting.url, "eviction": eviction, "server_args": server_args if setting.managed else None}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------- requests


def complete(api: openai.OpenAI, model: str, sample: RulerSample, max_new_tokens: int, logprobs: int,
             vocab_size: int) -> Completion:
    """One greedy completion with the first positions' log-distributions.

    ``logprobs`` k > 0: the top-k at every position, one request. -1: the whole
    vocabulary, asked in a second request of KL_POSITIONS tokens only, because
    whole-vocabulary logprobs at every position of a 128-token answer is a
    ~150 MB response (greedy decoding makes both requests' first tokens equal).
    """
    def post(max_tokens: int, k: int) -> dict[str, Any]:
        try:
            reply = api.completions.create(
                model=model, prompt=sample.prompt, temperature=0, max_tokens=max_tokens, logprobs=k,
                extra_body={"return_tokens_as_token_ids": True},
            )
        except openai.APIStatusError as exc:
            raise RuntimeError(f"{api.base_url} answered {exc.status_code} for {sample.task}/{sample.index}: "
                               f"{exc.response.text[:500]}") from None
        return reply.choices[0].to_dict()

    start = time.perf_counter()
    max_tokens = min(sample.tokens_to_generate, max_new_tokens)
    choice = post(max_tokens, max(logprobs, 0))
    seconds = time.perf_counter() - start
    completion = parse_completion(choice, vocab_size, seconds)
    if logprobs < 0:
        head = parse_completion(post(min(KL_POSITIONS, max_tokens), -1), vocab_size, seconds)
        completion.logprobs = head.logprobs
        if head.token_ids != completion.token_ids[:len(head.token_ids)]:
            # Not the same greedy path (batch-dependent numerics): compare no further.
            parted = next((i for i, (a, b) in enumerate(zip(head.token_ids, completion.token_ids))
                           if a != b), len(completion.token_ids))
            completion.logprobs = head.logprobs[:parted + 1]
    return completion


def mean_tokens_kept(url: str) -> float | None:
    """Mean tokens a (layer, KV head) kept after an eviction, from the server's histogram."""
    values = scrape_metrics(url)
    count = values.get("kvevict_head_retained_tokens_count")
    return values["kvevict_head_retained_tokens_sum"] / count if count else None


# ---------------------------------------------------------------- runner


class EvalRunner:
    """Serves (or reaches) each setting at each length and records every sample."""

    def __init__(self, out_dir: Path, tokenizer: Any, *, model: str | None = None,
                 server_args: str = DEFAULT_SERVER_ARGS, max_new_tokens: int = 128,
                 logprobs: int = 20, concurrency: int = 2, progress: bool = True,
                 block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        self.out_dir = out_dir
        self.tokenizer = tokenizer
        self.model = model
        self.server_args = server_args
        self.max_new_tokens = max_new_tokens
        self.logprobs = logprobs
        self.concurrency = concurrency
        self.progress = progress
        self.block_size = block_size
        out_dir.mkdir(parents=True, exist_ok=True)
        self.log = RecordLog(out_dir / "samples.jsonl")
        self.vocab_size = len(tokenizer)

    def _prompt_sha(self, sample: RulerSample) -> str:
        return prompt_sha(sample, self.max_new_tokens, self.logprobs)

    def reference_path(self, length: int, sample: RulerSample) -> Path:
        return self.out_dir / "full_logprobs" / str(length) / f"{sample.task}__{sample.index}.npy"

    def run(self, settings: list[ServingSetting], samples_by_length: dict[int, list[RulerSample]]) -> list[SampleRecord]:
        """Every (setting, length, sample), the full cache first; returns all records."""
        ordered = sorted(settings, key=lambda s: s.name != FULL)
        for setting in ordered:
            for length, samples in samples_by_length.items():
                self.run_one(setting, length, samples)
        wanted = {(s.name, length, x.task, x.index)
                  for s in settings for length, xs in samples_by_length.items() for x in xs}
        return [r for key, r in self.log.records.items() if key in wanted]

    def run_one(self, setting: ServingSetting, length: int, samples: list[RulerSample]) -> None:
        mean_prompt = sum(s.prompt_tokens for s in samples) / len(samples)
        eviction = eviction_config(setting, mean_prompt, self.block_size,
                                   context=f"setting {setting.name} at {length} tokens")
        sig = signature(setting, eviction, self.server_args)
        todo = [s for s in samples if self.log.get(
            (setting.name, length, s.task, s.index), sig, self._prompt_sha(s)) is None]
        if not todo:
            return
        if setting.managed:
            from vllm_kvevict.evaluation.server import VllmServer

            if self.model is None:
                raise ValueError(f"setting {setting.name} needs a model to serve (--model)")
            work = self.out_dir / "servers" / f"{setting.name}_{length}".replace("/", "_")
            work.mkdir(parents=True, exist_ok=True)
            args = shlex.split(self.server_args) + ["--max-model-len", str(length + self.max_new_tokens + 64)]
            args += ["--max-logprobs", str(self.logprobs if self.logprobs < 0 else max(20, self.logprobs))]
            if eviction is not None:
                args += ["--kv-eviction", eviction["policy"], "--kv-eviction-config", json.dumps(eviction)]
            server = VllmServer(self.model, args, stats_path=work / "stats.json", log_path=work / "server.log")
            try:
                server.wait_ready()
                self._send(setting, sig, length, todo, server.url, eviction is not None,
                           None if eviction is None else eviction["budget"])
            finally:
                server.stop()
        else:
            self._send(setting, sig, length, todo, setting.url, measure_kept=True)

    def _send(self, setting: ServingSetting, sig: str, length: int, samples: list[RulerSample],
              url: str, measure_kept: bool, budget: int | None = None) -> None:
        from tqdm import tqdm

        model, _ = served_model(url)
        api = openai_client(url, timeout=3600)
        logprobs = self.logprobs if setting.managed or self.logprobs > 0 else 20
        bar = tqdm(total=len(samples), desc=f"{setting.name} @ {length}", unit="sample",
                   disable=not self.progress, dynamic_ncols=True)

        def one(sample: RulerSample) -> SampleRecord:
            completion = complete(api, model, sample, self.max_new_tokens, logprobs, self.vocab_size)
            positions, kl_sum = self._compare(setting, length, sample, completion)
            kept = None
            if measure_kept:
                try:
                    kept = mean_tokens_kept(url)
                except (KeyError, requests.RequestException):
                    kept = None
            record = SampleRecord(
                setting.name, sig, length, sample.task, sample.index, sample.prompt_tokens,
                completion.text, sample.score(completion.text), completion.token_ids,
                positions, kl_sum, completion.seconds, budget, self._prompt_sha(sample), kept,
                list(sample.answers),
            )
            self.log.add(record)
            bar.update()
            return record

        try:
            with ThreadPoolExecutor(self.concurrency) as pool:
                list(pool.map(one, samples))
        finally:
            bar.close()
            api.close()

    def _compare(self, setting: ServingSetting, length: int, sample: RulerSample,
                 completion: Completion) -> tuple[int, float]:
        """Save the full cache's distributions; compare any other setting with them."""
        path = self.reference_path(length, sample)
        if setting.name == FULL:
            path.parent.mkdir(parents=True, exist_ok=True)
            np.save(path, completion.logprobs)
            return 0, 0.0
        reference = self.log.records.get((FULL, length, sample.task, sample.index))
        if reference is None or reference.prompt_sha != self._prompt_sha(sample) or not path.exists():
            return 0, 0.0
        full = Completion(reference.prediction, reference.token_ids, reference.seconds, np.load(path))
        return compare_to_full(full, completion)


# ---------------------------------------------------------------- summaries


@dataclass
class SettingSummary:
    """Scores of one setting at one length (task samples and grid cells apart),
    each a mean over samples with its bootstrap interval (``stats.py``)."""

    setting: str
    length: int
    fraction: float | None
    task_intervals: dict[str, Interval]
    grid_intervals: dict[float, Interval]  # needle depth (%) -> score
    mean_kl: float | None
    tokens_kept: float | None
    samples: int
    mean_interval: Interval | None = None  # RULER's mean over tasks, resampled within each task
    grid_mean_interval: Interval | None = None  # the grid's mean over depths, the same way

    @property
    def task_scores(self) -> dict[str, float]:
        return {task: i.mean for task, i in self.task_intervals.items()}

    @property
    def grid_scores(self) -> dict[float, float]:
        return {depth: i.mean for depth, i in self.grid_intervals.items()}

    @property
    def mean_score(self) -> float:
        """RULER's average: the mean over tasks of each task's mean."""
        return self.mean_interval.mean if self.mean_interval is not None else math.nan


def summarize(records: Iterable[SampleRecord], settings: list[ServingSetting] | list[str]) -> list[SettingSummary]:
    """Per (setting, length, in the order of ``settings``): task means, grid
    cells, their intervals, mean KL, and the kept fraction = budget / mean
    prompt tokens of the task samples."""
    groups: dict[tuple[str, int], list[SampleRecord]] = defaultdict(list)
    for record in records:
        groups[(record.setting, record.length)].append(record)
    order = {getattr(s, "name", s): i for i, s in enumerate(settings)}
    summaries = []
    for (name, length), group in sorted(groups.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 0))):
        by_task: dict[str, list[float]] = defaultdict(list)
        by_depth: dict[float, list[float]] = defaultdict(list)
        for record in sorted(group, key=lambda r: (r.task, r.index)):  # not the order they finished in
            if record.task.startswith(GRID_TASK_PREFIX):
                by_depth[float(record.task.removeprefix(GRID_TASK_PREFIX))].append(record.score)
            else:
                by_task[record.task].append(record.score)
        positions = sum(r.kl_positions for r in group)
        kept = [r.tokens_kept for r in group if r.tokens_kept is not None]
        budgets = [r.budget for r in group if r.budget is not None]
        prompts = [r.prompt_tokens for r in group if not r.task.startswith(GRID_TASK_PREFIX)] or [
            r.prompt_tokens for r in group]
        summaries.append(SettingSummary(
            name, length, budgets[0] / float(np.mean(prompts)) if budgets else None,
            {t: bootstrap_mean_interval(v) for t, v in by_task.items()},
            {d: bootstrap_mean_interval(v) for d, v in sorted(by_depth.items())},
            sum(r.kl_sum for r in group) / positions if positions else None,
            kept[-1] if kept else None,
            len(group),
            stratified_bootstrap(by_task) if by_task else None,
            stratified_bootstrap(by_depth) if by_depth else None,
        ))
    return summaries


SCORE_LEGEND = ("Scores in %: mean [95% bootstrap interval] over samples (2000 resamples, seed 0; "
                "a mean over tasks or depths resamples within each).")


def markdown_tables(summaries: list[SettingSummary], tasks: list[str]) -> str:
    """The task table (scores in % with their intervals, RULER's mean, KL from
    the full cache, tokens kept) and the needle grid (setting x length rows,
    depth columns)."""
    lines = [
        SCORE_LEGEND, "",
        "| setting | length | kept | samples | " + " | ".join(tasks) + " | mean | KL vs full | tokens kept |",
        "|---|---|---|---|" + "---|" * len(tasks) + "---|---|---|",
    ]
    for s in summaries:
        if not s.task_intervals:
            continue
        kept = f"{s.fraction:.0%}" if s.fraction is not None else "100%" if s.setting == FULL else "-"
        lines.append(
            f"| {s.setting} | {s.length} | {kept} | {sum(i.n for i in s.task_intervals.values())} | "
            + " | ".join(s.task_intervals[t].format() if t in s.task_intervals else "-" for t in tasks)
            + f" | {s.mean_interval.format(1)} | {'-' if s.mean_kl is None else f'{s.mean_kl:.4f}'}"
            + f" | {'-' if s.tokens_kept is None else f'{s.tokens_kept:.0f}'} |"
        )
    depths = sorted({d for s in summaries for d in s.grid_intervals})
    if depths:
        lines += ["", "Needle depth x length (score %, one needle per prompt at the given depth):", "",
                  "| setting | length | samples | " + " | ".join(f"{d:g}%" for d in depths) + " | mean |",
                  "|---|---|---|" + "---|" * len(depths) + "---|"]
        for s in summaries:
            if s.grid_intervals:
                counts = sorted({i.n for i in s.grid_intervals.values()})
                per_cell = f"{counts[0]}" if len(counts) == 1 else f"{counts[0]}-{counts[-1]}"
                lines.append(f"| {s.setting} | {s.length} | {per_cell} per cell | "
                             + " | ".join(s.grid_intervals[d].format() if d in s.grid_intervals else "-"
                                          for d in depths)
                             + f" | {s.grid_mean_interval.format()} |")
    return "\n".join(lines)


def _number(value: float | None, digits: int) -> str:
    return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


def _interval_columns(interval: Interval | None, digits: int = 2) -> list[str]:
    if interval is None:
        return ["", "", ""]
    return [_number(interval.mean, digits), _number(interval.low, digits), _number(interval.high, digits)]


def results_csv(summaries: list[SettingSummary], tasks: list[str]) -> str:
    """One row per (setting, length); every score with its interval (NAME,
    NAME_low, NAME_high)."""
    depths = sorted({d for s in summaries for d in s.grid_intervals})

    def triple(name: str) -> list[str]:
        return [name, f"{name}_low", f"{name}_high"]

    header = ["setting", "length", "fraction", *(c for t in tasks for c in triple(t)), *triple("mean_score"),
              "mean_kl", "tokens_kept", *(c for d in depths for c in triple(f"needle@{d:g}")),
              *triple("needle_mean"), "samples"]
    rows = [",".join(header)]
    for s in summaries:
        rows.append(",".join([
            s.setting, str(s.length), _number(s.fraction, 3),
            *(c for t in tasks for c in _interval_columns(s.task_intervals.get(t))),
            *_interval_columns(s.mean_interval), _number(s.mean_kl, 6), _number(s.tokens_kept, 1),
            *(c for d in depths for c in _interval_columns(s.grid_intervals.get(d))),
            *_interval_columns(s.grid_mean_interval), str(s.samples),
        ]))
    return "\n".join(rows) + "\n"


# ---------------------------------------------------------------- paired comparison


@dataclass
class ComparisonRow:
    """A - B on the samples both settings have: one task, RULER's mean over
    tasks, or the needle grid, at one length (``None``: all lengths)."""

    a: str
    b: str
    length: int | None
    row: str  # a task, MEAN_ROW or GRID_ROW
    mean_a: float
    mean_b: float
    difference: Interval  # paired bootstrap interval of mean(A) - mean(B)


MEAN_ROW = "mean"
GRID_ROW = "needle grid"


def _stratified_mean(scores: dict[tuple, float], stratum: Any) -> float:
    groups: dict[Any, list[float]] = defaultdict(list)
    for key, score in scores.items():
        groups[stratum(key)].append(score)
    return float(np.mean([np.mean(v) for v in groups.values()]))


def compare(records: Iterable[SampleRecord], a: str, b: str, tasks: list[str] | None = None) -> list[ComparisonRow]:
    """Setting ``a`` minus setting ``b`` on the samples both have, matched by
    (length, task, index, prompt hash): the same prompt, so the same seed, per
    task, for RULER's mean over tasks (stratified by task), and for the needle
    grid (stratified by depth), at each length, then over all lengths when
    there are several (stratified by length and task or depth)."""
    scores: dict[str, dict[tuple, float]] = {a: {}, b: {}}
    for record in records:
        if record.setting in scores:
            scores[record.setting][(record.length, record.task, record.index, record.prompt_sha)] = record.score
    for name in (a, b):
        if not scores[name]:
            raise ValueError(f"no samples of setting {name!r} to compare")
    common = scores[a].keys() & scores[b].keys()
    if not common:
        raise ValueError(f"settings {a!r} and {b!r} have no sample in common: compare runs of the same "
                         "lengths, tasks, seed, prompt format and --max-new-tokens")
    known = list(tasks or [])
    order = {t: i for i, t in enumerate(known)}

    def row(length: int | None, name: str, keys: list[tuple], stratum: Any = None) -> ComparisonRow:
        pa = {k: scores[a][k] for k in keys}
        pb = {k: scores[b][k] for k in keys}
        means = ((_stratified_mean(pa, stratum), _stratified_mean(pb, stratum)) if stratum
                 else (float(np.mean(list(pa.values()))), float(np.mean(list(pb.values())))))
        return ComparisonRow(a, b, length, name, *means, paired_difference_interval(pa, pb, strata=stratum))

    rows: list[ComparisonRow] = []
    lengths = sorted({k[0] for k in common})
    for length in lengths + ([None] if len(lengths) > 1 else []):
        keys = sorted(k for k in common if length is None or k[0] == length)
        task_keys = [k for k in keys if not k[1].startswith(GRID_TASK_PREFIX)]
        grid_keys = [k for k in keys if k[1].startswith(GRID_TASK_PREFIX)]
        if length is not None:
            for task in sorted({k[1] for k in task_keys}, key=lambda t: (order.get(t, len(order)), t)):
                rows.append(row(length, task, [k for k in task_keys if k[1] == task]))
        if task_keys:
            rows.append(row(length, MEAN_ROW, task_keys, lambda k: (k[0], k[1])))
        if grid_keys:
            rows.append(row(length, GRID_ROW, grid_keys, lambda k: (k[0], k[1])))
    return rows


def comparison_table(rows: list[ComparisonRow], only_a: int = 0, only_b: int = 0) -> str:
    """One comparison as Markdown: per row, the pairs, each setting's mean on
    them, A - B with its 95% paired bootstrap interval, and whether the
    interval excludes 0."""
    a, b = rows[0].a, rows[0].b
    pairs = sum(r.difference.n for r in rows if r.length is not None and r.row in (MEAN_ROW, GRID_ROW))
    unmatched = f"; left out: {only_a} samples only {a}'s, {only_b} only {b}'s" if only_a or only_b else ""
    lines = [(f"{a} - {b}: {pairs} paired samples{unmatched}. Score points, A - B [95% paired "
              "bootstrap interval] (a mean over tasks or depths resamples within each)."), "",
             f"| length | task | pairs | {a} | {b} | A - B [95%] | excludes 0 |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {'all' if r.length is None else r.length} | {r.row} | {r.difference.n} | "
                     f"{r.mean_a:.1f} | {r.mean_b:.1f} | {r.difference.format(1, sign=True)} | "
                     f"{'yes' if r.difference.excludes_zero else 'no'} |")
    return "\n".join(lines)


def comparisons_csv(rows: list[ComparisonRow]) -> str:
    lines = ["a,b,length,task,pairs,mean_a,mean_b,difference,difference_low,difference_high,excludes_zero"]
    for r in rows:
        lines.append(",".join([r.a, r.b, "all" if r.length is None else str(r.length), r.row,
                               str(r.difference.n), f"{r.mean_a:.2f}", f"{r.mean_b:.2f}",
                               *_interval_columns(r.difference), str(r.difference.excludes_zero).lower()]))
    return "\n".join(lines) + "\n"


def unmatched_counts(records: Iterable[SampleRecord], a: str, b: str) -> tuple[int, int]:
    """Samples of ``a`` that ``b`` lacks, and of ``b`` that ``a`` lacks."""
    keys: dict[str, set] = {a: set(), b: set()}
    for r in records:
        if r.setting in keys:
            keys[r.setting].add((r.length, r.task, r.index, r.prompt_sha))
    return len(keys[a] - keys[b]), len(keys[b] - keys[a])


def plot_accuracy_vs_kept(summaries: list[SettingSummary], path: Path) -> None:
    """Mean RULER score against the kept fraction, one line per policy with
    its 95% intervals as error bars, one panel per length; the full cache is
    the point at 100% and a dashed line with its interval shaded."""
    plt = pyplot()
    lengths = sorted({s.length for s in summaries if s.task_intervals})
    fig, axes = plt.subplots(1, max(1, len(lengths)), figsize=(5.5 * max(1, len(lengths)), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        rows = [s for s in summaries if s.length == length and s.task_intervals]
        lines: dict[str, list[tuple[float, Interval]]] = defaultdict(list)
        full = [s.mean_interval for s in rows if s.fraction is None and s.setting == FULL]
        for s in rows:
            if s.fraction is not None:
                lines[s.setting.rsplit("@", 1)[0]].append((s.fraction, s.mean_interval))
            elif s.setting != FULL:
                ax.axhline(s.mean_score, linestyle=":", color="grey")
                ax.annotate(s.setting, (0.02, s.mean_score), fontsize=8)
        for policy, points in sorted(lines.items(), key=lambda kv: kv[0]):
            points = sorted(points, key=lambda p: p[0]) + ([(1.0, full[0])] if full else [])
            means = [p[1].mean for p in points]
            errors = [[m - p[1].low for m, p in zip(means, points)], [p[1].high - m for m, p in zip(means, points)]]
            ax.errorbar([p[0] * 100 for p in points], means, yerr=errors, marker="o", capsize=3, label=policy)
        if full:
            ax.axhline(full[0].mean, linestyle="--", color="black", label="full cache")
            ax.axhspan(full[0].low, full[0].high, color="black", alpha=0.08)
        ax.set_title(f"RULER at {length} tokens")
        ax.set_xlabel("KV kept (% of the prompt)")
        ax.set_ylabel("mean score (%)")
        ax.set_ylim(-2, 102)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_needle_grid(summaries: list[SettingSummary], path: Path) -> None:
    """One heat map per setting: needle depth (x) by context length (y), score colour."""
    plt = pyplot()
    names = list(dict.fromkeys(s.setting for s in summaries if s.grid_scores))
    if not names:
        return
    depths = sorted({d for s in summaries for d in s.grid_scores})
    lengths = sorted({s.length for s in summaries if s.grid_scores})
    columns = min(3, len(names))
    rows = -(-len(names) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.6 * columns, 0.5 * len(lengths) + 2.6 * rows),
                             squeeze=False, constrained_layout=True)
    image = None
    for ax, name in zip(axes.flat, names):
        grid = np.full((len(lengths), len(depths)), np.nan)
        for s in summaries:
            if s.setting == name:
                for d, score in s.grid_scores.items():
                    grid[lengths.index(s.length), depths.index(d)] = score
        image = ax.imshow(grid, vmin=0, vmax=100, cmap="RdYlGn", aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [f"{d:g}" for d in depths])
        ax.set_yticks(range(len(lengths)), [str(n) for n in lengths])
        ax.set_xlabel("needle depth (%)")
        ax.set_ylabel("context length")
        ax.set_title(name)
        for (i, j), value in np.ndenumerate(grid):
            if not np.isnan(value):
                ax.text(j, i, f"{value:.0f}", ha="center", va="center", fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.axis("off")
    if image is not None:
        fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="score (%)")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(out_dir: Path, summaries: list[SettingSummary], tasks: list[str],
                  comparisons: list[str] = (), comparison_rows: list[ComparisonRow] = ()) -> str:
    """results.md (the tables, then each comparison), results.csv, the plots,
    and comparisons.csv when settings were compared; returns the Markdown."""
    table = "\n\n".join([markdown_tables(summaries, tasks), *comparisons])
    (out_dir / "results.md").write_text(table + "\n")
    (out_dir / "results.csv").write_text(results_csv(summaries, tasks))
    if comparison_rows:
        (out_dir / "comparisons.csv").write_text(comparisons_csv(list(comparison_rows)))
    plot_accuracy_vs_kept(summaries, out_dir / "accuracy_vs_kept.png")
    plot_needle_grid(summaries, out_dir / "needle_grid.png")
    return table


# ---------------------------------------------------------------- command


def build_samples(tokenizer: Any, lengths: list[int], tasks: list[str], per_task: int, seed: int,
                  prompt_format: str, grid_depths: list[float], grid_lengths: list[int],
                  grid_samples: int = GRID_SAMPLES) -> dict[int, list[RulerSample]]:
    """Per length: ``per_task`` samples of each task, and ``grid_samples``
    needles at each grid depth (needle ``i`` is the same at every depth and
    length: only its position and the haystack change)."""
    from vllm_kvevict.evaluation.ruler import RulerGenerator

    by_length: dict[int, list[RulerSample]] = {}
    for length in sorted(set(lengths) | set(grid_lengths)):
        generator = RulerGenerator(tokenizer, length, seed, prompt_format)
        samples = generator.samples(tasks, per_task) if length in lengths else []
        if length in grid_lengths:
            samples += [generator.needle_at_depth(depth, index)
                        for depth in grid_depths for index in range(grid_samples)]
        by_length[length] = samples
    return by_length


def ordered_tasks(records: Iterable[SampleRecord]) -> list[str]:
    """The tasks in records, RULER's default order first (grid needles apart)."""
    found = {r.task for r in records if not r.task.startswith(GRID_TASK_PREFIX)}
    return [t for t in DEFAULT_TASKS if t in found] + sorted(found - set(DEFAULT_TASKS))


def report(out_dir: Path, records: list[SampleRecord], names: list[str], tasks: list[str],
           pairs: list[tuple[str, str]]) -> str:
    """Summaries, tables, plots and the paired comparisons of ``records``."""
    summaries = summarize(records, names)
    comparisons, comparison_rows = [], []
    for a, b in pairs:
        rows = compare(records, a, b, tasks)
        comparisons.append(comparison_table(rows, *unmatched_counts(records, a, b)))
        comparison_rows += rows
    return write_outputs(out_dir, summaries, tasks, comparisons, comparison_rows)


def _number_list(kind: type) -> Any:
    """An argparse type: comma-separated numbers of ``kind`` ('' for none)."""
    def parse(text: str) -> list:
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: expected comma-separated {'integers' if kind is int else 'numbers'}, "
                "e.g. 4096,8192") from None
    parse.__name__ = f"comma-separated {kind.__name__} list"
    return parse


def build_parser() -> argparse.ArgumentParser:
    from vllm_kvevict.help_format import HelpFormatter

    parser = argparse.ArgumentParser(
        prog="kvevict eval", description=__doc__.split("\n\n")[0],
        formatter_class=HelpFormatter, epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--setting", action="append", default=[], metavar="SPEC",
                        help="'full', 'CONFIG@FRACTION' (a policy, a shipped config such as "
                        "momentkv or adakv_snapkv, or a .yaml/.json config path, kept at FRACTION "
                        "of the mean prompt; the tool serves it), 'CONFIG@TOKENS' (a fixed budget) "
                        "or 'NAME=URL' (a running OpenAI-compatible server); CONFIG+agnostic@F "
                        "(--engine reference): the context evicted before the question is read; repeatable "
                        f"(default: {' '.join(DEFAULT_SETTINGS)})")
    add_kv_eviction_config_argument(parser)
    parser.add_argument("--model", default=None,
                        help="model the tool serves for its own settings (default: the embedded SmolLM2)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for prompt lengths (default: the served model's)")
    parser.add_argument("--lengths", type=_number_list(int), default="4096", metavar="N[,N...]",
                        help="target prompt lengths (tokens)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated RULER tasks")
    parser.add_argument("--samples-per-task", type=int, default=SAMPLES_PER_TASK,
                        help="samples of each task at each length")
    parser.add_argument("--grid-depths", type=_number_list(float), default="0,25,50,75,100",
                        metavar="D[,D...]", help="needle depths (%%) of the depth x length grid; '' for none")
    parser.add_argument("--grid-lengths", type=_number_list(int), default=None, metavar="N[,N...]",
                        help="lengths of the grid (default: the eval lengths)")
    parser.add_argument("--grid-samples", type=int, default=GRID_SAMPLES,
                        help="needles per depth x length cell of the grid")
    parser.add_argument("--seed", type=int, default=42, help="seed of the generated samples")
    parser.add_argument("--prompt-format", choices=["base", "chat"], default="base",
                        help="base: RULER's plain template; chat: the tokenizer's chat template")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="cap on RULER's tokens_to_generate per task")
    parser.add_argument("--logprobs", type=int, default=20,
                        help="distributions for the KL: top-k (20 is vLLM's default cap; the KL "
                        "over the top-k plus one tail bucket is a lower bound), or -1: the whole "
                        "vocabulary (exact; servers the tool starts allow it, a second short "
                        "request per sample)")
    parser.add_argument("--engine", choices=["serve", "reference"], default="serve",
                        help="serve: each setting through `vllm serve`; reference: decoded in this "
                        "process by the reference decoder, one full-cache prefill per sample shared by "
                        "every end_of_prompt setting, a prefill of its own for the others (for "
                        "policy studies; see reference_eval.py)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight per server")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                        help="vllm serve flags for the servers the tool starts, as one string (they "
                        "replace the CPU defaults; e.g. for a GPU: --server-args \"--dtype bfloat16\"; "
                        "one flag alone: --server-args=--enforce-eager)")
    parser.add_argument("--compare", nargs=2, action="append", default=[], metavar=("A", "B"),
                        help="setting A minus setting B on the samples both have (paired by sample), "
                        "per task and over tasks, with a 95%% paired bootstrap interval; repeatable")
    parser.add_argument("--report-only", action="store_true",
                        help="serve nothing: tables, plots and --compare from OUT/samples.jsonl as it "
                        "stands (every setting, length and task in it, or only the --setting names)")
    parser.add_argument("--out", type=Path, default=Path("kvevict-eval"),
                        help="output folder (samples.jsonl, results, plots)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for flag in ("samples_per_task", "grid_samples", "max_new_tokens", "concurrency"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} must be at least 1")
    if args.logprobs == 0 or args.logprobs < -1:
        parser.error("--logprobs: give a top-k of at least 1, or -1 for the whole vocabulary")
    for a, b in args.compare:
        if a == b:
            parser.error(f"--compare {a} {b}: compare two different settings")

    if args.report_only:
        return report_only(parser, args)

    try:
        server_args = shlex.split(args.server_args)
    except ValueError as exc:
        parser.error(f"--server-args: {exc}; quote it as one shell string")
    block_size = int(flag_value(server_args, "--block-size") or DEFAULT_BLOCK_SIZE)
    settings = parse_settings(parser, args.setting or list(DEFAULT_SETTINGS), args.kv_eviction_config,
                              block_size, served=args.engine == "serve")
    names = [s.name for s in settings]
    for name in {n for pair in args.compare for n in pair} - set(names):
        parser.error(f"--compare {name}: not a setting of this run ({', '.join(names)})")
    lengths = args.lengths
    if not lengths or min(lengths) < 1:
        parser.error("--lengths: give one or more prompt lengths in tokens, e.g. 4096")
    grid_depths = args.grid_depths
    if any(not 0 <= d <= 100 for d in grid_depths):
        parser.error("--grid-depths: needle depths are percentages of the context, 0 to 100")
    grid_lengths = args.grid_lengths if args.grid_lengths else (lengths if grid_depths else [])
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    from vllm_kvevict.evaluation.ruler import task_configs

    try:
        known = list(task_configs())
    except ImportError as exc:
        parser.error(str(exc))
    unknown = [t for t in tasks if t not in known]
    if unknown or not (tasks or grid_depths):
        parser.error(f"--tasks: unknown {', '.join(unknown) or '(none given)'}; "
                     f"choose from {', '.join(known)}")

    if args.engine == "reference":
        from vllm_kvevict.evaluation.reference_eval import check_settings

        try:
            check_settings(settings)
        except ValueError as exc:
            parser.error(str(exc))
    check_running_servers(parser, settings)
    model = args.model
    if model is not None and not Path(model).is_dir():
        parser.error(f"--model {model}: no such folder; give a local model folder "
                     "(`kvevict fetch-model` converts the default one)")
    if model is None and any(s.managed for s in settings):
        from vllm_kvevict.default_model import fetch_default_model

        model = str(fetch_default_model())
    tokenizer_source = args.tokenizer or model
    if tokenizer_source is None:
        _, tokenizer_source = served_model(settings[0].url)
        if not tokenizer_source:
            parser.error("the server does not name its model's path: pass --tokenizer")
    from vllm_kvevict.evaluation.ruler import load_tokenizer

    try:
        tokenizer = load_tokenizer(tokenizer_source)
    except (OSError, ValueError) as exc:
        parser.error(f"cannot load the tokenizer {tokenizer_source!r} ({exc}); pass --tokenizer "
                     "with a local copy of the served model's tokenizer")
    start = time.perf_counter()
    try:
        samples = build_samples(tokenizer, lengths, tasks, args.samples_per_task, args.seed,
                                args.prompt_format, grid_depths, grid_lengths, args.grid_samples)
    except ValueError as exc:
        parser.error(f"cannot generate the samples: {exc}; give longer --lengths")
    for length, group in samples.items():
        tokens = [s.prompt_tokens for s in group]
        print(f"{length}: {len(group)} samples, prompt tokens {min(tokens)}..{max(tokens)} "
              f"(generated in {time.perf_counter() - start:.0f}s)", flush=True)
    # Every budget at every length checked before any server starts.
    for setting in settings:
        for length, group in samples.items():
            mean_prompt = sum(s.prompt_tokens for s in group) / len(group)
            try:
                eviction_config(setting, mean_prompt, block_size,
                                context=f"setting {setting.name} at {length} tokens")
            except ValueError as exc:
                parser.error(str(exc))
    if args.engine == "reference":
        from vllm_kvevict.evaluation.reference_eval import ReferenceEvalRunner

        runner = ReferenceEvalRunner(args.out, tokenizer, model, max_new_tokens=args.max_new_tokens,
                                     progress=not args.no_progress)
    else:
        runner = EvalRunner(args.out, tokenizer, model=model, server_args=args.server_args,
                            max_new_tokens=args.max_new_tokens, logprobs=args.logprobs,
                            concurrency=args.concurrency, progress=not args.no_progress,
                            block_size=block_size)
    records = runner.run(settings, samples)
    table = report(args.out, records, names, tasks, [tuple(pair) for pair in args.compare])
    grid = f", {args.grid_samples} per grid cell" if grid_depths else ""
    print(f"\n{args.samples_per_task} samples per task{grid}, {args.prompt_format} prompts, seed {args.seed}; "
          "KL(full || setting) in nats over the first generated positions on the full cache's greedy path\n")
    print(table)
    print(f"\nwritten to {args.out}/ (results.csv, results.md, samples.jsonl, plots) in "
          f"{time.perf_counter() - start:.0f}s", flush=True)
    return 0


def report_only(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    """``--report-only``: the outputs of a finished or interrupted run, from its
    samples.jsonl (the latest record of each sample), without serving."""
    path = args.out / "samples.jsonl"
    if not path.exists():
        parser.error(f"--report-only: no {path}; point --out at a run's folder, or run "
                     "without --report-only first")
    records = list(RecordLog(path).records.values())
    found = list(dict.fromkeys(r.setting for r in records))
    # A name as the run recorded it (a config path's stem, say) is taken as is.
    try:
        wanted = [s if s in found else parse_setting(s).name for s in args.setting] or found
    except ValueError as exc:
        parser.error(str(exc))
    missing = [n for n in dict.fromkeys([*wanted, *(n for pair in args.compare for n in pair)]) if n not in found]
    if missing:
        parser.error(f"--report-only: no samples of {', '.join(missing)} in {path} "
                     f"(settings there: {', '.join(found) or 'none'})")
    names = wanted + [n for pair in args.compare for n in pair if n not in wanted]
    records = [r for r in records if r.setting in names]
    table = report(args.out, records, names, ordered_tasks(records), [tuple(pair) for pair in args.compare])
    print(f"{len(records)} samples from {path}\n")
    print(table)
    print(f"\nwritten to {args.out}/ (results.csv, results.md{', comparisons.csv' if args.compare else ''}, "
          "plots)", flush=True)
    return 0
