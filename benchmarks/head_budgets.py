"""Per-head budgets at a fixed memory: SnapKV with equal per-head capacity vs
AdaKV+SnapKV (per-head page tables), through `vllm serve`.

Every setting keeps the same number of tokens per layer (budget x KV heads),
so the request holds the same blocks; only how they are split across heads
differs. Prompts: passkey (needle) and RULER-style multi-key retrieval, ~4k
tokens, evicted once at the end of the prompt (SnapKV's default), greedy.

    python benchmarks/head_budgets.py                      # the table in benchmarks/README.md
    python benchmarks/head_budgets.py --samples 4 --fractions 0.1
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

# (row name, settings added to {"policy": "snapkv", "budget": B})
SETTINGS: list[tuple[str, dict]] = [
    ("snapkv, equal per head (slots)", {"storage": "slots"}),
    ("snapkv, equal per head (head_pages)", {"storage": "head_pages"}),
    ("adakv + snapkv (head_pages)", {"head_budget": "adaptive"}),
    ("adakv + snapkv + moment correction", {"head_budget": "adaptive", "moment_correction": True}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=8, help="samples per task")
    parser.add_argument("--tokens", type=int, default=4000, help="prompt length target")
    parser.add_argument("--fractions", type=float, nargs="+", default=[0.2, 0.1],
                        help="budget as a fraction of the prompt length")
    parser.add_argument("--no-full", action="store_true", help="skip the full-cache row")
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
    settings: list[tuple[str, str, dict | None]] = [] if args.no_full else [("full cache", "-", None)]
    for fraction in args.fractions:
        # A multiple of the block size: every storage keeps exactly this many
        # tokens per head on average.
        budget = max(64, int(fraction * mean_len) // 32 * 32)
        for name, extra in SETTINGS:
            eviction = {"policy": "snapkv", "budget": budget, **extra}
            settings.append((name, f"{budget} ({budget / mean_len:.0%})", eviction))

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, budget, eviction) in enumerate(settings):
            work = Path(tmp) / str(i)
            work.mkdir()
            start = time.perf_counter()
            hits = serve_and_score(model, eviction, tasks, work)
            rows.append((name, budget, hits, time.perf_counter() - start))
            print(json.dumps({"setting": name, "budget": budget, **hits}), flush=True)

    print(f"\nprompts: {args.samples} needle + {args.samples} multikey, mean {mean_len:.0f} "
          "tokens; budget in tokens per KV head on average (kept fraction)\n")
    print("| setting | budget | needle | multikey | seconds |")
    print("|---|---|---|---|---|")
    for name, budget, hits, seconds in rows:
        print(f"| {name} | {budget} | {hits['needle']}/{args.samples} | "
              f"{hits['multikey']}/{args.samples} | {seconds:.0f} |")


if __name__ == "__main__":
    main()
