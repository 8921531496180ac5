"""Host reads and device work of the eviction engine, counted on any device.

On a GPU every read of a device value by the host waits for the device to
finish all the work queued before it (``.tolist()``, ``.item()``, ``int(t)``,
``bool(t)``, a slice bound taken from a tensor, ``nonzero``, a boolean-mask
index, a tensor built from Python data...), and every tensor op is at least
one kernel launch. torch reports the reads only on CUDA
(``torch.cuda.set_sync_debug_mode``); :func:`count_host_reads` counts both on
any device, so a test on CPU checks that an eviction step reads the host a
fixed number of times whatever its number of requests and KV heads.

It watches torch, not the engine, so code cannot hide a read from it: a
``TorchFunctionMode`` sees the reads that never reach the dispatcher on CPU
(``tolist``, ``numpy``, ``cpu``, and ``torch.tensor`` / ``torch.as_tensor``
of Python data, a blocking copy to the device), a ``TorchDispatchMode``
every aten op: the scalar reads (``_local_scalar_dense``, behind ``item``,
``int``, ``bool``, ``float`` and ``__index__``), the ops whose output size
depends on the data (``nonzero``, ``masked_select``, boolean-mask indexing,
``repeat_interleave`` without ``output_size``, ``unique``, ``bincount``), and
every other op that computes (not a view, not an allocation) as one launch.
Each event is charged to the innermost frame of this package that caused it
(``eviction/select.py:118``), or to ``outside`` (a test's own code).

    with count_host_reads() as reads:
        compact_head_pages(...)
    reads.syncs(), reads.launches(), print(reads.table())
"""

from __future__ import annotations

import os
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

PACKAGE_ROOT = Path(__file__).resolve().parent.parent
_THIS_FILE = str(Path(__file__).resolve())

SCALAR, HOST_COPY, UPLOAD, DATA_SIZED, LAUNCH = "scalar read", "host copy", "upload", "data-sized", "launch"
SYNC_KINDS = (SCALAR, HOST_COPY, UPLOAD, DATA_SIZED)

_HOST_COPIES = frozenset({"tolist", "numpy", "cpu"})
_UPLOADS = (torch.tensor, torch.as_tensor, torch.asarray)
_aten = torch.ops.aten
# Ops whose output's size is read back from the device before they return.
_DATA_SIZED = frozenset({
    _aten.nonzero.default, _aten.masked_select.default, _aten.unique_consecutive.default,
    _aten._unique.default, _aten._unique2.default, _aten.unique_dim.default, _aten.bincount.default,
    _aten.unique_dim_consecutive.default, _aten.argwhere.default,
})
_REPEAT_INTERLEAVE = frozenset({_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor})
_MASK_INDEXED = frozenset({_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default})
# Ops that allocate or relabel memory without a kernel.
_NO_KERNEL = frozenset({
    _aten.empty.memory_format, _aten.empty_strided.default, _aten.empty_like.default,
    _aten.new_empty.default, _aten.new_empty_strided.default, _aten.lift_fresh.default,
    _aten.resize_.default, _aten.set_.source_Storage_storage_offset, _aten.set_.source_Storage,
})


@dataclass
class HostReads:
    """What ran inside :func:`count_host_reads`: ``events[(kind, site)]``."""

    events: Counter[tuple[str, str]] = field(default_factory=Counter)
    _quiet: int = field(default=0, repr=False)  # > 0: inside a counted read or :meth:`one_launch`

    def syncs(self, where: Callable[[str], bool] = lambda site: True) -> int:
        """Host reads of device values at the sites ``where`` accepts (all by default)."""
        return sum(n for (kind, site), n in self.events.items() if kind in SYNC_KINDS and where(site))

    def launches(self, where: Callable[[str], bool] = lambda site: True) -> int:
        """Ops that compute (one kernel launch each, at least, on a GPU)."""
        return sum(n for (kind, site), n in self.events.items() if kind == LAUNCH and where(site))

    def sync_sites(self) -> Counter[str]:
        """Host reads by ``kind at site``."""
        return Counter({
            f"{kind} at {site}": n for (kind, site), n in self.events.items() if kind in SYNC_KINDS
        })

    @contextmanager
    def one_launch(self, name: str) -> Iterator[None]:
        """Count what runs inside as one launch named ``name`` and no host
        read: a device kernel's CPU stand-in (a Triton kernel's torch twin,
        run where the kernel cannot be)."""
        self.events[(LAUNCH, name)] += 1
        self._quiet += 1
        try:
            yield
        finally:
            self._quiet -= 1

    def table(self) -> str:
        """One line per host-reading site, most first."""
        return "\n".join(f"{n:6d}  {where}" for where, n in self.sync_sites().most_common())


def _site() -> str:
    """``path:line`` (relative to the package) of the innermost package frame
    on the stack outside this module, or ``outside``."""
    frame = sys._getframe(2)
    root = str(PACKAGE_ROOT) + os.sep
    while frame is not None:
        name = frame.f_code.co_filename
        if name.startswith(root) and name != _THIS_FILE:
            return f"{name[len(root):]}:{frame.f_lineno}"
        frame = frame.f_back
    return "outside"


def _mask_indexed(args: tuple[Any, ...]) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8) for index in indices
    )


class _FunctionReads(TorchFunctionMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        kind = None
        method_of = getattr(func, "__objclass__", None)
        if getattr(func, "__name__", "") in _HOST_COPIES and method_of is torch._C.TensorBase:
            kind = HOST_COPY
        elif func in _UPLOADS and args and not isinstance(args[0], torch.Tensor):
            kind = UPLOAD
        if kind is None or self.reads._quiet:
            return func(*args, **kwargs)
        self.reads.events[(kind, _site())] += 1
        self.reads._quiet += 1  # what it does below is this one read
        try:
            return func(*args, **kwargs)
        finally:
            self.reads._quiet -= 1


class _DispatchReads(TorchDispatchMode):
    def __init__(self, reads: HostReads) -> None:
        super().__init__()
        self.reads = reads

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        if not self.reads._quiet:
            kind = None
            if func is _aten._local_scalar_dense.default:
                kind = SCALAR
            elif func in _DATA_SIZED or (func in _MASK_INDEXED and _mask_indexed(args)):
                kind = DATA_SIZED
            elif func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
                kind = DATA_SIZED
            elif not func.is_view and func not in _NO_KERNEL:
                kind = LAUNCH
            if kind is not None:
                self.reads.events[(kind, _site())] += 1
        return func(*args, **kwargs)


@contextmanager
def count_host_reads() -> Iterator[HostReads]:
    """Count the host reads and launches of the torch code run inside."""
    reads = HostReads()
    with _FunctionReads(reads), _DispatchReads(reads):
        yield reads
