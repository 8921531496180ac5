"""vllm-kvevict: KV-cache eviction for vLLM serving.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process it starts (API server or ``LLM()``, engine core, workers), once
per process, before arguments are parsed in ``vllm serve``, and without
catching what it raises: an exception here would stop every ``vllm`` command.
So on a vLLM version, platform or set of internals the plugin was not made for
(``compat.unsupported_reason``) it logs one warning and stays off: no backend,
no spec, vLLM serves as without it, and only a request for eviction
(``--kv-eviction``, ``--kv-eviction-config``, ``additional_config["kv_eviction"]``)
stops start-up, with the reason.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_kvevict.backend_name import GPU_BACKEND_NAME

__version__ = "0.1.0"

CPU_BACKEND = "vllm_kvevict.plugin.backends.cpu.backend.KVEvictCPUBackend"
# On CUDA the backend is a new AttentionBackendEnum member, GPU_BACKEND_NAME.
GPU_BACKEND = "vllm_kvevict.plugin.backends.triton.backend.KVEvictTritonBackend"

# Set in the environment once the off warning is logged, so the engine and
# worker processes a server starts (which inherit it) do not repeat it.
_OFF_WARNED_ENV = "_KVEVICT_OFF_WARNED"

logger = logging.getLogger(__name__)

_registered = False
# Why the plugin is off in this process (None: on, or register() not run).
off_reason: str | None = None


def register() -> None:
    global _registered, off_reason
    if _registered:
        return
    _registered = True
    from vllm_kvevict.plugin import compat

    reason = compat.unsupported_reason()
    if reason is not None:
        off_reason = reason
        _stay_off(reason)
        return

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm_kvevict.metrics import install_metrics_export
    from vllm_kvevict.plugin.frontend.cli import install_cli
    from vllm_kvevict.plugin.worker.gate_capture import install_model_load_hook
    from vllm_kvevict.plugin.worker.runner_hooks import install_side_buffer_hook
    from vllm_kvevict.plugin.frontend.request_guard import install_request_guard
    from vllm_kvevict.plugin.scheduler.manager import register_spec

    if compat.platform_name() == "cuda":
        gpu_backend_member()
    else:
        # The CPU platform ignores --attention-backend but resolves CPU_ATTN through
        # the override table; our backend behaves as vLLM's own when eviction is off.
        register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_spec()
    install_cli()
    install_metrics_export()
    install_model_load_hook()
    install_side_buffer_hook()
    install_request_guard()


def gpu_backend_member() -> Any:
    """The ``AttentionBackendEnum`` member of the CUDA backend, created on first use.

    An enum member pickles by value, and vLLM's engine core, when spawned rather
    than forked (Ray, WSL, CUDA already initialised), unpickles its config before
    it loads plugins: a member made at run time would not exist there yet. Ours
    pickles as a call to this function instead, which makes it in that process.
    """
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    if GPU_BACKEND_NAME in AttentionBackendEnum.__members__:
        member = AttentionBackendEnum[GPU_BACKEND_NAME]
        register_backend(member, GPU_BACKEND)
    else:
        register_backend(GPU_BACKEND_NAME, GPU_BACKEND)
        member = AttentionBackendEnum[GPU_BACKEND_NAME]
        member.__reduce_ex__ = _reduce_gpu_backend_member
    return member


def _reduce_gpu_backend_member(protocol: int) -> tuple:
    return gpu_backend_member, ()


def _stay_off(reason: str) -> None:
    """Log the one warning and install the hooks that refuse eviction requests;
    where even those do not fit this vLLM, the warning stands alone."""
    if os.environ.get(_OFF_WARNED_ENV) != "1":
        os.environ[_OFF_WARNED_ENV] = "1"
        logger.warning(
            "vllm-kvevict is off and vLLM runs without KV-cache eviction: %s. "
            "--kv-eviction and additional_config['kv_eviction'] are refused.",
            reason,
        )
    try:
        from vllm_kvevict.plugin.frontend.cli import install_refusal

        install_refusal(reason)
    except Exception:  # noqa: BLE001 - vLLM changed beyond the hooks too
        pass
