"""``vllm serve --kv-eviction POLICY [--kv-eviction-config JSON|FILE]``.

vLLM has no hook for plugin flags, so at plugin load we wrap three
``EngineArgs`` methods (checked in ``compat``):

* ``add_cli_args`` adds the two flags (idempotent: vLLM builds several parsers);
* ``from_cli_args`` turns them into ``additional_config["kv_eviction"]``, the
  field vLLM already carries to every process (``LLM(additional_config=...)``
  takes the same path);
* ``create_engine_config`` validates the eviction config against the rest of
  vLLM's configuration, for the CLI and for ``LLM()`` alike, turns prefix
  caching off unless the user forced it on, and applies the platform's rules
  (``eviction_platform_rules``: on CUDA our Triton backend, async scheduling
  off, the V1 model runner).

On the command line a mistake ends the process with one sentence naming the
fix (like argparse's own errors); in Python it raises ``KVEvictionConfigError``.

Where the plugin stays off (``compat.unsupported_reason``), ``install_refusal``
puts in only what refuses a request for eviction with the reason; everything
else reaches vLLM untouched.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm_kvevict.config import (
    ADDITIONAL_CONFIG_KEY,
    EvictionConfig,
    KVEvictionConfigError,
    config_from_additional,
    config_from_cli,
    help_text,
)

logger = logging.getLogger(__name__)

_installed = False  # the engine arguments are wrapped once per process
# Set on EngineArgs built from the command line, where a mistake ends the
# process with one line instead of raising.
_CLI_MARK = "_kvevict_from_command_line"
_warned_cuda = False  # the CUDA start-up warning, once per process

V2_RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
CUDA_STATUS_WARNING = (
    "vllm-kvevict: eviction on CUDA runs the Triton backend ({name}), served so far on "
    "an NVIDIA H200 with test models only, where its eviction steps cost more throughput "
    "than the memory they free gives back; see the Status section of vllm-kvevict's README"
)


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
    from vllm_kvevict.policies import POLICIES

    if "--kv-eviction" in getattr(parser, "_option_string_actions", {}):
        return
    group = parser.add_argument_group(
        "KV-cache eviction (vllm-kvevict)",
        "Hold each request's KV cache to a budget by evicting tokens at the prompt's "
        "end or after each prefill chunk (prefill_mode, by default the policy's) and "
        "every N decode steps; freed blocks return to vLLM's pool, "
        "so requests longer than the KV memory are admitted. Prefix caching is "
        "turned off (evicted blocks cannot be shared) unless prefix_caching is "
        "'shared', which protects each prompt's first blocks from eviction.",
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


def _reject_incompatible_args(engine_args: Any, prefix_caching: str = "off") -> None:
    """Checks that need only the engine arguments, before the model is read."""
    if engine_args.enable_prefix_caching and prefix_caching == "off":
        _fail(
            "--kv-eviction with prefix_caching 'off' turns prefix caching off (evicted "
            "blocks cannot be shared); drop --enable-prefix-caching, or set "
            "prefix_caching 'shared' to keep prompt prefixes cached",
        )
    if engine_args.enable_prefix_caching is False and prefix_caching == "shared":
        _fail(
            "prefix_caching 'shared' needs vLLM's prefix caching; drop --no-enable-prefix-caching "
            "or set prefix_caching 'off'",
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
    """Checks that need the resolved model."""
    model_config = vllm_config.model_config
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


def _check_settings_for_model(config: EvictionConfig, vllm_config: Any) -> None:
    """What the workers would otherwise find out at start-up, checked here so
    that it reads as one line: settings against the model's lengths and block
    size, and the learned policy's model support and gates."""
    max_model_len = vllm_config.model_config.max_model_len
    for name in ("budget", "observation_window"):
        value = getattr(config, name)
        if value > max_model_len:
            _fail(
                f"{name} {value} exceeds --max-model-len {max_model_len}: no request can "
                f"reach it; set {name} to at most {max_model_len}"
            )
    block_size = vllm_config.cache_config.block_size
    if block_size:
        config.check_block_size(block_size)
    if config.policy == "learned":
        _check_learned(config, vllm_config)


def _check_learned(config: EvictionConfig, vllm_config: Any) -> None:
    from vllm_kvevict.policies.gate_checkpoints import GateCheckpointError, gates_for_model
    from vllm_kvevict.plugin.gate_models import SUPPORTED_ARCHITECTURES, unsupported_architecture

    model_config = vllm_config.model_config
    architectures = list(getattr(model_config, "architectures", None) or [])
    if not set(architectures) & set(SUPPORTED_ARCHITECTURES):
        _fail(unsupported_architecture(', '.join(architectures) or 'this model'))
    hf = model_config.hf_text_config
    try:
        gates_for_model(
            config.build_policy().gates, hf.hidden_size, hf.num_hidden_layers,
            model_config.get_total_num_kv_heads(), str(model_config.model),
        )
    except GateCheckpointError as exc:
        _fail(str(exc))


@dataclass(frozen=True)
class PlatformChanges:
    """What eviction changes in vLLM's settings on a platform."""

    attention_backend: str | None = None  # EngineArgs.attention_backend to set
    async_scheduling_off: bool = False  # set EngineArgs.async_scheduling = False
    environ: dict[str, str] = field(default_factory=dict)  # before the engine config exists
    warning: str | None = None  # logged once per process


def _backend_name(value: Any) -> str | None:
    """An attention backend as given (None, "auto", a name in any case, an
    ``AttentionBackendEnum`` member) -> its upper-case name, None for automatic."""
    if value is None:
        return None
    name = str(getattr(value, "name", value)).upper()
    return None if name == "AUTO" else name


def _cuda_graphs_on(engine_args: Any) -> bool:
    """Whether vLLM will capture CUDA graphs: not with ``--enforce-eager`` or
    ``cudagraph_mode`` NONE (``-cc.cudagraph_mode=NONE``)."""
    if getattr(engine_args, "enforce_eager", False):
        return False
    compilation = getattr(engine_args, "compilation_config", None)
    mode = compilation.get("cudagraph_mode") if isinstance(compilation, dict) else getattr(
        compilation, "cudagraph_mode", None)
    return mode is None or str(getattr(mode, "name", mode)).upper() != "NONE"


def _triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def eviction_platform_rules(
    platform: str, engine_args: Any, config: Any, environ: Mapping[str, str]
) -> PlatformChanges:
    """The platform's rules for serving with eviction, or a ``KVEvictionConfigError``
    naming the fix where the user's settings conflict with them.

    ``platform``: ``compat.platform_name()``; ``engine_args``: ``EngineArgs`` or
    anything with its fields; ``config``: the ``EvictionConfig``; ``environ``: the
    process's environment (read only: the changes say what to set).
    """
    from vllm_kvevict.backend_name import GPU_BACKEND_NAME
    from vllm_kvevict.plugin.compat import VLLMContractError, check_platform

    if platform not in ("cpu", "cuda"):
        try:
            check_platform(platform)
        except VLLMContractError as exc:
            _fail(str(exc))
    kernel = config.attention_kernel
    if (kernel == "triton" or (kernel == "auto" and platform == "cuda")) and not _triton_importable():
        _fail("eviction's Triton kernels need Triton; pip install triton")
    if platform == "cpu":
        if kernel == "triton" and environ.get("TRITON_INTERPRET") != "1":
            _fail(
                "attention_kernel 'triton' on CPU runs Triton's interpreter: start vLLM "
                "with TRITON_INTERPRET=1 in its environment (it must be set before Triton "
                "is imported)",
            )
        return PlatformChanges()
    if kernel not in ("auto", "triton"):
        _fail(
            f"attention_kernel '{kernel}' runs on CPU only (native and torch are CPU "
            "kernels); use 'auto' or 'triton' on CUDA",
        )
    attention_config = getattr(engine_args, "attention_config", None)
    chosen = _backend_name(getattr(engine_args, "attention_backend", None))
    configured = _backend_name(getattr(attention_config, "backend", None))
    for given, flag in ((chosen, "--attention-backend"), (configured, "--attention-config's backend")):
        if given not in (None, GPU_BACKEND_NAME):
            _fail(
                f"--kv-eviction on CUDA runs its own attention backend ({GPU_BACKEND_NAME}); "
                f"drop {flag} {given}",
            )
    per_kind = {k: _backend_name(v) for k, v in (getattr(attention_config, "backend_per_kind", None) or {}).items()}
    if any(v != GPU_BACKEND_NAME for v in per_kind.values()):
        _fail(
            f"--kv-eviction on CUDA runs its own attention backend ({GPU_BACKEND_NAME}); "
            "drop backend_per_kind from --attention-config",
        )
    if getattr(engine_args, "async_scheduling", None):
        _fail(
            "--kv-eviction runs without async scheduling on CUDA; drop --async-scheduling",
        )
    v2 = environ.get(V2_RUNNER_ENV, "").strip()
    if v2 not in ("", "0"):
        _fail(
            f"--kv-eviction on CUDA hooks vLLM's V1 model runner; unset {V2_RUNNER_ENV} "
            f"(it is {v2!r}) or set it to 0",
        )
    if getattr(engine_args, "watermark_config", None) is not None:
        _fail(
            "--kv-eviction on CUDA hooks vLLM's V1 model runner and watermarking needs "
            "the V2 runner; drop --watermark-config",
        )
    if getattr(config, "policy", None) == "learned" and _cuda_graphs_on(engine_args):
        # The gates' custom op runs inside a captured piece, whose replays
        # skip its Python body: no gate input reaches attention.
        _fail(
            "policy 'learned' on CUDA runs without CUDA graphs (its retention gates run "
            "between the model's layers, where graph replays skip them); add --enforce-eager "
            "or -cc.cudagraph_mode=NONE",
        )
    if getattr(attention_config, "hisparse_config", None) is not None:
        _fail(
            "--kv-eviction on CUDA hooks vLLM's V1 model runner and HiSparse needs "
            "the V2 runner; drop hisparse_config from --attention-config",
        )
    return PlatformChanges(
        # Through the flag, not attention_config, which vLLM keeps mutually exclusive.
        attention_backend=GPU_BACKEND_NAME if configured is None else None,
        async_scheduling_off=True,
        environ={V2_RUNNER_ENV: "0"},
        warning=CUDA_STATUS_WARNING.format(name=GPU_BACKEND_NAME),
    )


def apply_platform_changes(engine_args: Any, changes: PlatformChanges) -> None:
    """Make ``changes`` to ``engine_args`` and to this process's environment
    (inherited by the engine and worker processes it starts)."""
    global _warned_cuda
    if changes.attention_backend is not None:
        engine_args.attention_backend = changes.attention_backend
    if changes.async_scheduling_off:
        engine_args.async_scheduling = False
    if changes.environ:
        os.environ.update(changes.environ)
        try:  # vLLM caches its environment once an engine has started in this process
            from vllm import envs

            if envs._is_envs_cache_enabled():
                envs.disable_envs_cache()
        except Exception:  # noqa: BLE001 - no cache to clear in this vLLM
            pass
    if changes.warning and not _warned_cuda:
        _warned_cuda = True
        logger.warning(changes.warning)


def _install() -> None:
    from vllm.engine.arg_utils import EngineArgs

    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.__dict__["from_cli_args"].__func__
    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_add)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original_add(parser, *args, **kwargs)
        add_eviction_args(parser)
        return parser

    @functools.wraps(original_from)
    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        engine_args = original_from(cls, args)
        # --additional-config '{"kv_eviction": ...}' gets the command line's one-line errors too.
        setattr(engine_args, _CLI_MARK, True)
        policy = getattr(args, "kv_eviction", None)
        source = getattr(args, "kv_eviction_config", None)
        if policy is None and source is None:
            return engine_args
        with _exit_on_command_line(True):
            config = config_from_cli(policy, source)
        assert config is not None
        engine_args.additional_config = {
            **(engine_args.additional_config or {}),
            ADDITIONAL_CONFIG_KEY: config.to_additional_config(),
        }
        return engine_args

    @functools.wraps(original_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        with _exit_on_command_line(getattr(self, _CLI_MARK, False)):
            config: EvictionConfig | None = config_from_additional(self.additional_config)
            if config is None:
                return original_create(self, *args, **kwargs)
            _reject_incompatible_args(self, config.prefix_caching)
            from vllm_kvevict.plugin.compat import platform_name

            changes = eviction_platform_rules(platform_name(), self, config, os.environ)
            apply_platform_changes(self, changes)
            self.enable_prefix_caching = config.prefix_caching == "shared"
            self.additional_config = {
                **self.additional_config,
                ADDITIONAL_CONFIG_KEY: config.to_additional_config(),
            }
            vllm_config = original_create(self, *args, **kwargs)
            _reject_incompatible_model(vllm_config)
            _check_settings_for_model(config, vllm_config)
            return vllm_config

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config


def install_cli() -> None:
    global _installed
    if not _installed:
        _install()
        _installed = True


def _eviction_requested(additional_config: Any) -> bool:
    return isinstance(additional_config, Mapping) and ADDITIONAL_CONFIG_KEY in additional_config


def install_refusal(reason: str) -> None:
    """The plugin is off (``reason``: why, naming the fix): the two flags still
    parse, and a request for eviction, from them or from ``additional_config``,
    stops start-up with the reason; nothing else changes. Installed once."""
    global _installed
    if _installed:
        return
    from vllm.engine.arg_utils import EngineArgs

    message = f"KV-cache eviction is unavailable: {reason}"
    original_add = EngineArgs.add_cli_args
    original_from = EngineArgs.__dict__["from_cli_args"].__func__
    original_create = EngineArgs.create_engine_config

    @functools.wraps(original_add)
    def add_cli_args(parser: Any, *args: Any, **kwargs: Any) -> Any:
        parser = original_add(parser, *args, **kwargs)
        if "--kv-eviction" not in getattr(parser, "_option_string_actions", {}):
            with contextlib.suppress(argparse.ArgumentError):
                refused = "Refused. " + message.replace("%", "%%")
                group = parser.add_argument_group("KV-cache eviction (vllm-kvevict, off)")
                group.add_argument("--kv-eviction", dest="kv_eviction", default=None, help=refused)
                group.add_argument(
                    "--kv-eviction-config", dest="kv_eviction_config", default=None,
                    metavar="JSON_OR_FILE", help=refused,
                )
        return parser

    @functools.wraps(original_from)
    def from_cli_args(cls: type, args: argparse.Namespace) -> Any:
        if getattr(args, "kv_eviction", None) is not None or getattr(args, "kv_eviction_config", None) is not None:
            with _exit_on_command_line(True):
                _fail(message)
        engine_args = original_from(cls, args)
        setattr(engine_args, _CLI_MARK, True)
        return engine_args

    @functools.wraps(original_create)
    def create_engine_config(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _eviction_requested(getattr(self, "additional_config", None)):
            with _exit_on_command_line(getattr(self, _CLI_MARK, False)):
                _fail(message)
        return original_create(self, *args, **kwargs)

    EngineArgs.add_cli_args = staticmethod(add_cli_args)
    EngineArgs.from_cli_args = classmethod(from_cli_args)
    EngineArgs.create_engine_config = create_engine_config
    _installed = True
