"""Front end: requests that eviction cannot serve, refused with vLLM's own
validation error (a 400 through the API server), before they reach the engine.

* Streaming-input (resumable) requests: vLLM appends input chunks to a
  running request, so its prompt grows while it runs. The eviction schedule
  places a request's points from its prompt length, which the scheduler and
  the workers must agree on for the request's whole life; a prompt that
  changes mid-request would have them free and read different blocks.

With eviction off nothing changes.
"""

from __future__ import annotations

import functools
from typing import Any

from vllm_kvevict.config import config_from_additional

RESUMABLE_REFUSAL = (
    "streaming-input requests grow their prompt while they run, which KV-cache eviction "
    "(--kv-eviction) cannot follow; send the whole prompt in one request, or serve "
    "without --kv-eviction"
)

_installed = False


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
        return process_inputs(self, *args, **kwargs)

    InputProcessor.process_inputs = guarded
    _installed = True
