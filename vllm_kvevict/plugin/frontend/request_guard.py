"""Front end: requests that eviction cannot serve, refused with vLLM's own
validation error (a 400 through the API server), before they reach the engine.

* Streaming-input (resumable) requests: vLLM appends input chunks to a
  running request, so its prompt grows while it runs. The eviction schedule
  places a request's points from its prompt length, which the scheduler and
  the workers must agree on for the request's whole life; a prompt that
  changes mid-request would have them free and read different blocks.
* Per-request eviction settings (``kv_eviction``, ``kv_eviction_budget`` in
  the request's extra arguments, :class:`~vllm_kvevict.request_settings.RequestEviction`)
  that are malformed or beyond what the server was provisioned for, or given
  to a server without eviction; and a ``kv_eviction: "off"`` request whose
  whole sequence (prompt + max_tokens) would not fit in the KV pool, which an
  evicting server may be smaller than its context length.

With eviction off nothing changes but the refusal of ``kv_eviction`` settings.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_kvevict.config import KVEvictionConfigError, config_from_additional
from vllm_kvevict.request_settings import REQUEST_KEY, RequestEviction

RESUMABLE_REFUSAL = (
    "streaming-input requests grow their prompt while they run, which KV-cache eviction "
    "(--kv-eviction) cannot follow; send the whole prompt in one request, or serve "
    "without --kv-eviction"
)

_installed = False  # the input processor is wrapped once per process


def check_request_eviction(vllm_config: Any, request: Any) -> None:
    """Refuse (:class:`KVEvictionConfigError`) the per-request eviction
    settings of a processed request (an ``EngineCoreRequest``) that the
    engine described by ``vllm_config`` cannot serve."""
    params = getattr(request, "sampling_params", None)
    settings = RequestEviction.from_extra_args(getattr(params, "extra_args", None))
    if settings.is_default:
        return
    settings.check(config_from_additional(vllm_config.additional_config), vllm_config.cache_config.block_size)
    if settings.off:
        cache = vllm_config.cache_config
        pool_tokens = (cache.num_gpu_blocks or 0) * (cache.block_size or 0)
        max_tokens = getattr(params, "max_tokens", None)
        if max_tokens is None:
            max_tokens = vllm_config.model_config.max_model_len - len(request.prompt_token_ids or ())
        needed = len(request.prompt_token_ids or ()) + max_tokens
        if pool_tokens and needed > pool_tokens:
            raise KVEvictionConfigError(
                f'{REQUEST_KEY} "off" keeps the whole sequence, and this one (prompt + max_tokens '
                f"= {needed} tokens) does not fit in the KV cache ({pool_tokens} tokens); lower "
                f"max_tokens or shorten the prompt, or let the request be evicted"
            )


def install_request_guard() -> None:
    global _installed
    if _installed:
        return
    from vllm.exceptions import VLLMValidationError
    from vllm.v1.engine.input_processor import InputProcessor

    process_inputs = InputProcessor.process_inputs

    @functools.wraps(process_inputs)
    def guarded(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("resumable") and config_from_additional(
            self.vllm_config.additional_config
        ) is not None:
            raise VLLMValidationError(RESUMABLE_REFUSAL, parameter="prompt")
        request = process_inputs(self, *args, **kwargs)
        try:
            check_request_eviction(self.vllm_config, request)
        except KVEvictionConfigError as exc:
            raise VLLMValidationError(str(exc), parameter="vllm_xargs") from None
        return request

    InputProcessor.process_inputs = guarded
    _installed = True
