"""Prefill eviction modes through `vllm serve`: retrieval score per policy,
mode and budget, on the embedded default model.

For each setting this starts a real `vllm serve --kv-eviction ...` on loopback
(CPU, fp32, chunked prefill of 512 tokens) and sends ~4k-token passkey (needle)
and multi-key retrieval prompts through the OpenAI API; a sample scores when
the greedy answer contains the expected number.

    python benchmarks/prefill_modes.py                 # the table in benchmarks/README.md
    python benchmarks/prefill_modes.py --samples 3 --fractions 0.5
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from vllm_kvevict.default_model import fetch_default_model
from vllm_kvevict.evaluation.retrieval import serve_and_score
from vllm_kvevict.evaluation.tasks import multikey_sample, needle_sample
from vllm_kvevict.policies import POLICIES

def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=6, help="samples per task")
    parser.add_argument("--tokens", type=int, default=4000, help="prompt length target")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.5, 0.2],
                        help="budget as a fraction of the prompt length")
    parser.add_argument("--policies", nargs="+", default=sorted(POLICIES))
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model = str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    tasks = {
        "needle": [needle_sample(tokenizer, seed, args.tokens) for seed in range(args.samples)],
        "multikey": [multikey_sample(tokenizer, seed, args.tokens) for seed in range(args.samples)],
    }
    mean_len = sum(len(tokenizer(s.prompt).input_ids) for t in tasks.values() for s in t) / (
        2 * args.samples
    )
    settings: list[tuple[str, str, str, dict | None]] = [("full cache", "-", "-", None)]
    for fraction in args.fractions:
        budget = int(round(fraction * mean_len))
        for policy in args.policies:
            for mode in ("per_chunk", "end_of_prompt"):
                eviction = {"policy": policy, "budget": budget, "prefill_mode": mode}
                settings.append((policy, mode, f"{budget} ({fraction:.0%})", eviction))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (policy, mode, budget, eviction) in enumerate(settings):
            work = Path(tmp) / str(i)
            work.mkdir()
            start = time.perf_counter()
            hits = serve_and_score(model, eviction, tasks, work)
            rows.append((policy, mode, budget, hits, time.perf_counter() - start))
            print(json.dumps({"policy": policy, "mode": mode, "budget": budget, **hits}), flush=True)

    print(f"\nprompts: {args.samples} needle + {args.samples} multikey, "
          f"mean {mean_len:.0f} tokens; budget in tokens per KV head (kept fraction)\n")
    print("| policy | prefill_mode | budget | needle | multikey | seconds |")
    print("|---|---|---|---|---|---|")
    for policy, mode, budget, hits, seconds in rows:
        print(f"| {policy} | {mode} | {budget} | {hits['needle']}/{args.samples} | "
              f"{hits['multikey']}/{args.samples} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
