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

Every finished sample is appended to ``OUT/samples.jsonl`` at once, keyed by
setting, length and sample, with the setting's exact server configuration, so
an interrupted run resumes where it stopped and a changed setting is rerun.
Outputs: ``results.csv``, ``results.md`` (task table, needle grid),
``accuracy_vs_kept.png`` and ``needle_grid.png``.

    kvevict eval --setting full --setting snapkv@0.5 --setting momentkv@0.5 --lengths 4096
    kvevict eval --endpoint mine=http://gpu-host:8000 --lengths 4096,8192 --tokenizer MODEL
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import threading
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import requests

from vllm_kvevict.evaluation.quality import KL_POSITIONS, Completion, compare_to_full, parse_completion
from vllm_kvevict.evaluation.ruler import DEFAULT_TASKS, RulerSample
from vllm_kvevict.evaluation.server import scrape_metrics, served_model
from vllm_kvevict.evaluation.settings import FULL, ServingSetting, eviction_config, parse_setting, pyplot

# CPU defaults for the servers this tool starts (fp32, chunked prefill of 512);
# --server-args replaces them (e.g. for a GPU).
DEFAULT_SERVER_ARGS = (
    "--dtype float32 --block-size 32 --max-num-batched-tokens 512 --max-num-seqs 4 "
    "--enforce-eager --kv-cache-memory-bytes 1500000000"
)
GRID_TASK_PREFIX = "needle@"


# ---------------------------------------------------------------- records


@dataclass
class SampleRecord:
    """One scored completion; a line of samples.jsonl."""

    setting: str
    signature: str  # what the setting's server was; a record with another is stale
    length: int
    task: str
    index: int
    prompt_tokens: int
    prediction: str
    score: float
    token_ids: list[int] = field(default_factory=list)
    kl_positions: int = 0
    kl_sum: float = 0.0
    seconds: float = 0.0
    budget: int | None = None  # tokens per (layer, KV head); None: no eviction or unknown
    prompt_sha: str = ""  # the prompt and request it answers (another seed: another prompt)
    tokens_kept: float | None = None  # mean tokens a (layer, KV head) held, this server

    @property
    def key(self) -> tuple[str, int, str, int]:
        return (self.setting, self.length, self.task, self.index)


def prompt_sha(sample: RulerSample, max_tokens: int, logprobs: int) -> str:
    text = json.dumps([sample.prompt, min(sample.tokens_to_generate, max_tokens), logprobs])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def signature(setting: ServingSetting, eviction: dict[str, Any] | None, server_args: str) -> str:
    payload = {"url": setting.url, "eviction": eviction, "server_args": server_args if setting.managed else None}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


class RecordLog:
    """samples.jsonl: appended line by line (thread-safe), read back on resume."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.records: dict[tuple[str, int, str, int], SampleRecord] = {}
        if path.exists():
            for line in path.read_text().splitlines():
                if line.strip():
                    record = SampleRecord(**json.loads(line))
                    self.records[record.key] = record  # the last line of a key wins

    def get(self, key: tuple[str, int, str, int], signature: str, prompt_sha: str) -> SampleRecord | None:
        record = self.records.get(key)
        fresh = record is not None and record.signature == signature and record.prompt_sha == prompt_sha
        return record if fresh else None

    def add(self, record: SampleRecord) -> None:
        with self.lock:
            self.records[record.key] = record
            with self.path.open("a") as handle:
                handle.write(json.dumps(asdict(record)) + "\n")


# ---------------------------------------------------------------- requests


def complete(url: str, model: str, sample: RulerSample, max_new_tokens: int, logprobs: int,
             vocab_size: int) -> Completion:
    """One greedy completion with the first positions' log-distributions.

    ``logprobs`` k > 0: the top-k at every position, one request. -1: the whole
    vocabulary, asked in a second request of KL_POSITIONS tokens only, because
    whole-vocabulary logprobs at every position of a 128-token answer is a
    ~150 MB response (greedy decoding makes both requests' first tokens equal).
    """
    def post(max_tokens: int, k: int) -> dict[str, Any]:
        reply = requests.post(url + "/v1/completions", timeout=3600, json={
            "model": model, "prompt": sample.prompt, "temperature": 0, "max_tokens": max_tokens,
            "logprobs": k, "return_tokens_as_token_ids": True,
        })
        if reply.status_code != 200:
            raise RuntimeError(f"{url} answered {reply.status_code} for {sample.task}/{sample.index}: "
                               f"{reply.text[:500]}")
        return reply.json()["choices"][0]

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
                 logprobs: int = 20, concurrency: int = 2, progress: bool = True) -> None:
        self.out_dir = out_dir
        self.tokenizer = tokenizer
        self.model = model
        self.server_args = server_args
        self.max_new_tokens = max_new_tokens
        self.logprobs = logprobs
        self.concurrency = concurrency
        self.progress = progress
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
        eviction = eviction_config(setting, mean_prompt, context=f"setting {setting.name} at {length} tokens")
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
            args = self.server_args.split() + ["--max-model-len", str(length + self.max_new_tokens + 64)]
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
        logprobs = self.logprobs if setting.managed or self.logprobs > 0 else 20
        bar = tqdm(total=len(samples), desc=f"{setting.name} @ {length}", unit="sample",
                   disable=not self.progress, dynamic_ncols=True)

        def one(sample: RulerSample) -> SampleRecord:
            completion = complete(url, model, sample, self.max_new_tokens, logprobs, self.vocab_size)
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
            )
            self.log.add(record)
            bar.update()
            return record

        try:
            with ThreadPoolExecutor(self.concurrency) as pool:
                list(pool.map(one, samples))
        finally:
            bar.close()

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
    """Scores of one setting at one length (task samples and grid cells apart)."""

    setting: str
    length: int
    fraction: float | None
    task_scores: dict[str, float]
    grid_scores: dict[float, float]  # needle depth (%) -> score
    mean_kl: float | None
    tokens_kept: float | None
    samples: int

    @property
    def mean_score(self) -> float:
        """RULER's average: the mean over tasks of each task's mean."""
        return sum(self.task_scores.values()) / len(self.task_scores) if self.task_scores else math.nan


def summarize(records: Iterable[SampleRecord], settings: list[ServingSetting]) -> list[SettingSummary]:
    """Per (setting, length): task means, grid cells, mean KL, and the kept
    fraction = budget / mean prompt tokens of the task samples."""
    groups: dict[tuple[str, int], list[SampleRecord]] = defaultdict(list)
    for record in records:
        groups[(record.setting, record.length)].append(record)
    order = {s.name: i for i, s in enumerate(settings)}
    summaries = []
    for (name, length), group in sorted(groups.items(), key=lambda kv: (kv[0][1], order.get(kv[0][0], 0))):
        by_task: dict[str, list[float]] = defaultdict(list)
        by_depth: dict[float, list[float]] = defaultdict(list)
        for record in group:
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
            {t: float(np.mean(v)) for t, v in by_task.items()},
            {d: float(np.mean(v)) for d, v in sorted(by_depth.items())},
            sum(r.kl_sum for r in group) / positions if positions else None,
            kept[-1] if kept else None,
            len(group),
        ))
    return summaries


def markdown_tables(summaries: list[SettingSummary], tasks: list[str]) -> str:
    """The task table (scores in %, RULER's mean, KL from the full cache, tokens
    kept) and the needle grid (setting x length rows, depth columns)."""
    lines = [
        "| setting | length | kept | " + " | ".join(tasks) + " | mean | KL vs full | tokens kept |",
        "|---|---|---|" + "---|" * len(tasks) + "---|---|---|",
    ]
    for s in summaries:
        if not s.task_scores:
            continue
        kept = f"{s.fraction:.0%}" if s.fraction is not None else "100%" if s.setting == FULL else "-"
        lines.append(
            f"| {s.setting} | {s.length} | {kept} | "
            + " | ".join(f"{s.task_scores[t]:.0f}" if t in s.task_scores else "-" for t in tasks)
            + f" | {s.mean_score:.1f} | {'-' if s.mean_kl is None else f'{s.mean_kl:.4f}'}"
            + f" | {'-' if s.tokens_kept is None else f'{s.tokens_kept:.0f}'} |"
        )
    depths = sorted({d for s in summaries for d in s.grid_scores})
    if depths:
        lines += ["", "Needle depth x length (score %, single needle at the given depth):", "",
                  "| setting | length | " + " | ".join(f"{d:g}%" for d in depths) + " | mean |",
                  "|---|---|" + "---|" * len(depths) + "---|"]
        for s in summaries:
            if s.grid_scores:
                lines.append(f"| {s.setting} | {s.length} | "
                             + " | ".join(f"{s.grid_scores[d]:.0f}" if d in s.grid_scores else "-" for d in depths)
                             + f" | {np.mean(list(s.grid_scores.values())):.0f} |")
    return "\n".join(lines)


def results_csv(summaries: list[SettingSummary], tasks: list[str]) -> str:
    depths = sorted({d for s in summaries for d in s.grid_scores})
    header = ["setting", "length", "fraction", *tasks, "mean_score", "mean_kl", "tokens_kept",
              *(f"needle@{d:g}" for d in depths), "samples"]
    rows = [",".join(header)]

    def number(value: float | None, digits: int) -> str:
        return "" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"

    for s in summaries:
        rows.append(",".join([
            s.setting, str(s.length), number(s.fraction, 3),
            *(number(s.task_scores.get(t), 2) for t in tasks), number(s.mean_score, 2),
            number(s.mean_kl, 6), number(s.tokens_kept, 1),
            *(number(s.grid_scores.get(d), 2) for d in depths), str(s.samples),
        ]))
    return "\n".join(rows) + "\n"


def plot_accuracy_vs_kept(summaries: list[SettingSummary], path: Path) -> None:
    """Mean RULER score against the kept fraction, one line per policy, one panel
    per length; the full cache is the point at 100%."""
    plt = pyplot()
    lengths = sorted({s.length for s in summaries if s.task_scores})
    fig, axes = plt.subplots(1, max(1, len(lengths)), figsize=(5.5 * max(1, len(lengths)), 4), squeeze=False)
    for ax, length in zip(axes[0], lengths):
        rows = [s for s in summaries if s.length == length and s.task_scores]
        lines: dict[str, list[tuple[float, float]]] = defaultdict(list)
        full = [s.mean_score for s in rows if s.fraction is None and s.setting == FULL]
        for s in rows:
            if s.fraction is not None:
                lines[s.setting.rsplit("@", 1)[0]].append((s.fraction, s.mean_score))
            elif s.setting != FULL:
                ax.axhline(s.mean_score, linestyle=":", color="grey")
                ax.annotate(s.setting, (0.02, s.mean_score), fontsize=8)
        for policy, points in sorted(lines.items()):
            points = sorted(points) + ([(1.0, full[0])] if full else [])
            ax.plot([p[0] * 100 for p in points], [p[1] for p in points], marker="o", label=policy)
        if full:
            ax.axhline(full[0], linestyle="--", color="black", label="full cache")
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


def write_outputs(out_dir: Path, summaries: list[SettingSummary], tasks: list[str]) -> str:
    table = markdown_tables(summaries, tasks)
    (out_dir / "results.md").write_text(table + "\n")
    (out_dir / "results.csv").write_text(results_csv(summaries, tasks))
    plot_accuracy_vs_kept(summaries, out_dir / "accuracy_vs_kept.png")
    plot_needle_grid(summaries, out_dir / "needle_grid.png")
    return table


# ---------------------------------------------------------------- command


def build_samples(tokenizer: Any, lengths: list[int], tasks: list[str], per_task: int, seed: int,
                  prompt_format: str, grid_depths: list[float], grid_lengths: list[int]) -> dict[int, list[RulerSample]]:
    from vllm_kvevict.evaluation.ruler import RulerGenerator

    by_length: dict[int, list[RulerSample]] = {}
    for length in sorted(set(lengths) | set(grid_lengths)):
        generator = RulerGenerator(tokenizer, length, seed, prompt_format)
        samples = generator.samples(tasks, per_task) if length in lengths else []
        if length in grid_lengths:
            samples += [generator.needle_at_depth(depth, 0) for depth in grid_depths]
        by_length[length] = samples
    return by_length


def _numbers(text: str, kind: type) -> list:
    return [kind(x) for x in text.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvevict eval", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1],
    )
    parser.add_argument("--setting", action="append", default=[], metavar="SPEC",
                        help="'full', 'CONFIG@FRACTION' (a policy, configs/NAME.yaml or a config "
                        "path, kept at FRACTION of the mean prompt; the tool serves it) or "
                        "'NAME=URL' (a running OpenAI-compatible server); repeatable")
    parser.add_argument("--endpoint", action="append", default=[], metavar="NAME=URL",
                        help="a running server to evaluate (same as --setting NAME=URL)")
    parser.add_argument("--model", default=None,
                        help="model the tool serves for its own settings (default: the embedded SmolLM2)")
    parser.add_argument("--tokenizer", default=None,
                        help="tokenizer for prompt lengths (default: the served model's)")
    parser.add_argument("--lengths", default="4096", help="comma-separated target lengths (tokens)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS), help="comma-separated RULER tasks")
    parser.add_argument("--samples-per-task", type=int, default=2)
    parser.add_argument("--grid-depths", default="0,25,50,75,100",
                        help="needle depths (%%) of the depth x length grid; '' for none")
    parser.add_argument("--grid-lengths", default=None,
                        help="lengths of the grid (default: the eval lengths)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--prompt-format", choices=["base", "chat"], default="base")
    parser.add_argument("--max-new-tokens", type=int, default=128,
                        help="cap on RULER's tokens_to_generate per task")
    parser.add_argument("--logprobs", type=int, default=20,
                        help="distributions for the KL: top-k (20 is vLLM's default cap; the KL "
                        "over the top-k plus one tail bucket is a lower bound), or -1: the whole "
                        "vocabulary (exact; servers the tool starts allow it, a second short "
                        "request per sample)")
    parser.add_argument("--concurrency", type=int, default=2, help="requests in flight per server")
    parser.add_argument("--server-args", default=DEFAULT_SERVER_ARGS,
                        help="vllm serve flags for the servers the tool starts")
    parser.add_argument("--out", type=Path, default=Path("kvevict-eval"))
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)

    settings = [parse_setting(s) for s in [*args.setting, *args.endpoint]] or [
        parse_setting(FULL), parse_setting("snapkv@0.5"), parse_setting("snapkv@0.2")]
    names = [s.name for s in settings]
    if len(set(names)) != len(names):
        parser.error(f"settings must have distinct names: {names}")
    lengths = _numbers(args.lengths, int)
    grid_depths = _numbers(args.grid_depths, float)
    grid_lengths = _numbers(args.grid_lengths, int) if args.grid_lengths else (lengths if grid_depths else [])
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]

    model = args.model
    if model is None and any(s.managed for s in settings):
        from vllm_kvevict.default_model import fetch_default_model

        model = str(fetch_default_model())
    tokenizer_source = args.tokenizer or model
    if tokenizer_source is None:
        _, tokenizer_source = served_model(settings[0].url)
    from vllm_kvevict.evaluation.ruler import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_source)
    start = time.perf_counter()
    samples = build_samples(tokenizer, lengths, tasks, args.samples_per_task, args.seed,
                            args.prompt_format, grid_depths, grid_lengths)
    for length, group in samples.items():
        tokens = [s.prompt_tokens for s in group]
        print(f"{length}: {len(group)} samples, prompt tokens {min(tokens)}..{max(tokens)} "
              f"(generated in {time.perf_counter() - start:.0f}s)", flush=True)
    runner = EvalRunner(args.out, tokenizer, model=model, server_args=args.server_args,
                        max_new_tokens=args.max_new_tokens, logprobs=args.logprobs,
                        concurrency=args.concurrency, progress=not args.no_progress)
    records = runner.run(settings, samples)
    table = write_outputs(args.out, summarize(records, settings), tasks)
    print(f"\n{args.samples_per_task} samples per task, {args.prompt_format} prompts, seed {args.seed}; "
          "scores in %; KL(full || setting) in nats over the first generated positions on the "
          "full cache's greedy path\n")
    print(table)
    print(f"\nwritten to {args.out}/ (results.csv, results.md, samples.jsonl, plots) in "
          f"{time.perf_counter() - start:.0f}s", flush=True)
    return 0
