"""Worker side: which requests are in this step's batch.

vLLM's attention metadata carries lengths and block tables but neither request
ids, prompt lengths nor sampling parameters. All are needed: the prompt length
places the eviction points, the request id keys the per-request side buffers,
and the request's extra arguments (``SamplingParams.extra_args``, which the
model runner keeps from the request's first arrival, across preemption) carry
its own eviction settings. The V1 model
runner (the one vLLM's CPU platform uses) knows them; we wrap two of its
methods to publish them, only in worker processes and only once.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np


@dataclass(frozen=True)
class BatchContext:
    """The requests of the batch being built, in batch order."""

    req_ids: list[str]
    prompt_lens: np.ndarray
    extra_args: list[dict[str, Any] | None] = field(default_factory=list)
    """Each request's ``SamplingParams.extra_args`` (empty: none known)."""


# Per worker process: one model runner builds one batch's metadata at a time,
# and the backends' builders read it during that call.
_current: BatchContext | None = None
# Whether attention metadata is being built now, and for a real step.
_building: bool = False
# Per worker process: the worker state and the isolation check, told of
# requests that ended.
_finished_listeners: list[Callable[[set[str]], None]] = []
_installed = False  # the model runner's methods are wrapped once per process


def current_batch() -> BatchContext | None:
    """The real batch being built now; None during vLLM's dummy/profile runs."""
    return _current


def building_dummy_run() -> bool:
    """Whether the metadata being built now is one of vLLM's dummy or
    profiling runs (the model runner said so: no per-request token counts)."""
    return _building and _current is None


def on_requests_finished(listener: Callable[[set[str]], None]) -> None:
    """Call ``listener(ids)`` when requests finish, are aborted or are preempted."""
    _finished_listeners.append(listener)


def install_runner_hooks() -> None:
    global _installed
    if _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    from vllm_kvevict.plugin.compat import check_runner_contract

    check_runner_contract(GPUModelRunner)
    build_metadata = GPUModelRunner._build_attention_metadata
    update_states = GPUModelRunner._update_states

    @functools.wraps(build_metadata)
    def _build_attention_metadata(self: Any, *args: Any, **kwargs: Any) -> Any:
        global _current, _building
        num_reqs = kwargs.get("num_reqs", args[1] if len(args) > 1 else None)
        # Real steps pass the scheduler's per-request token counts; dummy and
        # profiling runs do not, and must never evict.
        if kwargs.get("num_scheduled_tokens") is not None:
            batch = self.input_batch
            req_ids = list(batch.req_ids[:num_reqs])
            _current = BatchContext(
                req_ids=req_ids,
                prompt_lens=batch.num_prompt_tokens[:num_reqs].copy(),
                extra_args=[_extra_args(self.requests.get(req_id)) for req_id in req_ids],
            )
        else:
            _current = None
        _building = True
        try:
            return build_metadata(self, *args, **kwargs)
        finally:
            _current, _building = None, False

    @functools.wraps(update_states)
    def _update_states(self: Any, scheduler_output: Any) -> Any:
        # A preempted request loses all its blocks and starts over when it is
        # resumed: its side-buffer rows go back to the pool like a finished one's.
        finished = set(scheduler_output.finished_req_ids)
        finished.update(scheduler_output.preempted_req_ids or ())
        if finished:
            for listener in _finished_listeners:
                listener(finished)
        return update_states(self, scheduler_output)

    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._update_states = _update_states
    _installed = True


def _extra_args(state: Any) -> dict[str, Any] | None:
    """A request's ``SamplingParams.extra_args`` from the model runner's
    ``CachedRequestState`` (None for pooling requests and unknown ids)."""
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


_side_buffers_hooked = False  # wrapped once per process


def install_side_buffer_hook() -> None:
    """Allocate KV eviction's side buffers when the worker's model runner
    reports its KV-cache specs: after the model is loaded and before vLLM
    measures memory to size the KV pool (``determine_available_memory``), so
    the pool is sized around them and a setting whose buffers do not fit
    stops start-up (:mod:`~vllm_kvevict.plugin.worker.side_buffers`)."""
    global _side_buffers_hooked
    if _side_buffers_hooked:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    get_kv_cache_spec = GPUModelRunner.get_kv_cache_spec

    @functools.wraps(get_kv_cache_spec)
    def _get_kv_cache_spec(self: Any) -> Any:
        specs = get_kv_cache_spec(self)
        from vllm_kvevict.plugin.worker.worker_state import preallocate_for_kv_cache_specs

        preallocate_for_kv_cache_specs(specs, self.vllm_config, self.device)
        return specs

    GPUModelRunner.get_kv_cache_spec = _get_kv_cache_spec
    _side_buffers_hooked = True
