"""`kvevict eval` and `kvevict bench` through real `vllm serve` processes: the
shared snapkv server given by URL, and (eval) servers the tool starts itself."""

from __future__ import annotations

import csv
import json

import pytest

from vllm_kvevict.evaluation import ruler_eval, serving_bench
from vllm_kvevict.evaluation.ruler import load_tokenizer, score_prediction

pytestmark = pytest.mark.e2e


def requests_served(server) -> float:
    """vLLM's own count of finished requests (all finish reasons)."""
    return server.metric("vllm:request_success_total")


def test_bench_against_a_running_server_times_every_token_and_resumes(snapkv_server, model_dir, tokenizer, tmp_path):
    out = tmp_path / "bench"
    argv = ["--setting", f"snap={snapkv_server.url}", "--requests", "3", "--prompt-tokens", "1500",
            "--max-tokens", "16", "--tokenizer", model_dir, "--out", str(out), "--no-progress",
            "--sample-interval", "0.1"]
    before = requests_served(snapkv_server)
    assert serving_bench.main(argv) == 0
    assert requests_served(snapkv_server) == before + 3
    run = json.loads((out / "results.json").read_text())["runs"][0]
    prompts = serving_bench.build_prompts(tokenizer, 3, 1500, 0)
    for record, prompt in zip(run["requests"], prompts):
        assert record["error"] is None
        # The server's usage agrees with our tokenizer; every chunk after the
        # first was timed (a chunk carries one token or, when the client lags, more).
        assert record["prompt_tokens"] == len(tokenizer(prompt).input_ids)
        assert record["completion_tokens"] == 16 and 1 <= len(record["itl"]) <= 15
        assert record["send_s"] < record["first_token_s"] <= record["end_s"]
        assert record["end_s"] == pytest.approx(record["first_token_s"] + sum(record["itl"]))
    result = run["result"]
    assert result["completed"] == 3 and result["completion_tokens"] == 48
    assert result["pool_blocks"] == 160  # read from vllm:cache_config_info
    assert 1 <= result["max_running"] <= 3
    assert result["blocks_held_peak"] >= 1 and result["preemptions"] == 0
    assert 0 < result["ttft_p50_ms"] <= result["ttft_p99_ms"]
    assert result["output_throughput"] == pytest.approx(48 / result["wall_s"])
    assert result["request_throughput"] == pytest.approx(3 / result["wall_s"])
    # kvevict_eviction_seconds over this run: each request evicts once, at the
    # end of its prompt (budget 512 < 1500), in one to three steps.
    assert 1 <= result["eviction_steps"] <= 3 and result["eviction_seconds"] > 0
    assert 0 < result["eviction_p50_ms"] <= result["eviction_p99_ms"]
    histogram = run["eviction_histogram"]
    assert histogram["buckets"][-1] == ["+Inf", result["eviction_steps"]]
    assert histogram["sum"] == result["eviction_seconds"]
    rows = list(csv.DictReader((out / "results.csv").open()))
    assert [r["name"] for r in rows] == ["snap"]
    assert run["vllm_benchmark"]["completed"] == 3  # vLLM's serving benchmark sent the load
    # A second run with the same parameters sends nothing.
    assert serving_bench.main(argv) == 0
    assert requests_served(snapkv_server) == before + 3


def test_eval_against_a_running_server_scores_with_rulers_metric_and_resumes(snapkv_server, model_dir, tmp_path):
    out = tmp_path / "eval"
    argv = ["--setting", f"snap={snapkv_server.url}", "--lengths", "1024", "--tasks", "niah_single_2,vt",
            "--samples-per-task", "1", "--grid-depths", "50", "--grid-samples", "1", "--tokenizer", model_dir,
            "--max-new-tokens", "24", "--out", str(out), "--no-progress"]
    before = requests_served(snapkv_server)
    assert ruler_eval.main(argv) == 0
    assert requests_served(snapkv_server) == before + 3
    records = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert sorted(r["task"] for r in records) == ["needle@50", "niah_single_2", "vt"]
    samples = {s.task: s for s in ruler_eval.build_samples(
        load_tokenizer(model_dir), [1024], ["niah_single_2", "vt"], 1, 42, "base", [50.0], [1024], grid_samples=1,
    )[1024]}
    for record in records:
        sample = samples[record["task"]]
        assert record["prompt_tokens"] == sample.prompt_tokens
        assert record["score"] == score_prediction(sample.metric, record["prediction"], sample.answers)
        assert record["answers"] == sample.answers  # the expected answer beside the output
        assert record["tokens_kept"] is not None  # the server's retained-tokens histogram
    summary = list(csv.DictReader((out / "results.csv").open()))[0]
    scores = {r["task"]: r["score"] for r in records}
    assert float(summary["mean_score"]) == pytest.approx((scores["niah_single_2"] + scores["vt"]) / 2, abs=0.01)
    assert float(summary["needle@50"]) == scores["needle@50"]
    for name in ("results.md", "accuracy_vs_kept.png", "needle_grid.png"):
        assert (out / name).exists()
    assert ruler_eval.main(argv) == 0  # resumed: nothing sent again
    assert requests_served(snapkv_server) == before + 3


def test_eval_starts_its_own_servers_and_compares_with_the_full_cache(model_dir, tmp_path):
    """full and snapkv@0.5 at 1k tokens: the tool serves both; the KL is taken
    against the full cache's saved whole-vocabulary distributions."""
    out = tmp_path / "managed"
    assert ruler_eval.main([
        "--setting", "full", "--setting", "snapkv@0.5", "--model", model_dir, "--lengths", "1024",
        "--tasks", "niah_single_2", "--samples-per-task", "2", "--grid-depths", "", "--logprobs", "-1",
        "--max-new-tokens", "16", "--out", str(out), "--no-progress",
    ]) == 0
    records = {(r["setting"], r["index"]): r for r in map(json.loads, (out / "samples.jsonl").read_text().splitlines())}
    assert len(records) == 4
    for index in range(2):
        full, snap = records[("full", index)], records[("snapkv@0.5", index)]
        assert full["budget"] is None and full["kl_positions"] == 0
        # The budget: half the mean prompt, in whole blocks.
        assert snap["budget"] % 32 == 0 and 0 < snap["budget"] <= snap["prompt_tokens"] / 2
        same = next((i for i, (a, b) in enumerate(zip(full["token_ids"], snap["token_ids"])) if a != b),
                    len(full["token_ids"]))
        assert snap["kl_positions"] == min(8, same + 1, len(full["token_ids"]), len(snap["token_ids"]))
        assert snap["kl_sum"] >= 0
    table = (out / "results.md").read_text()
    assert "| full | 1024 | 100% | 2 |" in table and "| snapkv@0.5 | 1024 |" in table
    # The finished run compared from its samples.jsonl alone, paired by sample.
    assert ruler_eval.main(["--out", str(out), "--report-only", "--compare", "snapkv@0.5", "full"]) == 0
    rows = {r["task"]: r for r in csv.DictReader((out / "comparisons.csv").open())}
    expected = sum(records[("snapkv@0.5", i)]["score"] - records[("full", i)]["score"] for i in range(2)) / 2
    assert rows["niah_single_2"]["pairs"] == "2"
    assert float(rows["niah_single_2"]["difference"]) == pytest.approx(expected, abs=0.01)
    assert float(rows["mean"]["difference"]) == pytest.approx(expected, abs=0.01)
    assert "snapkv@0.5 - full: 2 paired samples." in (out / "results.md").read_text()


def test_the_serving_benchmark_it_drives_is_vllms_032() -> None:
    """`kvevict bench` calls vLLM's benchmark() by keyword and reads its result
    keys: an upgrade that renames them fails here, not in a user's run."""
    import inspect

    from vllm.benchmarks import serve

    params = inspect.signature(serve.benchmark).parameters
    for name in ("task_type", "endpoint_type", "api_url", "base_url", "model_id", "model_name",
                 "tokenizer", "input_requests", "logprobs", "request_rate", "burstiness",
                 "disable_tqdm", "num_warmups", "profile", "selected_percentile_metrics",
                 "selected_percentiles", "ignore_eos", "goodput_config_dict", "max_concurrency",
                 "lora_modules", "extra_headers", "extra_body", "ready_check_timeout_sec"):
        assert name in params, name
    source = inspect.getsource(serve.benchmark)
    for key in ("start_times", "ttfts", "itls", "latencies", "input_lens", "output_lens", "errors",
                "duration", 'f"p{p_word}_{metric_attribute_name}_ms"'):
        assert (f'"{key}"' if not key.startswith("f") else key) in source, key
