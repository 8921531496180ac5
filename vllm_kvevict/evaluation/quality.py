"""Quality of eviction settings through a real `vllm serve`: RULER scores and the
KL divergence of next-token distributions from the full cache.

Every sample is sent as a greedy completion (temperature 0) with logprobs.
The KL is KL(P_full || P_policy) at the first ``KL_POSITIONS`` generated
positions where the policy's greedy tokens so far equal the full cache's (so
both distributions condition on the same text); a sample contributes its
positions up to the first disagreement.

Distributions: the server runs with ``--max-logprobs -1`` and requests ask for
``logprobs=-1`` (the whole vocabulary, 49152 entries for SmolLM2; token ids as
keys via ``return_tokens_as_token_ids``, so tokens that decode to the same
string stay apart), which makes the KL exact. With ``logprobs_k > 0`` only the
top-k of each side are returned; the KL is then taken over the tokens present
in both top-k lists plus one bucket holding the remaining mass of each side,
a coarsening that can only lower the KL (data-processing inequality).

The full cache's outputs go to ``full_cache.json`` and its distributions to
``full_cache_logprobs.npz``, so policies can be added later without rerunning it.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import requests

from vllm_kvevict.evaluation.retrieval import SERVER_ARGS
from vllm_kvevict.evaluation.ruler import RulerSample
from vllm_kvevict.evaluation.server import VllmServer

KL_POSITIONS = 8
TOKEN_ID_PREFIX = "token_id:"


@dataclass
class Completion:
    """One greedy completion: text, generated token ids, and (in memory only) the
    next-token log-distributions of its first positions, NaN where not returned."""

    text: str
    token_ids: list[int]
    seconds: float
    logprobs: np.ndarray | None = field(default=None, repr=False)  # [positions, vocab]


@dataclass
class SampleResult:
    task: str
    index: int
    prompt_tokens: int
    prediction: str
    score: float
    kl_positions: int = 0
    kl_sum: float = 0.0
    seconds: float = 0.0


@dataclass
class SettingResult:
    """A row of the table: one eviction setting over all samples."""

    name: str
    eviction: dict[str, Any] | None
    fraction: float | None
    samples: list[SampleResult]
    mean_tokens_kept: float | None
    wall_seconds: float

    def task_scores(self) -> dict[str, float]:
        by_task: dict[str, list[float]] = {}
        for sample in self.samples:
            by_task.setdefault(sample.task, []).append(sample.score)
        return {task: sum(scores) / len(scores) for task, scores in by_task.items()}

    def mean_score(self) -> float:
        scores = self.task_scores()
        return sum(scores.values()) / len(scores)

    def mean_kl(self) -> float | None:
        """Mean over every compared position of every sample (None for the full cache)."""
        positions = sum(s.kl_positions for s in self.samples)
        return sum(s.kl_sum for s in self.samples) / positions if positions else None

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "task_scores": self.task_scores(), "mean_score": self.mean_score(),
                "mean_kl": self.mean_kl()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> SettingResult:
        samples = [SampleResult(**s) for s in data["samples"]]
        return cls(data["name"], data["eviction"], data["fraction"], samples,
                   data["mean_tokens_kept"], data["wall_seconds"])


def sample_key(sample: RulerSample) -> str:
    return f"{sample.task}/{sample.index}"


def server_args(eviction: dict[str, Any] | None) -> list[str]:
    """The retrieval benchmarks' server flags, full-vocabulary logprobs, and the setting."""
    args = [*SERVER_ARGS, "--max-logprobs", "-1"]
    if eviction is not None:
        args += ["--kv-eviction", eviction["policy"], "--kv-eviction-config", json.dumps(eviction)]
    return args


def parse_completion(choice: dict[str, Any], vocab_size: int, seconds: float) -> Completion:
    """Token ids and the first KL_POSITIONS log-distributions of one API choice."""
    logprobs = choice.get("logprobs") or {}
    token_ids = [int(t.removeprefix(TOKEN_ID_PREFIX)) for t in logprobs.get("tokens") or []]
    tops = (logprobs.get("top_logprobs") or [])[:KL_POSITIONS]
    dense = np.full((len(tops), vocab_size), np.nan, dtype=np.float32)
    for position, top in enumerate(tops):
        ids = np.fromiter((int(k.removeprefix(TOKEN_ID_PREFIX)) for k in top), dtype=np.int64, count=len(top))
        values = np.fromiter(top.values(), dtype=np.float64, count=len(top))
        keep = ids < vocab_size
        dense[position, ids[keep]] = values[keep]
    return Completion(choice["text"], token_ids, seconds, dense)


def kl_divergence(full: np.ndarray, policy: np.ndarray) -> float:
    """KL(P_full || P_policy) between two log-distributions over the vocabulary.

    Tokens known on one side only (top-k mode) fall into one tail bucket per
    side; with the whole vocabulary the bucket is empty and this is exact.
    """
    known = ~np.isnan(full) & ~np.isnan(policy)
    log_p = full[known].astype(np.float64)
    log_q = policy[known].astype(np.float64)
    p = np.exp(log_p)
    kl = float(np.sum(p * (log_p - log_q)))
    p_tail = max(0.0, 1.0 - float(p.sum()))
    q_tail = max(0.0, 1.0 - float(np.exp(log_q).sum()))
    if p_tail > 1e-6:
        kl += p_tail * (math.log(p_tail) - math.log(max(q_tail, 1e-12)))
    return max(kl, 0.0)


def compare_to_full(full: Completion, policy: Completion) -> tuple[int, float]:
    """(positions compared, summed KL) over the shared greedy prefix."""
    assert full.logprobs is not None and policy.logprobs is not None
    positions = min(len(full.logprobs), len(policy.logprobs))
    total, compared = 0.0, 0
    for position in range(positions):
        if full.token_ids[:position] != policy.token_ids[:position]:
            break
        total += kl_divergence(full.logprobs[position], policy.logprobs[position])
        compared += 1
    return compared, total


class QualityRunner:
    """Serves each setting once, sends every sample, scores and compares with the full cache."""

    def __init__(
        self, model: str, samples: list[RulerSample], out_dir: Path, vocab_size: int,
        max_new_tokens: int = 48, logprobs_k: int = -1, concurrency: int = 2,
    ) -> None:
        self.model = model
        self.samples = samples
        self.out_dir = out_dir
        self.vocab_size = vocab_size
        self.max_new_tokens = max_new_tokens
        self.logprobs_k = logprobs_k
        self.concurrency = concurrency
        out_dir.mkdir(parents=True, exist_ok=True)
        self.results_path = out_dir / "results.json"
        self.full_path = out_dir / "full_cache.json"
        self.full_logprobs_path = out_dir / "full_cache_logprobs.npz"

    # ------------------------------------------------------------ requests

    def complete(self, url: str, sample: RulerSample) -> Completion:
        start = time.perf_counter()
        reply = requests.post(url + "/v1/completions", timeout=3600, json={
            "model": "smollm2", "prompt": sample.prompt, "temperature": 0,
            "max_tokens": min(sample.tokens_to_generate, self.max_new_tokens),
            "logprobs": self.logprobs_k, "return_tokens_as_token_ids": True,
        })
        reply.raise_for_status()
        return parse_completion(reply.json()["choices"][0], self.vocab_size, time.perf_counter() - start)

    def serve(self, eviction: dict[str, Any] | None, work: Path) -> tuple[list[Completion], float | None]:
        """Completions for every sample, and the mean tokens a (layer, KV head) kept
        after an eviction (None when nothing was evicted)."""
        work.mkdir(parents=True, exist_ok=True)
        server = VllmServer(self.model, server_args(eviction), stats_path=work / "stats.json",
                            log_path=work / "server.log")
        try:
            server.wait_ready()
            with ThreadPoolExecutor(self.concurrency) as pool:
                completions = list(pool.map(lambda s: self.complete(server.url, s), self.samples))
            kept = None
            if eviction is not None:
                try:
                    count = server.metric("kvevict_head_retained_tokens_count")
                    kept = server.metric("kvevict_head_retained_tokens_sum") / count if count else None
                except KeyError:
                    kept = None
            return completions, kept
        finally:
            server.stop()

    # ------------------------------------------------------------ full cache

    def full_cache(self) -> tuple[dict[str, Completion], SettingResult]:
        """The full cache's completions, from the cache files when they cover the samples."""
        keys = [sample_key(s) for s in self.samples]
        if self.full_path.exists() and self.full_logprobs_path.exists():
            cached = json.loads(self.full_path.read_text())
            if all(k in cached["completions"] for k in keys) and cached["prompts"] == {
                sample_key(s): s.prompt for s in self.samples if sample_key(s) in cached["prompts"]
            }:
                arrays = np.load(self.full_logprobs_path)
                completions = {
                    k: Completion(c["text"], c["token_ids"], c["seconds"], arrays[k.replace("/", "__")])
                    for k, c in cached["completions"].items() if k in keys
                }
                result = SettingResult.from_json(cached["result"])
                result.samples = [r for r in result.samples if f"{r.task}/{r.index}" in completions]
                return completions, result
        start = time.perf_counter()
        outputs, _ = self.serve(None, self.out_dir / "work" / "full")
        completions = dict(zip(keys, outputs))
        result = SettingResult(
            "full cache", None, None,
            [SampleResult(s.task, s.index, s.prompt_tokens, c.text, s.score(c.text), seconds=c.seconds)
             for s, c in zip(self.samples, outputs)],
            sum(s.prompt_tokens for s in self.samples) / len(self.samples),
            time.perf_counter() - start,
        )
        self.full_path.write_text(json.dumps({
            "prompts": {sample_key(s): s.prompt for s in self.samples},
            "answers": {sample_key(s): s.answers for s in self.samples},
            "completions": {k: {"text": c.text, "token_ids": c.token_ids, "seconds": c.seconds}
                            for k, c in completions.items()},
            "result": result.to_json(),
        }, indent=1))
        np.savez(self.full_logprobs_path,
                 **{k.replace("/", "__"): c.logprobs for k, c in completions.items()})
        return completions, result

    # ------------------------------------------------------------ settings

    def load_results(self) -> dict[str, SettingResult]:
        if not self.results_path.exists():
            return {}
        return {r["name"]: SettingResult.from_json(r) for r in json.loads(self.results_path.read_text())}

    def save_results(self, results: dict[str, SettingResult]) -> None:
        self.results_path.write_text(json.dumps([r.to_json() for r in results.values()], indent=1))

    def run(self, settings: list[tuple[str, float, dict[str, Any]]]) -> list[SettingResult]:
        """The full-cache row and one row per (name, kept fraction, eviction config);
        settings already in results.json are not rerun."""
        full, full_result = self.full_cache()
        results = self.load_results()
        rows = [full_result]
        for name, fraction, eviction in settings:
            done = results.get(name)
            if done is not None and done.eviction == eviction and [
                (r.task, r.index, r.prompt_tokens) for r in done.samples
            ] == [(s.task, s.index, s.prompt_tokens) for s in self.samples]:
                rows.append(done)
                continue
            start = time.perf_counter()
            outputs, kept = self.serve(eviction, self.out_dir / "work" / name.replace(" ", "_"))
            samples = []
            for sample, completion in zip(self.samples, outputs):
                positions, kl_sum = compare_to_full(full[sample_key(sample)], completion)
                samples.append(SampleResult(
                    sample.task, sample.index, sample.prompt_tokens, completion.text,
                    sample.score(completion.text), positions, kl_sum, completion.seconds,
                ))
            results[name] = SettingResult(name, eviction, fraction, samples, kept,
                                          time.perf_counter() - start)
            self.save_results(results)
            rows.append(results[name])
            print(json.dumps({"setting": name, "mean_score": results[name].mean_score(),
                              "mean_kl": results[name].mean_kl()}), flush=True)
        return rows


def markdown_table(rows: list[SettingResult], tasks: list[str]) -> str:
    """Rows = settings; columns = each task's score (%), mean score, mean KL, tokens kept."""
    lines = [
        "| setting | kept | " + " | ".join(tasks) + " | mean score | mean KL | mean tokens kept |",
        "|---|---|" + "---|" * len(tasks) + "---|---|---|",
    ]
    for row in rows:
        scores = row.task_scores()
        kl = row.mean_kl()
        kept = f"{row.mean_tokens_kept:.0f}" if row.mean_tokens_kept is not None else "-"
        fraction = "100%" if row.fraction is None else f"{row.fraction:.0%}"
        lines.append(
            f"| {row.name} | {fraction} | "
            + " | ".join(f"{scores[t]:.0f}" if t in scores else "-" for t in tasks)
            + f" | {row.mean_score():.1f} | {'-' if kl is None else f'{kl:.4f}'} | {kept} |"
        )
    return "\n".join(lines)


def results_csv(rows: list[SettingResult], tasks: list[str]) -> str:
    header = ["setting", "fraction", *tasks, "mean_score", "mean_kl", "mean_tokens_kept", "seconds"]
    lines = [",".join(header)]
    for row in rows:
        scores = row.task_scores()
        values = [row.name, "" if row.fraction is None else f"{row.fraction}",
                  *(f"{scores.get(t, float('nan')):.2f}" for t in tasks), f"{row.mean_score():.2f}",
                  "" if row.mean_kl() is None else f"{row.mean_kl():.6f}",
                  "" if row.mean_tokens_kept is None else f"{row.mean_tokens_kept:.1f}",
                  f"{row.wall_seconds:.0f}"]
        lines.append(",".join(f'"{v}"' if "," in v else v for v in values))
    return "\n".join(lines) + "\n"
