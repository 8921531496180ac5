"""Imported at start-up by every Python process the tests start (conftest.py
puts this folder on PYTHONPATH): vLLM's engines poll their shared-memory
message queues with short sleeps instead of spinning.

vLLM's multiprocessing executor, the only one its CPU build runs, has each
reader of a message queue (the engine core waiting for its worker's output,
the worker waiting for the next step) poll the queue in a loop of
``sched_yield`` calls for a second after its last message, and a busy
engine's messages come every few milliseconds: each engine then keeps a
second core busy while its worker computes on the first, and two engines of
the two pytest-xdist workers take four cores of two. Here each turn of that
loop sleeps :data:`POLL_SLEEP_S` instead: the same polling of the same
queue, a step's message seen at most that much later.

(A reader that waits on the queue's notification socket at once, vLLM's path
after a second without messages, does not do: a notification the reader
misses leaves it parked until its 5-second re-check, which stalled engines
mid-request.)

An engine whose vLLM no longer polls its queue with
``shm_broadcast.sched_yield`` stops at start-up, naming this file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import time

_QUEUE_MODULE = "vllm.distributed.device_communicators.shm_broadcast"
POLL_SLEEP_S = 0.0002


def _sleep_briefly() -> None:
    time.sleep(POLL_SLEEP_S)


def poll_with_sleeps(module) -> None:
    """Make ``module``'s queue polling sleep where it yields the processor."""
    if not callable(getattr(module, "sched_yield", None)) or not hasattr(module, "SpinCondition"):
        raise RuntimeError(
            f"{__file__}: vLLM's {_QUEUE_MODULE} no longer polls with sched_yield; "
            "update this file to the queue's new wait"
        )
    module.sched_yield = _sleep_briefly


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the queue module as the path finder would and patches it once run."""

    def find_spec(self, name, path, target=None):
        if name != _QUEUE_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            poll_with_sleeps(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
