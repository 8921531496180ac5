"""`kvevict eval` without a server: settings, resumable records, summaries
with their intervals, paired comparisons, the report of a finished run, tables
and plots, checked against values computed here by hand."""

from __future__ import annotations

import csv
import dataclasses
import io
import random

import numpy as np
import pytest

from vllm_kvevict.evaluation.quality import Completion, kl_divergence
from vllm_kvevict.evaluation.records import RecordLog, SampleRecord, prompt_sha
from vllm_kvevict.evaluation.ruler import RulerSample
from vllm_kvevict.evaluation.ruler_eval import (
    GRID_ROW,
    MEAN_ROW,
    EvalRunner,
    build_samples,
    compare,
    comparison_table,
    comparisons_csv,
    main,
    markdown_tables,
    plot_accuracy_vs_kept,
    plot_needle_grid,
    results_csv,
    signature,
    summarize,
    unmatched_counts,
)
from vllm_kvevict.evaluation.settings import FULL, parse_setting
from vllm_kvevict.evaluation.stats import bootstrap_mean_interval, paired_difference_interval, stratified_bootstrap

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_the_budget_is_checked_per_length_before_any_server() -> None:
    runner = EvalRunner.__new__(EvalRunner)  # only run_one's check is exercised
    runner.log = RecordLog.__new__(RecordLog)
    runner.log.records = {}
    runner.server_args = ""
    runner.block_size = 32
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


def test_record_log_keeps_the_expected_answers_and_reads_older_lines(tmp_path) -> None:
    """Each line holds the references its prediction was scored against; a
    line written before they were recorded still resumes (with none)."""
    import json

    log = RecordLog(tmp_path / "samples.jsonl")
    log.add(record("a", "vt", 0, 100.0, prompt_sha="p0", answers=["XKCD", "QWERTY"]))
    line = json.loads((tmp_path / "samples.jsonl").read_text())
    assert line["answers"] == ["XKCD", "QWERTY"]
    older = {k: v for k, v in line.items() if k != "answers"}
    (tmp_path / "samples.jsonl").write_text(json.dumps(older) + "\n")
    assert RecordLog(tmp_path / "samples.jsonl").get(("a", 4096, "vt", 0), "s", "p0").answers == []


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
    full_mean = by_name["full"].mean_interval
    assert f"| {expected['full']:.1f} [{full_mean.low:.1f}, {full_mean.high:.1f}] |" in table
    assert "| snapkv@0.5 | 4096 | 50% | 9 |" in table
    assert "| 0% | 50% |" in table  # grid columns
    assert "| full | 4096 | 1 per cell | 0 [0, 0] | 100 [100, 100] | 50 [50, 50] |" in table
    rows = list(csv.DictReader(io.StringIO(results_csv(summaries, tasks))))
    assert [r["setting"] for r in rows] == ["full", "snapkv@0.5"]
    assert float(rows[1]["mean_score"]) == pytest.approx(expected["snapkv@0.5"], abs=0.01)
    assert float(rows[0]["needle@50"]) == 100.0 and rows[0]["mean_kl"] == ""
    assert float(rows[0]["mean_score_low"]) == pytest.approx(full_mean.low, abs=0.01)
    assert float(rows[0]["needle_mean"]) == 50.0 and float(rows[0]["needle_mean_high"]) == 50.0


def test_every_score_has_its_bootstrap_interval() -> None:
    """A task's interval resamples its samples; RULER's mean resamples within
    each task (stratified); a grid cell resamples its needles."""
    rng = random.Random()
    records, by_task, by_depth = [], {}, {}
    for task in ("vt", "cwe", "qa_1"):
        by_task[task] = [rng.choice([0.0, 100.0, 40.0]) for _ in range(rng.randint(5, 25))]
        records += [record("snapkv@0.5", task, i, score) for i, score in enumerate(by_task[task])]
    for depth in (0, 50, 100):
        by_depth[float(depth)] = [rng.choice([0.0, 100.0]) for _ in range(3)]
        records += [record("snapkv@0.5", f"needle@{depth}", i, v) for i, v in enumerate(by_depth[float(depth)])]
    summary, = summarize(records, ["snapkv@0.5"])
    for task, scores in by_task.items():
        assert summary.task_intervals[task] == bootstrap_mean_interval(scores)
        assert summary.task_scores[task] == pytest.approx(sum(scores) / len(scores))
    assert summary.mean_interval == stratified_bootstrap(by_task)
    assert summary.mean_interval.n == sum(map(len, by_task.values()))
    assert summary.grid_intervals == {d: bootstrap_mean_interval(v) for d, v in by_depth.items()}
    assert summary.grid_mean_interval == stratified_bootstrap(by_depth)
    table = markdown_tables([summary], ["vt", "cwe", "qa_1"])
    assert f"| {summary.task_intervals['vt'].format()} | {summary.task_intervals['cwe'].format()} |" in table
    assert "| snapkv@0.5 | 4096 | 3 per cell |" in table


def paired_records(rng: random.Random) -> tuple[list[SampleRecord], dict]:
    """snapkv@0.5 and full at two lengths, 7 samples of vt and cwe each and a
    grid of two depths x 3 needles; full also has 2 vt samples snapkv lacks, and
    one vt sample of another prompt (another seed), paired with nothing."""
    records, scores = [], {}
    for length in (1024, 4096):
        for task, n in (("vt", 7), ("cwe", 7), ("needle@0", 3), ("needle@100", 3)):
            for index in range(n):
                for name in ("snapkv@0.5", "full"):
                    score = rng.choice([0.0, 50.0, 100.0])
                    scores[(name, length, task, index)] = score
                    records.append(record(name, task, index, score, length=length, prompt_sha=f"p{index}"))
        for index in (7, 8):
            records.append(record("full", "vt", index, 100.0, length=length, prompt_sha=f"p{index}"))
    records.append(record("snapkv@0.5", "vt", 9, 0.0, length=1024, prompt_sha="p9"))
    records.append(record("full", "vt", 9, 100.0, length=1024, prompt_sha="other seed"))
    return records, scores


def test_paired_comparison_per_task_over_tasks_and_over_lengths() -> None:
    records, scores = paired_records(random.Random())
    rows = compare(records, "snapkv@0.5", "full", ["vt", "cwe"])
    by_key = {(r.length, r.row): r for r in rows}
    assert list(by_key) == [(1024, "vt"), (1024, "cwe"), (1024, MEAN_ROW), (1024, GRID_ROW),
                            (4096, "vt"), (4096, "cwe"), (4096, MEAN_ROW), (4096, GRID_ROW),
                            (None, MEAN_ROW), (None, GRID_ROW)]

    def side(name: str, length: int, task: str) -> dict:
        return {(length, task, i): scores[(name, length, task, i)] for i in range(7 if task in ("vt", "cwe") else 3)}

    def task_mean(name: str, length: int, task: str) -> float:
        values = side(name, length, task).values()
        return sum(values) / len(values)

    vt = by_key[(1024, "vt")]
    assert vt.difference.n == 7  # unmatched and other-prompt samples are left out
    assert vt.mean_a == pytest.approx(task_mean("snapkv@0.5", 1024, "vt"))
    assert vt.difference == paired_difference_interval(side("snapkv@0.5", 1024, "vt"), side("full", 1024, "vt"))
    mean = by_key[(4096, MEAN_ROW)]
    assert mean.mean_b == pytest.approx((task_mean("full", 4096, "vt") + task_mean("full", 4096, "cwe")) / 2)
    assert mean.difference.mean == pytest.approx(mean.mean_a - mean.mean_b)
    both = {**side("snapkv@0.5", 4096, "vt"), **side("snapkv@0.5", 4096, "cwe")}
    both_b = {**side("full", 4096, "vt"), **side("full", 4096, "cwe")}
    assert mean.difference == paired_difference_interval(both, both_b, strata=lambda k: k[1])
    overall = by_key[(None, MEAN_ROW)]
    assert overall.difference.n == 28
    assert overall.difference.mean == pytest.approx(sum(
        task_mean("snapkv@0.5", n, t) - task_mean("full", n, t) for n in (1024, 4096) for t in ("vt", "cwe")) / 4)
    grid = by_key[(1024, GRID_ROW)]
    assert grid.difference.n == 6 and grid.mean_a == pytest.approx(
        (task_mean("snapkv@0.5", 1024, "needle@0") + task_mean("snapkv@0.5", 1024, "needle@100")) / 2)

    table = comparison_table(rows, *unmatched_counts(records, "snapkv@0.5", "full"))
    assert table.startswith(
        "snapkv@0.5 - full: 40 paired samples; left out: 1 samples only snapkv@0.5's, 5 only full's.")
    assert f"| 1024 | vt | 7 | {vt.mean_a:.1f} | {vt.mean_b:.1f} | {vt.difference.format(1, sign=True)} | " in table
    assert f"| all | {MEAN_ROW} | 28 |" in table
    excluded = "yes" if overall.difference.excludes_zero else "no"
    assert table.splitlines()[-2].endswith(f"| {excluded} |")
    csv_rows = list(csv.DictReader(io.StringIO(comparisons_csv(rows))))
    assert [(r["length"], r["task"]) for r in csv_rows][-2:] == [("all", MEAN_ROW), ("all", GRID_ROW)]
    assert float(csv_rows[0]["difference_low"]) == pytest.approx(vt.difference.low, abs=0.01)


def test_a_setting_against_itself_differs_by_zero_and_no_shared_samples_is_an_error() -> None:
    records, _ = paired_records(random.Random())
    twin = [SampleRecord(**{**r.__dict__, "setting": "twin"}) for r in records if r.setting == "full"]
    for row in compare(records + twin, "full", "twin"):
        assert (row.difference.mean, row.difference.low, row.difference.high) == (0.0, 0.0, 0.0)
        assert not row.difference.excludes_zero
    other_seed = [SampleRecord(**{**r.__dict__, "setting": "seed7", "prompt_sha": "x" + r.prompt_sha})
                  for r in records if r.setting == "full"]
    with pytest.raises(ValueError, match="no sample in common"):
        compare(records + other_seed, "full", "seed7")
    with pytest.raises(ValueError, match="no samples of setting 'absent'"):
        compare(records, "full", "absent")


def test_report_only_compares_a_finished_run_without_serving(tmp_path, monkeypatch, capsys) -> None:
    import vllm_kvevict.default_model
    import vllm_kvevict.evaluation.ruler
    import vllm_kvevict.evaluation.server

    def refuse(*args, **kwargs):
        raise AssertionError("--report-only must not load a model, a tokenizer or a server")
    for module, name in ((vllm_kvevict.default_model, "fetch_default_model"),
                         (vllm_kvevict.evaluation.ruler, "load_tokenizer"),
                         (vllm_kvevict.evaluation.server, "VllmServer")):
        monkeypatch.setattr(module, name, refuse)
    records, _ = paired_records(random.Random())
    log = RecordLog(tmp_path / "samples.jsonl")
    for r in records:
        log.add(r)
    argv = ["--out", str(tmp_path), "--report-only", "--no-progress"]
    assert main([*argv, "--compare", "snapkv@0.5", "full"]) == 0
    printed = capsys.readouterr().out
    rows = compare(records, "snapkv@0.5", "full", ["vt", "cwe"])
    assert comparison_table(rows, 1, 5) in printed
    assert "| snapkv@0.5 | 1024 | 50% |" not in printed  # no budget in these records: kept "-"
    assert "| full | 4096 | 100% | 16 |" in printed
    assert comparison_table(rows, 1, 5) in (tmp_path / "results.md").read_text()
    assert (tmp_path / "comparisons.csv").read_text() == comparisons_csv(rows)
    summary = {(r["setting"], r["length"]): r for r in csv.DictReader((tmp_path / "results.csv").open())}
    assert set(summary) == {(n, str(length)) for n in ("full", "snapkv@0.5") for length in (1024, 4096)}
    # Only some settings; a name with no samples, or no samples.jsonl, is refused.
    assert main([*argv, "--setting", "full"]) == 0
    assert "snapkv@0.5" not in (tmp_path / "results.md").read_text()
    # A name recorded from a config path (its stem) is taken as written.
    for r in records:
        if r.setting == "snapkv@0.5":
            log.add(dataclasses.replace(r, setting="my_study_config@0.5"))
    assert main([*argv, "--setting", "my_study_config@0.5"]) == 0
    assert "| my_study_config@0.5 | 4096 |" in (tmp_path / "results.md").read_text()
    for bad, message in ((["--compare", "full", "tova@0.5"], "no samples of tova@0.5"),
                         (["--compare", "full", "full"], "two different settings")):
        with pytest.raises(SystemExit):
            main([*argv, *bad])
        assert message in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--out", str(tmp_path / "none"), "--report-only"])
    assert "no " in capsys.readouterr().err


def test_compare_names_are_checked_before_anything_starts(monkeypatch, capsys) -> None:
    import vllm_kvevict.default_model

    monkeypatch.setattr(vllm_kvevict.default_model, "fetch_default_model",
                        lambda *a, **k: pytest.fail("started before checking --compare"))
    with pytest.raises(SystemExit):
        main(["--setting", "full", "--setting", "snapkv@0.5", "--compare", "snapkv@0.5", "tova@0.5"])
    assert "--compare tova@0.5: not a setting of this run (full, snapkv@0.5)" in capsys.readouterr().err


def test_grid_cells_hold_several_needles_and_the_first_is_unchanged() -> None:
    """Needle i of a grid is the same at every depth and length; needle 0 is
    the one a single-needle grid had (so earlier runs resume)."""
    class WordTokenizer:
        def __call__(self, text: str):
            return type("Encoded", (), {"input_ids": text.split()})()

    samples = build_samples(WordTokenizer(), [1024], ["niah_single_2"], 2, 42, "base", [0.0, 50.0],
                            [1024, 1500], grid_samples=3)
    needles = [s for s in samples[1024] + samples[1500] if s.task.startswith("needle@")]
    assert sorted((s.task, s.index) for s in needles[:6]) == [
        (f"needle@{d}", i) for d in (0, 50) for i in range(3)]
    answers = {(s.task, s.index): s.answers for s in needles}
    assert all(answers[("needle@50", i)] == answers[("needle@0", i)] for i in range(3))
    assert len({tuple(answers[("needle@0", i)]) for i in range(3)}) == 3
    single = build_samples(WordTokenizer(), [], [], 0, 42, "base", [0.0, 50.0], [1024], grid_samples=1)[1024]
    first = {s.task: s.prompt for s in needles[:6] if s.index == 0}
    assert {s.task: s.prompt for s in single} == first


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


# ---------------------------------------------------------- --engine reference


def test_reference_engine_scores_each_setting_like_its_own_decode_and_resumes(
    tmp_path, model_dir, tokenizer
) -> None:
    """One prefill shared by the end-of-prompt settings gives, per setting, the
    tokens of the reference decoder run on that setting alone; a per_chunk
    setting (evicting inside the prompt) runs its own chunked prefill and gives
    its own decode's tokens too; the record's score is RULER's metric on the
    decoded text; a second run reuses every record."""
    from vllm_kvevict.config import build_config
    from vllm_kvevict.evaluation.reference_eval import ReferenceEvalRunner
    from vllm_kvevict.evaluation.ruler import RulerGenerator
    from vllm_kvevict.evaluation.settings import eviction_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    samples = RulerGenerator(tokenizer, 768, 7, "base").samples(["niah_single_2"], 1)
    settings = [parse_setting(FULL), parse_setting("snapkv@0.25"), parse_setting("momentkv@0.25"),
                parse_setting("knorm@0.25")]
    runner = ReferenceEvalRunner(tmp_path, tokenizer, model_dir, max_new_tokens=12, progress=False)
    records = {r.setting: r for r in runner.run(settings, {768: samples})}
    assert set(records) == {s.name for s in settings}
    prompt = tokenizer(samples[0].prompt)["input_ids"]
    for setting in settings:
        eviction = eviction_config(setting, samples[0].prompt_tokens)
        config = None if eviction is None else build_config(eviction)
        alone = ReferenceEvictingDecoder(model_dir, config).generate(prompt, 12, stop_at_eos=True)
        alone = alone[:-1] if alone and alone[-1] == tokenizer.eos_token_id else alone
        record = records[setting.name]
        assert record.token_ids == alone
        assert record.score == samples[0].score(tokenizer.decode(alone, skip_special_tokens=True))
        assert record.answers == samples[0].answers
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    ReferenceEvalRunner(tmp_path, tokenizer, model_dir, max_new_tokens=12, progress=False).run(
        settings, {768: samples}
    )
    assert (tmp_path / "samples.jsonl").read_text().splitlines() == lines


def test_reference_engine_refuses_a_running_server(monkeypatch, capsys) -> None:
    from vllm_kvevict.evaluation import ruler_eval

    for settings in (["mine=http://localhost:1"], ["snapkv@0.5", "mine=http://localhost:1"]):
        argv = ["--engine", "reference"] + [a for s in settings for a in ("--setting", s)]
        with pytest.raises(SystemExit):
            ruler_eval.main(argv)
        assert "--engine serve" in capsys.readouterr().err
