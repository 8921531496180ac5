"""Worker side: which requests are in this step's batch.

vLLM's attention metadata carries lengths and block tables but neither request
ids, prompt lengths nor sampling parameters. All are needed: the prompt length
places the eviction points, the request id keys the per-request side buffers,
and the request's extra arguments (``SamplingParams.extra_args``, which the
model runner keeps from the request's first arrival, across preemption) carry
its own eviction settings. The V1 model
runner (the one vLLM's CPU platform uses) knows them; we wrap two of its
methods to publish them, only in worker processes and only once.

One more wrap fixes a vLLM 0.32 CPU crash that serving long prompts hits: a
seeded sampling request (``seed`` with temperature > 0) whose prompt takes
several steps samples a token at each partial-prefill step, discards it, and
rewinds its generator with ``Generator.set_offset``, which CPU generators do
not support ("CPU Generator does not use offset": the worker dies and takes
the engine with it). We restore the generator's state after a discarded
sample instead, which is what the rewind means, so a seeded request samples
the same text however its prompt was cut into steps.
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


_current: BatchContext | None = None
# Whether attention metadata is being built now, and for a real step.
_building: bool = False
_finished_listeners: list[Callable[[set[str]], None]] = []
_installed = False


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

    from vllm_kvevict.vllm_glue.compat import check_runner_contract

    check_runner_contract(GPUModelRunner)
    build_metadata = GPUModelRunner._build_attention_metadata
    update_states = GPUModelRunner._update_states
    sample = GPUModelRunner._sample
    bookkeeping_sync = GPUModelRunner._bookkeeping_sync

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

    def _discarded_cpu_generators(self: Any) -> dict[int, Any]:
        """Seeded CPU generators of the requests whose sample this step discards."""
        num_reqs = self.input_batch.num_reqs
        generators = self.input_batch.generators
        return {
            int(i): generators[int(i)]
            for i in np.nonzero(self.discard_request_mask.np[:num_reqs])[0]
            if int(i) in generators and generators[int(i)].device.type == "cpu"
        }

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: g.get_state() for i, g in self._discarded_cpu_generators().items()}
        output = sample(self, *args, **kwargs)
        generators = self.input_batch.generators
        for i, state in saved.items():
            generators[i].set_state(state)
        return output

    @functools.wraps(bookkeeping_sync)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Already rewound in _sample: hide them from the offset rewind.
        hidden = self._discarded_cpu_generators()
        generators = self.input_batch.generators
        for i in hidden:
            del generators[i]
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    GPUModelRunner._build_attention_metadata = _build_attention_metadata
    GPUModelRunner._update_states = _update_states
    GPUModelRunner._discarded_cpu_generators = _discarded_cpu_generators
    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    _installed = True


def _extra_args(state: Any) -> dict[str, Any] | None:
    """A request's ``SamplingParams.extra_args`` from the model runner's
    ``CachedRequestState`` (None for pooling requests and unknown ids)."""
    params = getattr(state, "sampling_params", None)
    return getattr(params, "extra_args", None)


_side_buffers_hooked = False


def install_side_buffer_hook() -> None:
    """Allocate KV eviction's side buffers when the worker's model runner
    reports its KV-cache specs: after the model is loaded and before vLLM
    measures memory to size the KV pool (``determine_available_memory``), so
    the pool is sized around them and a setting whose buffers do not fit
    stops start-up (:mod:`~vllm_kvevict.vllm_glue.side_buffers`)."""
    global _side_buffers_hooked
    if _side_buffers_hooked:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    get_kv_cache_spec = GPUModelRunner.get_kv_cache_spec

    @functools.wraps(get_kv_cache_spec)
    def _get_kv_cache_spec(self: Any) -> Any:
        specs = get_kv_cache_spec(self)
        from vllm_kvevict.vllm_glue.worker_state import preallocate_for_kv_cache_specs

        preallocate_for_kv_cache_specs(specs, self.vllm_config, self.device)
        return specs

    GPUModelRunner.get_kv_cache_spec = _get_kv_cache_spec
    _side_buffers_hooked = True
