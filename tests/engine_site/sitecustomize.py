"""Imported at start-up by every Python process the tests start (conftest.py
puts this folder on PYTHONPATH): vLLM's engines wait on their shared-memory
message queues without spinning.

vLLM's multiprocessing executor, the only one its CPU build runs, has each
reader of a message queue (the engine core waiting for its worker's output,
the worker waiting for the next step) spin on ``sched_yield`` for
``busy_loop_s`` (1 s) after its last message, and a busy engine's messages
come every few milliseconds: each engine then keeps a second core busy while
its worker computes on the first. Two engines of the two pytest-xdist workers
would take four cores of two. With ``busy_loop_s`` 0 a reader waits on the
queue's notification socket at once, the path vLLM itself takes after a
second without messages: the same messages, no spinning.

An engine whose vLLM no longer has ``SpinCondition(busy_loop_s=...)`` stops at
start-up, naming this file.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import inspect
import sys

_QUEUE_MODULE = "vllm.distributed.device_communicators.shm_broadcast"


def wait_without_spinning(module) -> None:
    """Make ``busy_loop_s`` 0 the default of ``module.SpinCondition``."""
    cls = getattr(module, "SpinCondition", None)
    if cls is None or "busy_loop_s" not in inspect.signature(cls.__init__).parameters:
        raise RuntimeError(
            f"{__file__}: vLLM's {_QUEUE_MODULE}.SpinCondition(busy_loop_s=...) is gone; "
            "update this file to the queue's new wait"
        )
    original = cls.__init__

    def __init__(self, *args, busy_loop_s: float = 0.0, **kwargs):
        original(self, *args, busy_loop_s=busy_loop_s, **kwargs)

    cls.__init__ = __init__


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
            wait_without_spinning(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchOnImport())
