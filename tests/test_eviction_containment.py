"""A policy that fails inside the engine does not take the engine down.

vLLM treats an error in model execution as fatal: every in-flight request
would fail. The eviction engine contains a policy's failure instead: the
(request, layer) whose scoring raised, or gave NaN scores, keeps its sinks
and most recent tokens, which is exactly StreamingLLM's selection, in the
number of pages the scheduler planned. So a served request whose policy
fails at every eviction produces StreamingLLM's greedy tokens (checked
against the transformers reference decoder running StreamingLLM with the same
settings), frees the same blocks, and the failure is counted per reason.

The engines run in process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) in a
subprocess (this file, run as a script) so the policy can be made to fail
there; the tiny random Llama keeps them fast.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

BLOCK_SIZE = 32
POOL_BLOCKS = 160
MAX_TOKENS = 24
PROMPT_TOKENS = 700
COMMON = {"budget": 256, "decode_interval": 16, "prefill_mode": "end_of_prompt",
          "sink_tokens": 4, "recent_window": 32}
# case: (served settings, how SnapKV's score fails, expected fallback reason)
CASES = {
    "slots-raises": ({"policy": "snapkv", **COMMON}, "raise", "RuntimeError"),
    "head-pages-nan": ({"policy": "snapkv", "head_budget": "adaptive", **COMMON}, "nan", "non_finite_scores"),
}
ENGINE_TIMEOUT_S = 900


def _break_snapkv(how: str) -> None:
    """Make SnapKV's score fail in this process (the engine runs here)."""
    import torch

    from vllm_kvevict.policies.snapkv import SnapKVPolicy

    def score(self, inputs):
        if how == "raise":
            raise RuntimeError("scoring failed")
        return torch.full(inputs.keys.shape[:2], float("nan"))

    SnapKVPolicy.score = score


def run_engines(model_dir: str, prompt: list[int], out_dir: str, case: str, kv_cache_memory: int) -> dict:
    from vllm import LLM, SamplingParams

    settings, how, _ = CASES[case]
    _break_snapkv(how)
    stats_path = Path(out_dir) / f"stats-{case}.json"
    os.environ["KVEVICT_STATS_PATH"] = str(stats_path)
    llm = LLM(
        model_dir, dtype="float32", max_model_len=4096, block_size=BLOCK_SIZE,
        max_num_batched_tokens=512, max_num_seqs=4, enforce_eager=True, seed=0,
        kv_cache_memory_bytes=kv_cache_memory,
        additional_config={"kv_eviction": settings},
    )
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompt}], greedy)
    # The engine still serves: a second request, then one more step so the
    # worker hears that the requests finished.
    second = llm.generate([{"prompt_token_ids": prompt}], greedy)
    llm.generate([{"prompt_token_ids": prompt[:8]}], SamplingParams(max_tokens=1))
    time.sleep(1.0)
    llm.llm_engine.engine_core.shutdown()
    return {
        "tokens": [list(out.outputs[0].token_ids) for out in (*first, *second)],
        "engine": json.loads(stats_path.read_text()),
        "worker": json.loads(Path(f"{stats_path}.worker0").read_text()),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoTokenizer

    from helpers import bind_to_engine_core, model_block_bytes
    from vllm_kvevict.evaluation.serving_bench import kv_cache_memory_bytes
    from vllm_kvevict.evaluation.tasks import needle_prompt
    from tiny_model import fetch_tiny_model

    tiny = str(fetch_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = tokenizer(needle_prompt(tokenizer, 4711, target_tokens=PROMPT_TOKENS)).input_ids
    work = tmp_path_factory.mktemp("containment")
    env = dict(os.environ, PYTHONSAFEPATH="1", VLLM_ENABLE_V1_MULTIPROCESSING="0",
               KVEVICT_POISON_FREED_BLOCKS="1")
    request = work / "request.json"
    request.write_text(json.dumps({"model_dir": tiny, "prompt": prompt, "out_dir": str(work),
                                   "result": str(work / "result.json"),
                                   "kv_cache_memory": kv_cache_memory_bytes(POOL_BLOCKS, model_block_bytes(tiny, BLOCK_SIZE))}))
    log = work / "engines.log"
    with open(log, "w") as handle:
        proc = subprocess.run([sys.executable, __file__, str(request)], env=env,
                              stdout=handle, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S,
                              preexec_fn=bind_to_engine_core)
    text = log.read_text()
    if proc.returncode != 0:
        tail = "\n".join(text.splitlines()[-60:])
        pytest.fail(f"engines exited with {proc.returncode}; log tail:\n{tail}")
    return tiny, prompt, json.loads((work / "result.json").read_text()), text


@pytest.mark.parametrize("case", list(CASES))
def test_failing_policy_serves_streamingllm_selection(runs, case):
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    model_dir, prompt, results, _ = runs
    settings, _, reason = CASES[case]
    run = results[case]
    expected = ReferenceEvictingDecoder(
        model_dir, build_config({**settings, "policy": "streamingllm"}), block_size=BLOCK_SIZE,
        chunk_size=512,
    ).generate(prompt, MAX_TOKENS)
    assert run["tokens"] == [expected, expected], case
    fallbacks = run["worker"]["fallbacks"]
    assert set(fallbacks) == {reason} and fallbacks[reason] > 0, fallbacks
    assert run["worker"]["nan_outputs"] == 0
    assert run["engine"]["blocks_freed_by_eviction"] > 0


def test_each_failure_is_logged_once(runs):
    *_, log = runs
    warnings = [line for line in log.splitlines() if "could not score an eviction" in line]
    assert len(warnings) == len(CASES), warnings


if __name__ == "__main__":
    if sys.argv[1] == "--case":  # one engine: python FILE --case NAME REQUEST RESULT
        name, spec = sys.argv[2], json.loads(Path(sys.argv[3]).read_text())
        out = run_engines(spec["model_dir"], spec["prompt"], spec["out_dir"], name, spec["kv_cache_memory"])
        Path(sys.argv[4]).write_text(json.dumps(out))
    else:  # every case, one process each: each breaks SnapKV its own way
        spec = json.loads(Path(sys.argv[1]).read_text())
        results = {}
        for name in CASES:
            result = Path(spec["out_dir"]) / f"case-{name}.json"
            subprocess.run([sys.executable, __file__, "--case", name, sys.argv[1], str(result)], check=True)
            results[name] = json.loads(result.read_text())
        Path(spec["result"]).write_text(json.dumps(results))
