"""`kvevict eval` without a server: settings, resumable records, summaries,
tables and plots, checked against values computed here by hand."""

from __future__ import annotations

import csv
import io
import random

import numpy as np
import pytest

from vllm_kvevict.evaluation.quality import Completion, kl_divergence
from vllm_kvevict.evaluation.ruler import RulerSample
from vllm_kvevict.evaluation.settings import FULL, parse_setting
from vllm_kvevict.evaluation.ruler_eval import (
    EvalRunner,
    RecordLog,
    SampleRecord,
    markdown_tables,
    plot_accuracy_vs_kept,
    plot_needle_grid,
    prompt_sha,
    results_csv,
    signature,
    summarize,
)

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_the_budget_is_checked_per_length_before_any_server() -> None:
    runner = EvalRunner.__new__(EvalRunner)  # only run_one's check is exercised
    runner.log = RecordLog.__new__(RecordLog)
    runner.log.records = {}
    runner.server_args = ""
    sample = RulerSample("niah_single_2", 0, "p", ["1"], 1000, 128, "string_match_all")
    with pytest.raises(ValueError, match="at 1024 tokens: budget 0 tokens is refused"):
        runner.run_one(parse_setting("snapkv@0.01"), 1024, [sample])


def record(setting: str, task: str, index: int, score: float, **kw) -> SampleRecord:
    defaults = dict(signature="s", length=4096, prompt_tokens=4000, prediction=str(score))
    defaults.update(kw)
    return SampleRecord(setting=setting, task=task, index=index, score=score, **defaults)


def test_record_log_resumes_and_drops_stale_settings_and_prompts(tmp_path) -> None:
    log = RecordLog(tmp_path / "samples.jsonl")
    log.add(record("a", "vt", 0, 100.0, signature="old", prompt_sha="p0"))
    log.add(record("a", "vt", 1, 0.0, signature="old", prompt_sha="p1"))
    log.add(record("a", "vt", 0, 50.0, signature="new", prompt_sha="p0"))  # rerun of one sample
    again = RecordLog(tmp_path / "samples.jsonl")
    assert again.get(("a", 4096, "vt", 0), "new", "p0").score == 50.0
    assert again.get(("a", 4096, "vt", 0), "new", "other seed") is None
    assert again.get(("a", 4096, "vt", 1), "new", "p1") is None  # stale: other signature
    assert again.get(("a", 4096, "vt", 1), "old", "p1").score == 0.0


def test_prompt_hash_changes_with_the_prompt_and_the_request() -> None:
    sample = RulerSample("vt", 0, "prompt", ["x"], 100, 30, "string_match_all")
    other = RulerSample("vt", 0, "prompt!", ["x"], 100, 30, "string_match_all")
    base = prompt_sha(sample, 64, 20)
    assert base == prompt_sha(sample, 30, 20) == prompt_sha(sample, 128, 20)  # capped at 30 either way
    assert len({base, prompt_sha(other, 64, 20), prompt_sha(sample, 16, 20), prompt_sha(sample, 64, -1)}) == 4


def test_signature_changes_with_anything_that_changes_the_server() -> None:
    setting = parse_setting("snapkv@0.5")
    base = signature(setting, {"policy": "snapkv", "budget": 512}, "--dtype float32")
    assert base == signature(setting, {"budget": 512, "policy": "snapkv"}, "--dtype float32")
    assert base != signature(setting, {"policy": "snapkv", "budget": 544}, "--dtype float32")
    assert base != signature(setting, {"policy": "snapkv", "budget": 512}, "--dtype bfloat16")


def test_summary_means_kl_fractions_and_grid_match_hand_computation() -> None:
    rng = random.Random()
    settings = [parse_setting("full"), parse_setting("snapkv@0.5")]
    records, expected = [], {}
    for name in ("full", "snapkv@0.5"):
        task_means = []
        for task in ("vt", "cwe", "niah_single_2"):
            scores = [rng.choice([0.0, 25.0, 50.0, 100.0]) for _ in range(3)]
            task_means.append(sum(scores) / 3)
            for index, score in enumerate(scores):
                records.append(record(name, task, index, score, prompt_tokens=4000 + 10 * index,
                                      budget=None if name == FULL else 2016,
                                      kl_positions=0 if name == FULL else 2, kl_sum=0.0 if name == FULL else 0.1 * index))
        for depth in (0.0, 50.0):
            records.append(record(name, f"needle@{depth:g}", 0, 100.0 if depth else 0.0, prompt_tokens=3900))
        expected[name] = sum(task_means) / 3
    summaries = summarize(records, settings)
    by_name = {s.setting: s for s in summaries}
    for name, mean in expected.items():
        assert by_name[name].mean_score == pytest.approx(mean)
        assert by_name[name].grid_scores == {0.0: 0.0, 50.0: 100.0}
    assert by_name["full"].fraction is None and by_name["full"].mean_kl is None
    assert by_name["snapkv@0.5"].fraction == pytest.approx(2016 / 4010)  # grid prompts excluded
    assert by_name["snapkv@0.5"].mean_kl == pytest.approx((0.0 + 0.1 + 0.2) * 3 / 18)

    tasks = ["niah_single_2", "vt", "cwe"]
    table = markdown_tables(summaries, tasks)
    assert f"| {expected['full']:.1f} |" in table and "| snapkv@0.5 | 4096 | 50% |" in table
    assert "| 0% | 50% |" in table  # grid columns
    rows = list(csv.DictReader(io.StringIO(results_csv(summaries, tasks))))
    assert [r["setting"] for r in rows] == ["full", "snapkv@0.5"]
    assert float(rows[1]["mean_score"]) == pytest.approx(expected["snapkv@0.5"], abs=0.01)
    assert float(rows[0]["needle@50"]) == 100.0 and rows[0]["mean_kl"] == ""


def test_plots_are_written(tmp_path) -> None:
    pytest.importorskip("matplotlib")
    settings = [parse_setting(s) for s in ("full", "snapkv@0.5", "snapkv@0.2", "tova@0.5")]
    records = []
    for setting in settings:
        for length in (1024, 2048):
            records.append(record(setting.name, "vt", 0, 50.0, length=length,
                                  budget=None if setting.fraction is None else int(setting.fraction * 4000)))
            for depth in (0, 50, 100):
                records.append(record(setting.name, f"needle@{depth}", 0, float(depth), length=length))
    summaries = summarize(records, settings)
    plot_accuracy_vs_kept(summaries, tmp_path / "a.png")
    plot_needle_grid(summaries, tmp_path / "g.png")
    for name in ("a.png", "g.png"):
        assert (tmp_path / name).read_bytes()[:8] == PNG_MAGIC


def test_kl_against_the_saved_full_cache_distributions(tmp_path) -> None:
    """A setting's KL uses the full cache's saved distributions up to the first
    token where the greedy paths part."""
    runner = EvalRunner.__new__(EvalRunner)
    runner.out_dir = tmp_path
    runner.log = RecordLog(tmp_path / "samples.jsonl")
    runner.max_new_tokens, runner.logprobs = 64, 20
    sample = RulerSample("vt", 3, "p", ["x"], 100, 30, "string_match_all")
    rng = np.random.default_rng()
    vocab = 50

    def log_softmax(x: np.ndarray) -> np.ndarray:
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    full_lp = log_softmax(rng.normal(size=(4, vocab))).astype(np.float32)
    policy_lp = log_softmax(rng.normal(size=(4, vocab))).astype(np.float32)
    full = Completion("a", [1, 2, 3, 4], 0.1, full_lp)
    assert runner._compare(parse_setting("full"), 1024, sample, full) == (0, 0.0)
    runner.log.add(SampleRecord(FULL, "s", 1024, "vt", 3, 100, "a", 0.0, [1, 2, 3, 4],
                                prompt_sha=prompt_sha(sample, 64, 20)))
    policy = Completion("b", [1, 2, 9, 4], 0.1, policy_lp)  # parts at position 2
    positions, total = runner._compare(parse_setting("snapkv@0.5"), 1024, sample, policy)
    assert positions == 3  # positions 0, 1, 2 condition on the same text
    expected = sum(kl_divergence(full_lp[i], policy_lp[i]) for i in range(3))
    assert total == pytest.approx(expected, rel=1e-6)
    # A full-cache record of another prompt (another seed) is no reference.
    runner.max_new_tokens = 16
    assert runner._compare(parse_setting("snapkv@0.5"), 1024, sample, policy) == (0, 0.0)
    p = np.exp(full_lp[0].astype(np.float64))
    assert kl_divergence(full_lp[0], policy_lp[0]) == pytest.approx(
        float(np.sum(p * (full_lp[0] - policy_lp[0]))), rel=1e-5)
