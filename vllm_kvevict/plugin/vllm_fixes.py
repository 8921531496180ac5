"""Workarounds of vLLM bugs that eviction runs into, each installed once per
worker process, only where the plugin evicts.

* vLLM 0.32's CPU worker dies on a seeded sampling request (``seed`` with
  temperature > 0) whose prompt takes several steps, which serving long
  prompts with eviction does: the model runner samples a token at each
  partial-prefill step, discards it, and rewinds the request's generator with
  ``Generator.set_offset``, which CPU generators do not support ("CPU
  Generator does not use offset": the worker dies and takes the engine with
  it). :func:`install_cpu_seeded_sampling_fix` restores the generator's state
  after a discarded sample instead, which is what the rewind means, so a
  seeded request samples the same text however its prompt was cut into steps.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

_seeded_sampling_fixed = False  # wrapped once per process


def _discarded_cpu_generators(runner: Any) -> dict[int, Any]:
    """Seeded CPU generators of the requests whose sample this step discards."""
    num_reqs = runner.input_batch.num_reqs
    generators = runner.input_batch.generators
    return {
        int(i): generators[int(i)]
        for i in np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
        if int(i) in generators and generators[int(i)].device.type == "cpu"
    }


def install_cpu_seeded_sampling_fix() -> None:
    """Rewind a discarded sample's CPU generator by its saved state, not by
    ``set_offset`` (see the module's docstring)."""
    global _seeded_sampling_fixed
    if _seeded_sampling_fixed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    sample = GPUModelRunner._sample
    bookkeeping_sync = GPUModelRunner._bookkeeping_sync

    @functools.wraps(sample)
    def _sample(self: Any, *args: Any, **kwargs: Any) -> Any:
        saved = {i: g.get_state() for i, g in _discarded_cpu_generators(self).items()}
        output = sample(self, *args, **kwargs)
        generators = self.input_batch.generators
        for i, state in saved.items():
            generators[i].set_state(state)
        return output

    @functools.wraps(bookkeeping_sync)
    def _bookkeeping_sync(self: Any, *args: Any, **kwargs: Any) -> Any:
        # Already rewound in _sample: hide them from the offset rewind.
        hidden = _discarded_cpu_generators(self)
        generators = self.input_batch.generators
        for i in hidden:
            del generators[i]
        try:
            return bookkeeping_sync(self, *args, **kwargs)
        finally:
            generators.update(hidden)

    GPUModelRunner._sample = _sample
    GPUModelRunner._bookkeeping_sync = _bookkeeping_sync
    _seeded_sampling_fixed = True
