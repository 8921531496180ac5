"""``vllm serve --kv-eviction POLICY [--kv-eviction-config JSON|FILE]``.

vLLM has no hook for plugin flags, so at plugin load we wrap three
``EngineArgs`` methods (checked in ``compat``):

* ``add_cli_args`` adds the two flags (idempotent: vLLM builds several parsers);
* ``from_cli_args`` turns them into ``additional_config["kv_eviction"]``, the
  field vLLM already carries to every process (``LLM(additional_config=...)``
  takes the same path);
* ``create_engine_config`` validates the eviction config against the rest of
  vLLM's configuration, for the CLI and for ``LLM()`` alike, and turns prefix
  caching off unless the user forced it on.

On the command line a mistake ends the process with one sentence naming the
fix (like argparse's own errors); in Python it raises ``KVEvictionConfigError``.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator
from typing import Any

from vllm_kvevict.config import (
    ADDITIONAL_CONFIG_KEY,
    EvictionConfig,
    KVEvictionConfigError,
    config_from_additional,
    config_from_cli,
    help_text,
)
from vllm_kvevict.policies import POLICIES

_installed = False
# Set on EngineArgs built from the command line, where a mistake ends the
# process with one line instead of raising.
_CLI_MARK = "_kvevict_from_command_line"


def _fail(message: str) -> None:
    raise KVEvictionConfigError(message)


@contextlib.contextmanager
def _exit_on_command_line(from_command_line: bool) -> Iterator[None]:
    """On the command line, turn a config error into one line and exit code 2."""
    try:
        yield
    except KVEvictionConfigError as exc:
        if not from_command_line:
            raise
        print(f"vllm-kvevict: error: {exc}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def add_eviction_args(parser: argparse.ArgumentParser) -> None:
    if "--kv-eviction" in getattr(parser, "_option_string_actions", {}):
        return
    group = parser.add_argument_group(
        "KV-cache eviction (vllm-kvevict)",
        "Hold each request's KV cache to a budget by evicting tokens after each "
        "prefill chunk and every N decode steps; freed blocks return to vLLM's pool, "
        "so requests longer than the KV memory are admitted. Prefix caching is "
        "turned off (evicted blocks cannot be shared).",
    )
    try:
        group.add_argument(
            "--kv-eviction",
            dest="kv_eviction",
            choices=sorted(POLICIES),
            default=None,
            help="Eviction policy; enables eviction.",
        )
        group.add_argument(
            "--kv-eviction-config",
            dest="kv_eviction_config",
            default=None,
            metavar="JSON_OR_FILE",
            help="Eviction settings as inline JSON or a .json/.yaml file. Keys: "
            + help_text().replace("%", "%%"),
        )
    except argparse.ArgumentError:
        pass  # added by an earlier call on a parser that shares these actions


def _reject_incompatible_args(engine_args: Any) -> None:
    """Checks that need only the engine arguments, before the model is read."""
    if engine_args.enable_prefix_caching:
        _fail(
            "--kv-eviction cannot be combined with prefix caching (evicted blocks "
            "cannot be shared); drop --enable-prefix-caching",
        )
    if engine_args.speculative_config:
        _fail("--kv-eviction does not support speculative decoding yet; drop --speculative-config")
    if getattr(engine_args, "kv_cache_dtype", "auto") not in ("auto", None):
        _fail(
            "--kv-eviction does not support a quantized KV cache yet; drop --kv-cache-dtype",
        )
    if engine_args.kv_transfer_config:
        _fail("--kv-eviction cannot be combined with a KV connector; drop --kv-transfer-config")
    for name in ("decode_context_parallel_size", "prefill_context_parallel_size", "pipeline_parallel_size"):
        if (getattr(engine_args, name, 1) or 1) > 1:
            flag = "--" + name.replace("_", "-")
            _fail(f"--kv-eviction does not support {flag} > 1 yet; set {flag} 1")


def _reject_incompatible_model(vllm_config: Any) -> None:
    """Checks that need the resolved model and platform."""
    from vllm.platforms import current_platform

    model_config = vllm_config.model_config
    if not current_platform.is_cpu():
        _fail(
            "this release of vllm-kvevict serves on vLLM's CPU platform only (the GPU "
            "attention backend comes with its Triton kernels); run on a CPU build of vLLM",
        )
    if getattr(model_config, "use_mla", False):
        _fail("--kv-eviction does not support MLA models yet; serve this model without it")
    if model_config.get_sliding_window() is not None or getattr(
        model_config.hf_text_config, "layer_types", None
    ) and any("sliding" in str(t) for t in model_config.hf_text_config.layer_types):
        _fail(
            "--kv-eviction does not support sliding-window models yet; serve this "
            "model without it",
        )
    if model_config.is_hybrid or getattr(model_config, "is_encoder_decoder", False):
        _fail(
            "--kv-eviction supports decoder-only attention models; serve this model "
            "without it",
        )


def _install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.__dict__["from_cli_args"].__func__
    original_create = EngineArgs.create_engine_config

    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original_add(parser, *args, **kwargs)
        add_eviction_args(parser)
        return parser

    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original_from(cls, args)
        policy = getattr(args, "kv_eviction", None)
        source = getattr(args, "kv_eviction_config", None)
        if policy is None and source is None:
            return engine_args
        setattr(engine_args, _CLI_MARK, True)
        with _exit_on_command_line(True):
            config = config_from_cli(policy, source)
        assert config is not None
        engine_args.additional_config = {
            **(engine_args.additional_config or {}),
            ADDITIONAL_CONFIG_KEY: config.to_additional_config(),
        }
        return engine_args

    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _exit_on_command_line(getattr(self, _CLI_MARK, False)):
            config: EvictionConfig | None = config_from_additional(self.additional_config)
            if config is None:
                return original_create(self, *args, **kwargs)
            _reject_incompatible_args(self)
            self.enable_prefix_caching = False
            self.additional_config = {
                **self.additional_config,
                ADDITIONAL_CONFIG_KEY: config.to_additional_config(),
            }
            vllm_config = original_create(self, *args, **kwargs)
            _reject_incompatible_model(vllm_config)
            return vllm_config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config


def install_cli() -> None:
    global _installed
    if not _installed:
        _install()
        _installed = True
