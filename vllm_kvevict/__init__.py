"""vllm-kvevict: KV-cache eviction for vLLM serving.

``register()`` is the ``vllm.general_plugins`` entry point. vLLM calls it in
every process it starts (API server or ``LLM()``, engine core, workers), once
per process, before arguments are parsed in ``vllm serve``.
"""

from __future__ import annotations

__version__ = "0.1.0"

CPU_BACKEND = "vllm_kvevict.vllm_glue.cpu_backend.KVEvictCPUBackend"

_registered = False


def register() -> None:
    global _registered
    if _registered:
        return
    from vllm_kvevict.vllm_glue import compat

    compat.check_vllm_version()
    compat.check_core_contract()

    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from vllm_kvevict.metrics import install_metrics_export
    from vllm_kvevict.vllm_glue.cli import install_cli
    from vllm_kvevict.vllm_glue.gate_capture import install_model_load_hook
    from vllm_kvevict.vllm_glue.spec import register_spec

    # The CPU platform ignores --attention-backend but resolves CPU_ATTN through
    # the override table; our backend behaves as vLLM's own when eviction is off.
    register_backend(AttentionBackendEnum.CPU_ATTN, CPU_BACKEND)
    register_spec()
    install_cli()
    install_metrics_export()
    install_model_load_hook()
    _registered = True
