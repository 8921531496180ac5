"""Worker side: which requests are in this step's batch.

vLLM's attention metadata carries lengths and block tables but neither request
ids nor prompt lengths. Both are needed: the prompt length places the eviction
points, and the request id keys the per-request side buffers. The V1 model
runner (the one vLLM's CPU platform uses) knows them; we wrap two of its
methods to publish them, only in worker processes and only once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class BatchContext:
    """The requests of the batch being built, in batch order."""

    req_ids: list[str]
    prompt_lens: np.ndarray


_current: BatchContext | None = None
_finished_listeners: list[Callable[[set[str]], None]] = []
_installed = False


def current_batch() -> BatchContext | None:
    """The real batch being built now; None during vLLM's dummy/profile runs."""
    return _current


def on_requests_finished(listener: Callable[[set[str]], None]) -> None:
    _finished_listeners.append(listener)


def install_runner_hooks() -> None:
    global _installed
    if _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.vllm_glue.compat import check_runner_contract

    check_runner_contract(GPUModelRunner)
    build_metadata = GPUModelRunner._build_attention_metadata
    update_states = GPUModelRunner._update_states

    @functools.wraps(build_metadata)
    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _current
        num_reqs = kwargs.get("num_reqs", args[1] if len(args) > 1 else None)
        # Real steps pass the scheduler's per-request token counts; dummy and
        # profiling runs do not, and must never evict.
        if kwargs.get("num_scheduled_tokens") is not None:
            batch = self.input_batch
            _current = BatchContext(
                req_ids=list(batch.req_ids[:num_reqs]),
                prompt_lens=batch.num_prompt_tokens[:num_reqs].copy(),
            )
        else:
            _current = None
        try:
            return build_metadata(self, *args, **kwargs)
        finally:
            _current = None

    @functools.wraps(update_states)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        finished = set(scheduler_output.finished_req_ids)
        if finished:
            for listener in _finished_listeners:
                listener(finished)
        return update_states(self, scheduler_output)

    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._update_states = _update_states
    _installed = True
