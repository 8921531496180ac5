"""The Triton path inside vLLM on CPU: ``attention_kernel: triton``.

The CUDA backend's path (new tokens written by torch indexing into vLLM's
logical cache view, attention by the Triton kernel over per-head page tables
with the MomentKV moments in the same pass, compaction by the Triton kernel)
served by vLLM's CPU platform, the kernels under Triton's interpreter
(``TRITON_INTERPRET=1`` in the engine's environment from the start).

For each storage, greedy fp32 token ids equal both the native CPU path (C++
kernels, vLLM's page order) and the transformers reference decoder applying
the same eviction: SnapKV (slots), AdaKV+SnapKV (head pages), H2O (slots),
TOVA, KeyDiff and Expected Attention on AdaKV (head pages: TOVA from the
window-score kernel's votes of the last query, KeyDiff and Expected Attention
from the tokens read by address, each scored as one batch of the step's
requests), MomentKV (the correction on), CriticalKV on Expected Attention
(its two stages and value factor for the step's requests at once),
DefensiveKV (the step's requests' windows stacked), and the pooled
layers' ranking of every layer at once, batched over the step's requests
and layers: the learned policy (global eviction, with seeded random gates),
Layer-DefensiveKV (global) and PyramidKV (its layer budgets), on the tiny
random Llama. Every run is in the
isolation check's poison mode: no attention output holds NaN, and blocks went
back to vLLM's pool during the requests.

The CUDA backend's own classes (``gpu_backend``: vLLM's Triton metadata
builder and Impl with ours on top, lengths from vLLM's host copies, the
cache written with the step's host token count) are served the same way for
two cases, put in place of the CPU backend: the same tokens again.

The engines run in subprocesses (this file, run as a script) so the
interpreter is on before Triton is first imported.
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
POOL_BLOCKS = 160  # above the 128 blocks of one max_model_len request
MAX_TOKENS = 20
PROMPT_TOKENS = 600  # budget 256: evicted at the prompt's end (or per chunk) and once in decode
EVICTION = {"budget": 256, "decode_interval": 16}
GATES = "GATES_DIR"  # replaced by the folder of the seeded gates
# case: eviction settings
CASES = {
    "snapkv-slots": {"policy": "snapkv", **EVICTION},
    "adakv-head-pages": {"policy": "snapkv", **EVICTION, "head_budget": "adaptive"},
    "h2o-slots": {"policy": "h2o", **EVICTION},
    "tova-head-pages": {"policy": "tova", **EVICTION, "head_budget": "adaptive"},
    "keydiff-head-pages": {"policy": "keydiff", **EVICTION, "head_budget": "adaptive"},
    "expected-attention": {"policy": "expected_attention", **EVICTION},  # AdaKV head pages by default
    "momentkv": {"policy": "momentkv", **EVICTION},
    "criticalkv": {"policy": "criticalkv", **EVICTION},  # AdaKV head pages, Expected Attention's base
    "defensivekv": {"policy": "defensivekv", **EVICTION},  # AdaKV head pages
    "learned-global": {"policy": "learned", **EVICTION, "policy_options": {"gates": GATES}},
    "layer-defensivekv": {"policy": "layer_defensivekv", **EVICTION},  # every layer ranked together (global)
    "pyramidkv": {"policy": "pyramidkv", **EVICTION},  # PyramidKV's layer budgets
}
KERNELS = ("native", "triton")
# Served by the CUDA backend's classes on CPU (vLLM's CPU platform resolves
# CPU_ATTN, so the script registers gpu_backend there).
GPU_BACKEND_CASES = ("momentkv", "learned-global")
ENGINE_TIMEOUT_S = 1500


def _settings(case: str, gates_dir: str) -> dict:
    eviction = dict(CASES[case])
    if "policy_options" in eviction:
        eviction["policy_options"] = {"gates": gates_dir}
    return eviction


def run_engines(model_dir: str, prompt: list[int], gates_dir: str, out_dir: str, backend: str,
                kv_cache_memory: int) -> dict:
    """Every case with each kernel (``backend`` cpu), or the GPU backend's
    cases (``backend`` gpu), one engine at a time: token ids and stats."""
    if backend == "gpu":
        import vllm_kvevict
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

        vllm_kvevict.register()
        vllm_kvevict.gpu_backend_member()  # the enum member its get_name() returns
        register_backend(AttentionBackendEnum.CPU_ATTN, vllm_kvevict.GPU_BACKEND)
    from vllm import LLM, SamplingParams

    runs = [(name, kernel) for name in CASES for kernel in KERNELS]
    if backend == "gpu":
        runs = [(name, "triton") for name in GPU_BACKEND_CASES]
    results: dict = {}
    for name, kernel in runs:
        stats_path = Path(out_dir) / f"stats-{name}-{kernel}-{backend}.json"
        os.environ["KVEVICT_STATS_PATH"] = str(stats_path)
        start = time.monotonic()
        llm = LLM(
            model_dir,
            dtype="float32",
            max_model_len=4096,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=512,
            max_num_seqs=4,
            enforce_eager=True,
            seed=0,
            kv_cache_memory_bytes=kv_cache_memory,
            additional_config={"kv_eviction": {**_settings(name, gates_dir), "attention_kernel": kernel}},
        )
        outputs = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
        )
        # One more step tells the worker the request finished (it frees
        # and poisons the request's blocks then).
        llm.generate([{"prompt_token_ids": prompt[:8]}], SamplingParams(max_tokens=1))
        time.sleep(1.0)
        llm.llm_engine.engine_core.shutdown()
        del llm
        results[f"{name}/{kernel}" + ("/gpu-backend" if backend == "gpu" else "")] = {
            "tokens": [list(out.outputs[0].token_ids) for out in outputs],
            "engine": json.loads(stats_path.read_text()),
            "worker": json.loads(Path(f"{stats_path}.worker0").read_text()),
            "seconds": time.monotonic() - start,
        }
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from transformers import AutoTokenizer

    from helpers import bind_to_engine_core, model_block_bytes
    from vllm_kvevict.evaluation.serving_bench import kv_cache_memory_bytes
    from vllm_kvevict.evaluation.tasks import needle_prompt
    from tiny_model import build_tiny_gates, fetch_tiny_model

    tiny = str(fetch_tiny_model())
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    prompt = tokenizer(needle_prompt(tokenizer, 2718, target_tokens=PROMPT_TOKENS)).input_ids
    kv_cache_memory = kv_cache_memory_bytes(POOL_BLOCKS, model_block_bytes(tiny, BLOCK_SIZE))
    work = tmp_path_factory.mktemp("triton_path")
    gates_dir = str(build_tiny_gates(Path(tiny), work / "gates"))
    env = dict(
        os.environ,
        PYTHONSAFEPATH="1",  # the repo's triton_kernels/ must not shadow vLLM's
        TRITON_INTERPRET="1",  # before Triton is first imported
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVEVICT_POISON_FREED_BLOCKS="1",
    )
    results: dict = {}
    for backend in ("cpu", "gpu"):
        request, result = work / f"request-{backend}.json", work / f"result-{backend}.json"
        request.write_text(json.dumps({"model_dir": tiny, "prompt": prompt, "gates_dir": gates_dir,
                                       "out_dir": str(work), "result": str(result), "backend": backend,
                                       "kv_cache_memory": kv_cache_memory}))
        log = work / f"engines-{backend}.log"
        with open(log, "w") as handle:
            proc = subprocess.run([sys.executable, __file__, str(request)], env=env,
                                  stdout=handle, stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S,
                                  preexec_fn=bind_to_engine_core)
        if proc.returncode != 0:
            tail = "\n".join(log.read_text().splitlines()[-60:])
            pytest.fail(f"{backend} backend engines exited with {proc.returncode}; log tail:\n{tail}")
        results.update(json.loads(result.read_text()))
    for key, run in results.items():
        print(f"\n{key}: {run['seconds']:.0f} s")
    return tiny, prompt, gates_dir, results


@pytest.mark.parametrize("case", list(CASES))
def test_triton_path_tokens_equal_native_and_reference(runs, case):
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    model_dir, prompt, gates_dir, results = runs
    native, triton = results[f"{case}/native"]["tokens"][0], results[f"{case}/triton"]["tokens"][0]
    expected = ReferenceEvictingDecoder(
        model_dir, build_config(_settings(case, gates_dir)), block_size=BLOCK_SIZE, chunk_size=512
    ).generate(prompt, MAX_TOKENS)
    assert native == expected, f"{case}: native path"
    assert triton == expected, f"{case}: triton path"
    if case in GPU_BACKEND_CASES:
        assert results[f"{case}/triton/gpu-backend"]["tokens"][0] == expected, f"{case}: CUDA backend's classes"


@pytest.mark.parametrize("case", list(CASES))
def test_triton_path_frees_blocks_and_reads_none_it_gave_back(runs, case):
    *_, results = runs
    keys = [f"{case}/{kernel}" for kernel in KERNELS]
    if case in GPU_BACKEND_CASES:
        keys.append(f"{case}/triton/gpu-backend")
    for key in keys:
        run = results[key]
        assert run["worker"]["nan_outputs"] == 0, f"{key}: an output read a poisoned block"
        assert run["worker"]["blocks_poisoned"] > 0, f"{key}: poison mode was off"
        assert run["engine"]["blocks_freed_by_eviction"] > 0, f"{key}: no block freed"
    # Every path holds the same blocks: the scheduler's accounting follows the schedule.
    freed = {results[key]["engine"]["blocks_freed_by_eviction"] for key in keys}
    assert len(freed) == 1, freed


if __name__ == "__main__":
    spec = json.loads(Path(sys.argv[1]).read_text())
    out = run_engines(spec["model_dir"], spec["prompt"], spec["gates_dir"], spec["out_dir"], spec["backend"],
                      spec["kv_cache_memory"])
    Path(spec["result"]).write_text(json.dumps(out))
