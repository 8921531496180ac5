"""Eviction quality through `vllm serve`: per policy and kept
fraction, the score on five RULER tasks generated offline (niah single /
multikey / multivalue, variable tracking, SQuAD QA) and the mean KL divergence
of next-token distributions from the full cache.

A shorthand for `kvevict eval` (vllm_kvevict/evaluation/ruler_eval.py) with
these five tasks, no needle grid, 48 new tokens at most and by default the
exact (whole-vocabulary) KL:

    python benchmarks/policy_quality.py --policies snapkv,streamingllm --out results/quality
    python benchmarks/policy_quality.py --policies snapkv --fractions 0.5 --samples-per-task 1 --out /tmp/pq

A policy's settings come from the shipped config NAME (``kvevict policies``;
``configs/NAME.yaml`` in a checkout) when there is one (else the policy's defaults), with ``budget`` = fraction x mean prompt length, rounded
down to a multiple of the block size (32). Any other flag goes to `kvevict
eval` as is (e.g. --lengths, --seed, --prompt-format, --logprobs).
"""

from __future__ import annotations

import argparse
import sys

QUALITY_TASKS = "niah_single_2,niah_multikey_1,niah_multivalue,vt,qa_1"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="streamingllm,snapkv,keydiff,knorm,tova,momentkv",
                        help="comma-separated policies or shipped config names")
    parser.add_argument("--fractions", default="0.5,0.2",
                        help="comma-separated fractions of the mean prompt length to keep")
    parser.add_argument("--length", default="4096", help="RULER target length in tokens")
    parser.add_argument("--logprobs-k", default="-1",
                        help="-1: whole-vocabulary distributions (exact KL); k>0: top-k + tail bucket")
    args, rest = parser.parse_known_args()

    from vllm_kvevict.evaluation.ruler_eval import main as eval_main

    settings = ["--setting", "full"]
    for fraction in args.fractions.split(","):
        for policy in (p.strip() for p in args.policies.split(",") if p.strip()):
            settings += ["--setting", f"{policy}@{fraction}"]
    return eval_main([*settings, "--lengths", args.length, "--tasks", QUALITY_TASKS,
                      "--grid-depths", "", "--max-new-tokens", "48", "--logprobs", args.logprobs_k, *rest])


if __name__ == "__main__":
    sys.exit(main())
