"""Every policy beyond the two with their own suites, through vLLM: greedy
tokens equal the transformers reference decoder applying the same policy
(prefill chunks of 512, the policy's default prefill mode, decode evictions
every 32 steps), on the default model, in the suite's NaN-poison mode.

The engines run in one subprocess (``tests/policy_engines.py``), one offline
engine per policy, one after the other, each with
``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the engine core and the worker share
that process, as in vLLM's single-GPU layout, instead of a process each. The
proof is the same: the policy's scores, its eviction and the attention over
the kept blocks run in the same worker code, on the same schedule from the
same scheduler code; only the process boundary between scheduler and worker
is gone (on this prompt the tokens of keydiff, pyramidkv and the learned
policy are the same either way). vLLM's CPU layout of an engine core process
and a worker process is proven per storage mode by the served tests
(test_e2e_serve.py: slots; test_head_pages.py: head pages with the moments)
and by test_preemption.py (slots, head_pages, head_pages_moments, global,
prefix).

The reference runs in this process. Policies that evict only at the prompt's
end (``end_of_prompt``, no gates read during the prompt) continue from one
full-cache prefill of the prompt (``run_prompt``/``continue_from``, as
``kvevict eval --engine reference`` does), which gives token for token what
each one's own chunked prefill (``generate``) gives; the others run
``generate``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import bind_to_engine_core, needle_prompt

pytestmark = pytest.mark.e2e

MAX_TOKENS = 72
ENGINE_TIMEOUT_S = 1800
CASES = {
    "keydiff": {"policy": "keydiff", "budget": 512},
    "keydiff-adaptive": {"policy": "keydiff", "budget": 512, "head_budget": "adaptive"},
    "knorm": {"policy": "knorm", "budget": 512},
    "tova": {"policy": "tova", "budget": 512},
    "momentkv": {"policy": "momentkv", "budget": 256, "head_budget": "adaptive"},
    "momentkv-diagonal": {
        "policy": "momentkv", "budget": 256, "head_budget": "adaptive", "moment_covariance": "diagonal",
    },
    "momentkv-zeroth-order": {"policy": "momentkv", "budget": 256, "moment_covariance": "none"},
    # Needs the layer's rotary frequencies (read from vLLM's rotary_emb).
    "expected_attention": {"policy": "expected_attention", "budget": 512},
    # Needs the layer's output projection (read through o_proj's quant method)
    # and, on its default base (Expected Attention), the rotary frequencies.
    "criticalkv-adaptive": {"policy": "criticalkv", "budget": 512, "head_budget": "adaptive"},
    "h2o": {"policy": "h2o", "budget": 512},
    # Layer budgets falling with depth: every layer ranked after the last one,
    # in the pool of every layer's blocks, with each layer's own queries (at
    # the prompt's end and at the decode evictions; per_chunk: also mid-prompt,
    # the window partly from earlier steps).
    "pyramidkv": {"policy": "pyramidkv", "budget": 256},
    "pyramidkv-per-chunk": {"policy": "pyramidkv", "budget": 256, "prefill_mode": "per_chunk"},
    # CriticalKV's importance aggregated by its worst case over the window
    # (each layer's output projection): AdaKV head budgets, and one ranking
    # over every layer and head after the last layer.
    "defensivekv": {"policy": "defensivekv", "budget": 256},
    "layer_defensivekv": {"policy": "layer_defensivekv", "budget": 256},
    # Query-agnostic: every prefill chunk evicted before the next is read.
    "defensivekv-per-chunk": {"policy": "defensivekv", "budget": 256, "prefill_mode": "per_chunk"},
    "layer_defensivekv-per-chunk": {"policy": "layer_defensivekv", "budget": 256, "prefill_mode": "per_chunk"},
    "random": {"policy": "random", "budget": 512},
    # Gates shipped for the default model; one ranking over every layer and
    # head (eager here, compiled in test_learned_e2e.py).
    "learned": {"policy": "learned", "budget": 256},
}
# The cases whose reference continues from the shared full-cache prefill:
# each evicts only at the prompt's end (its default prefill mode
# end_of_prompt) and reads nothing during the prompt but its keys, values and
# last queries.
SHARED_PREFILL = (
    "tova", "momentkv", "momentkv-diagonal", "momentkv-zeroth-order", "expected_attention",
    "criticalkv-adaptive", "h2o", "pyramidkv", "defensivekv", "layer_defensivekv",
)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer(needle_prompt(tokenizer, 55555, target_tokens=1200)).input_ids


@pytest.fixture(scope="module")
def served(model_dir, prompt_ids, tmp_path_factory, request) -> dict:
    """Each selected case's greedy token ids (or its engine's error) and the
    engines' log: only the engines of the cases this run selects (``-k``)
    start."""
    selected = {
        item.callspec.params["case"] for item in request.session.items
        if item.module is request.module and hasattr(item, "callspec")
    }
    cases = {case: settings for case, settings in CASES.items() if case in selected}
    work = tmp_path_factory.mktemp("policies_e2e")
    spec, result, log = work / "request.json", work / "result.json", work / "engines.log"
    spec.write_text(json.dumps({"model_dir": model_dir, "prompt": prompt_ids, "cases": cases,
                                "max_tokens": MAX_TOKENS, "result": str(result)}))
    env = dict(
        os.environ,
        PYTHONSAFEPATH="1",  # the repo's triton_kernels/ must not shadow vLLM's
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        KVEVICT_POISON_FREED_BLOCKS="1",
    )
    script = Path(__file__).with_name("policy_engines.py")
    with open(log, "w") as handle:
        proc = subprocess.run([sys.executable, str(script), str(spec)], env=env, stdout=handle,
                              stderr=subprocess.STDOUT, timeout=ENGINE_TIMEOUT_S,
                              preexec_fn=bind_to_engine_core)
    results = json.loads(result.read_text()) if result.exists() else {}
    for case, run in results.items():
        print(f"\n{case}: {run['seconds']:.0f} s")
    tail = "\n".join(log.read_text().splitlines()[-60:])
    return {"results": results, "returncode": proc.returncode, "log_tail": tail}


@pytest.fixture(scope="module")
def shared_prefill(model_dir, prompt_ids):
    """One full-cache prefill of the prompt, keeping the queries of the
    longest observation window among SHARED_PREFILL's cases, and its decoder."""
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    decoder = ReferenceEvictingDecoder(model_dir, None, block_size=32, chunk_size=512)
    window = max(build_config(CASES[case]).observation_window for case in SHARED_PREFILL)
    return decoder, decoder.run_prompt(prompt_ids, keep_queries=window)


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_output_equals_reference_decoder(case, model_dir, prompt_ids, served, request):
    from vllm_kvevict.config import build_config
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    run = served["results"].get(case)
    if run is None:
        pytest.fail(f"the engines exited with {served['returncode']} before {case}; log tail:\n"
                    f"{served['log_tail']}")
    if "error" in run:
        pytest.fail(f"{case}: the engine failed:\n{run['error']}")
    served_tokens = run["tokens"]
    config = build_config(CASES[case])
    if case in SHARED_PREFILL:
        decoder, state = request.getfixturevalue("shared_prefill")
        reference = decoder.continue_from(state, config, MAX_TOKENS)
    else:
        reference = ReferenceEvictingDecoder(model_dir, config, block_size=32, chunk_size=512).generate(
            prompt_ids, MAX_TOKENS
        )
    assert served_tokens[:32] == reference[:32]
    assert served_tokens == reference
