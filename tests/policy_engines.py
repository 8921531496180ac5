"""Offline engines of tests/test_policies_e2e.py, one after the other in this
process: ``python tests/policy_engines.py REQUEST.json``.

The request names the model, the prompt's token ids, the number of tokens to
generate, the cases (id: eviction settings) and the result file. Each case's engine is created, generates the
prompt's greedy tokens and is shut down before the next case's; the result
holds each case's token ids, or the error its engine raised (so one failing
case fails only its own test). Run with ``VLLM_ENABLE_V1_MULTIPROCESSING=0``
the engine core and the worker run in this process, as in vLLM's single-GPU
layout.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

POOL_BLOCKS = 160  # above the 128 blocks of one max_model_len request


def run_case(model_dir: str, prompt: list[int], max_tokens: int, eviction: dict) -> list[int]:
    """Greedy token ids of ``prompt`` on an engine applying ``eviction``."""
    from vllm import LLM, SamplingParams

    from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

    llm = LLM(
        model_dir, dtype="float32", max_model_len=4096, block_size=32, enforce_eager=True,
        max_num_batched_tokens=512, max_num_seqs=4,
        kv_cache_memory_bytes=POOL_BLOCKS * DEFAULT_MODEL_BLOCK_BYTES + 4096,
        additional_config={"kv_eviction": eviction},
    )
    try:
        out = llm.generate(
            [{"prompt_token_ids": prompt}],
            SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True),
        )
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
    return list(out[0].outputs[0].token_ids)


def main(request_path: str) -> None:
    spec = json.loads(Path(request_path).read_text())
    results: dict[str, dict] = {}
    for case, eviction in spec["cases"].items():
        start = time.monotonic()
        try:
            tokens = run_case(spec["model_dir"], spec["prompt"], spec["max_tokens"], eviction)
            results[case] = {"tokens": tokens}
        except Exception:  # noqa: BLE001 - the case's test reports it
            results[case] = {"error": traceback.format_exc()}
        results[case]["seconds"] = time.monotonic() - start
        print(f"{case}: {results[case]['seconds']:.0f} s", flush=True)
        # Written after every case: a crash leaves the finished cases' results.
        Path(spec["result"]).write_text(json.dumps(results))


if __name__ == "__main__":
    main(sys.argv[1])
