"""CPU attention over per-(request, KV-head) page tables on vLLM's CPU KV cache.

Two implementations of one interface (:func:`head_paged_attention`):

* the C++ (OpenMP) kernel ``csrc/head_paged_attention.cpp``, JIT-built on first
  use by :func:`load_cpu_ops` with torch's extension loader;
* :func:`head_paged_attention_torch`, the same computation in torch
  (:func:`~vllm_kvevict.triton_kernels.head_paged_torch.attend_head_tokens`,
  which the reference runs too): the ``attention_kernel="torch"`` serving path
  and the fallback when the kernel cannot be built (no compiler, a failed
  build).

Both read one layer's cache ``kv_cache [num_blocks, H, 2 * page_size, D]``:
``num_blocks * H`` head-pages (``page = block * H + slot``), each a K page then
a V page. Compacted head-pages (``head_page_table``) hold their tokens in the
plain logical order (element ``(t, d)`` at ``t * D + d`` of the page);
standard-region pages (the request's ``block_table``) are in vLLM's ISA layout,
read through the probed offset tables of
:class:`~vllm_kvevict.plugin.backends.cpu.page_layout.PageLayout`. The batch
(:class:`~vllm_kvevict.triton_kernels.batch.HeadPagedBatch`) and the semantics
are those of
:func:`~vllm_kvevict.triton_kernels.head_paged_attention.head_paged_attention_reference`
on the logical cache.

The same extension copies a ``head_pages`` compaction's tokens, every KV
head in one call (``csrc/compact_head_pages.cpp``: :func:`gather_heads`,
:func:`write_heads`), and ranks a selection's rows (``csrc/select_top.cpp``:
``top_k_mask``, ``top_k_indices``, called by :mod:`vllm_kvevict.top_k`).

Also here, the other torch code of the CPU serving path:
:func:`region_attention` (``attention_kernel="torch"`` with ``slots``
storage).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import stat
import sys
import tempfile
import threading
import time
from importlib import resources
from pathlib import Path
from types import ModuleType
from typing import Iterator, NamedTuple

import torch

from vllm_kvevict.triton_kernels.batch import HeadPagedBatch
from vllm_kvevict.triton_kernels.head_paged_torch import attend_head_tokens

logger = logging.getLogger(__name__)

_EXTENSION_NAME = "kvevict_cpu_ops"
_SOURCE = "bindings.cpp"  # the module's Python bindings
_OTHER_SOURCES = ("head_paged_attention.cpp", "compact_head_pages.cpp", "select_top.cpp")  # beside it
_CFLAGS = ("-O3", "-march=native", "-fopenmp", "-DNDEBUG")
_LDFLAGS = ("-fopenmp",)
# The longest wait for another process's build of the same kernel, and the age
# past which a build directory left behind (a killed build) is removed.
BUILD_TIMEOUT_S = 600.0
_POLL_S = 0.2


class KernelStatus(NamedTuple):
    """Which implementation serves CPU head-paged attention, and why."""

    kernel: str  # "cpp" (the C++ extension) or "torch"
    reason: str


_lock = threading.Lock()
_loaded = False
_module: ModuleType | None = None
_status_reason = "the C++ kernel has not been loaded"


def kernel_status() -> KernelStatus:
    """``("cpp", where it was loaded from)`` once the C++ kernel serves, else
    ``("torch", why not)``: the build error, or that it was not loaded yet
    (``attention_kernel="torch"`` never loads it)."""
    return KernelStatus("cpp" if _module is not None else "torch", _status_reason)


def serving_kernel() -> str:
    """``"cpp"`` when the C++ extension is loaded, else ``"torch"``."""
    return kernel_status().kernel


def _cpu_fingerprint() -> str:
    """A short hash of what ``-march=native`` compiles for: builds are cached
    per CPU so that a cache directory shared between machines (a container
    image, a network home) never hands one CPU another's instructions."""
    text = platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key = line.split(":", 1)[0].strip()
                if key in ("flags", "Features", "model name", "CPU part"):
                    text += line
                if key in ("flags", "Features"):
                    break  # the first processor is enough
    except OSError:
        pass
    return hashlib.sha1(text.encode()).hexdigest()[:12]


def _sources(source: Path) -> list[Path]:
    """The extension's sources: ``source`` (the bindings) and the others beside it."""
    return [source, *(source.parent / name for name in _OTHER_SOURCES)]


def _source_key(source: Path) -> str:
    """A short hash of everything a build depends on besides the CPU: the
    kernel sources, the compiler flags, torch's and Python's versions."""
    digest = hashlib.sha1()
    for path in _sources(source):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    for part in (*_CFLAGS, *_LDFLAGS, torch.__version__, sys.implementation.cache_tag):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()[:12]


def _build_directory(source: Path) -> Path:
    """Where the finished build of ``source`` for this CPU lives:
    ``<cache>/torch_extensions/kvevict_cpu_ops-<cpu>-<source key>``, holding
    only the extension's shared object. Not created here."""
    from vllm_kvevict.paths import cache_dir

    name = f"{_EXTENSION_NAME}-{_cpu_fingerprint()}-{_source_key(source)}"
    return cache_dir() / "torch_extensions" / name


def _source_path() -> Path:
    # The sources ship as package data of vllm_kvevict.csrc (the repository's
    # csrc/ folder), so an installed (non-editable) package finds them too.
    return Path(str(resources.files("vllm_kvevict.csrc").joinpath(_SOURCE)))


# --------------------------------------------------------------------- build cache


def _not_private(path: Path) -> str | None:
    """Why ``path`` is unsafe to load code from (owned by another user, or
    writable by group or others), or None."""
    info = path.stat()
    if info.st_uid != os.geteuid():
        return f"{path} is owned by uid {info.st_uid}, not this user (uid {os.geteuid()})"
    if info.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {stat.S_IMODE(info.st_mode):o})"
    return None


def _private_directories(top: Path, leaf: Path) -> str | None:
    """Create ``top`` and each directory below it down to ``leaf`` (mode 0o700)
    where missing, and check every one of them; why one is unsafe or cannot
    be created (a read-only filesystem), or None."""
    levels = [top]
    for part in leaf.relative_to(top).parts:
        levels.append(levels[-1] / part)
    for level in levels:
        try:
            level.mkdir(mode=0o700, parents=level == top, exist_ok=True)
        except OSError as exc:
            return f"{level} cannot be created ({exc.strerror or exc})"
        problem = _not_private(level)
        if problem is not None:
            return problem
    return None


def _unsafe_build(final: Path) -> str | None:
    """Why the finished build directory ``final`` or its shared object is
    unsafe to load, or None (also when there is none yet)."""
    path = _find_extension(final)
    for item in (final, path):
        if item is not None and item.exists():
            problem = _not_private(item)
            if problem is not None:
                return problem
    return None


def _find_extension(directory: Path) -> Path | None:
    """The extension's shared object in a finished build directory, or None.

    torch names it after the module (``kvevict_cpu_ops.so``, or
    ``kvevict_cpu_ops_v<n>.so`` when one process built it more than once)."""
    try:
        found = sorted(directory.glob(f"{_EXTENSION_NAME}*.so"))
    except OSError:
        return None
    return next((path for path in found if path.stem.isidentifier()), None)


def _import_extension(path: Path) -> ModuleType:
    """Import a built extension's shared object directly (no build, no lock)."""
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, str(path), loader=loader)
    if spec is None:
        raise ImportError(f"cannot import the extension {path}")
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def _load_finished(final: Path) -> tuple[ModuleType, Path] | None:
    """The finished build in ``final`` and its path, imported, or None when
    there is none; raises if its shared object is not private to this user."""
    path = _find_extension(final)
    if path is None:
        return None
    problem = _not_private(path)
    if problem is not None:
        raise PermissionError(f"refusing to load {problem}")
    return _import_extension(path), path


@contextlib.contextmanager
def _build_turn(final: Path) -> Iterator[None]:
    """Wait, at most :data:`BUILD_TIMEOUT_S`, while another process builds
    ``final``; returns early once its build is there.

    The lock is an ``flock`` on ``<final>.lock``, which the system releases
    when its holder dies: a killed build never blocks a later start. A
    filesystem without ``flock`` just builds (the publishing rename is atomic)."""
    try:
        fd: int | None = os.open(f"{final}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    except OSError:
        fd = None
    try:
        if fd is not None:
            _wait_for_lock(fd, final)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _wait_for_lock(fd: int, final: Path) -> None:
    """Take the ``flock`` on ``fd``, giving up after :data:`BUILD_TIMEOUT_S`
    or as soon as ``final`` holds a finished build."""
    deadline = time.monotonic() + BUILD_TIMEOUT_S
    announced = False
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            pass
        except OSError:
            return  # no flock here
        if time.monotonic() >= deadline or _find_extension(final) is not None:
            return
        if not announced:
            logger.info("vllm-kvevict: waiting for another process building %s", final)
            announced = True
        time.sleep(_POLL_S)


def _remove_abandoned_builds(parent: Path) -> None:
    """Delete build directories of killed builds: private build directories
    (``*.build-*``) older than :data:`BUILD_TIMEOUT_S`."""
    cutoff = time.time() - BUILD_TIMEOUT_S
    for path in parent.glob(f"{_EXTENSION_NAME}-*.build-*"):
        try:
            if path.is_dir() and not path.is_symlink() and path.stat().st_mtime < cutoff:
                shutil.rmtree(path, ignore_errors=True)
        except OSError:
            pass


def _compile(source: Path, directory: Path) -> ModuleType:
    """Build ``source`` with torch's JIT loader in ``directory`` (which this
    process alone uses) and import it."""
    from torch.utils import cpp_extension

    return cpp_extension.load(
        name=_EXTENSION_NAME,
        sources=[str(path) for path in _sources(source)],
        extra_cflags=list(_CFLAGS),  # torch's loader appends to these lists
        extra_ldflags=list(_LDFLAGS),
        build_directory=str(directory),
        verbose=False,
    )


def _publish(staging: Path, final: Path) -> Path:
    """Move the shared object built in ``staging`` into ``final`` with one
    atomic rename; where another process published first, keep theirs. The
    path of the shared object now in ``final``."""
    built = _find_extension(staging)
    if built is None:
        raise FileNotFoundError(f"the build in {staging} produced no {_EXTENSION_NAME}*.so")
    out = staging / "out"
    out.mkdir(mode=0o700)
    os.chmod(built, 0o755)
    os.rename(built, out / built.name)
    if final.exists() and _find_extension(final) is None:
        _discard(final)  # not a finished build (e.g. emptied by hand)
    try:
        os.rename(out, final)
    except OSError:
        if _find_extension(final) is None:
            raise
    return _find_extension(final) or final


def _discard(directory: Path) -> None:
    """Rename ``directory`` aside (atomic), then delete it."""
    aside = Path(tempfile.mkdtemp(prefix=f"{directory.name}.build-", dir=directory.parent))
    try:
        os.rename(directory, aside / "old")
    except OSError:
        pass
    shutil.rmtree(aside, ignore_errors=True)


def _build_and_publish(source: Path, final: Path) -> tuple[ModuleType, str]:
    """Build in a private directory beside ``final``, then publish it there."""
    staging = Path(tempfile.mkdtemp(prefix=f"{final.name}.build-", dir=final.parent))
    try:
        module = _compile(source, staging)
        return module, f"built into {_publish(staging, final)}"
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _build_privately(source: Path) -> ModuleType:
    """Build in a fresh private temporary directory, removed once loaded."""
    staging = Path(tempfile.mkdtemp(prefix=f"{_EXTENSION_NAME}-"))
    try:
        return _compile(source, staging)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _load_or_build(source: Path) -> tuple[ModuleType, str]:
    """The extension and where it came from: the cached build when there is
    one, else a new build published to the cache (at most one process builds
    at a time). An unsafe cache directory is neither read nor written."""
    from vllm_kvevict.paths import cache_dir

    final = _build_directory(source)
    problem = _private_directories(cache_dir(), final.parent) or _unsafe_build(final)
    if problem is not None:
        logger.warning(
            "vllm-kvevict: not loading the C++ kernel from the cache: %s; building it in a "
            "private temporary directory instead, on every start until fixed. Fix: make "
            "that path this user's and `chmod go-w` it, or set KVEVICT_CACHE_DIR to a "
            "directory only this user can write",
            problem,
        )
        return _build_privately(source), f"built in a private temporary directory ({problem})"
    finished = _load_finished(final)
    if finished is None:
        with _build_turn(final):
            finished = _load_finished(final)
            if finished is None:
                _remove_abandoned_builds(final.parent)
                return _build_and_publish(source, final)
    return finished[0], f"loaded from {finished[1]}"


def load_cpu_ops() -> ModuleType | None:
    """The compiled extension, built on first use (cached on disk), or None.

    A finished build is imported directly, without a lock. Otherwise one
    process at a time builds it in a private directory and renames the result
    into the cache, so a build killed half-way leaves nothing a later start
    waits on. A missing compiler or a failed build logs one warning and gives
    None (callers fall back to :func:`head_paged_attention_torch`); the next
    start retries. :func:`kernel_status` says which implementation serves.
    """
    global _loaded, _module, _status_reason
    with _lock:
        if _loaded:
            return _module
        _loaded = True
        try:
            source = _source_path()
            for path in _sources(source):
                if not path.is_file():
                    raise FileNotFoundError(f"kernel source {path} is not installed")
            _module, _status_reason = _load_or_build(source)
        except Exception as exc:  # no compiler, no ninja, a compile error
            _module = None
            _status_reason = f"{type(exc).__name__}: {_reason(exc)}"
            logger.warning(
                "vllm-kvevict: the C++ CPU attention kernel is unavailable (%s); using the "
                "slower torch implementation. Fix the cause (a C++ compiler, ninja and the "
                "Python headers, e.g. Debian's g++ and python3-dev, are needed) and restart "
                "to retry the build",
                _status_reason,
            )
        return _module


def _reason(exc: BaseException) -> str:
    """The informative line of a build error: the compiler's first "error"
    line rather than ninja's closing "build stopped"."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line.lower()]
    return (errors or lines[-1:] or [repr(exc)])[0]


# --------------------------------------------------------------------- torch path


def region_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    region_start: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of one request's queries over its live region.

    Args:
        query: ``[T, Hq, D]``, the queries of the last ``T`` positions
            ``seq_len - T .. seq_len - 1`` where ``seq_len = region_start + S``.
        keys, values: ``[H, S, D]``, the tokens in slots
            ``[region_start, seq_len)``: the retained tokens (in original order)
            followed by the new ones at their true slots.

    A slot never holds a token later than its own index, and every retained
    token precedes every new one, so "slot <= query position" is exactly the
    causal mask. GQA: query head ``j`` reads KV head ``j // G``. Returns
    ``[T, Hq, D]`` in fp32.
    """
    num_tokens, num_q_heads, head_dim = query.shape
    num_kv_heads, length, _ = keys.shape
    group = num_q_heads // num_kv_heads
    seq_len = region_start + length
    q = query.float().reshape(num_tokens, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    logits = torch.einsum("hgtd,hsd->hgts", q, keys.float()) * scale
    key_slots = torch.arange(region_start, seq_len, device=query.device)
    query_positions = torch.arange(seq_len - num_tokens, seq_len, device=query.device)
    future = key_slots[None, :] > query_positions[:, None]  # [T, S]
    logits = logits.masked_fill(future, float("-inf"))
    out = torch.einsum("hgts,hsd->hgtd", torch.softmax(logits, dim=-1), values.float())
    return out.permute(2, 0, 1, 3).reshape(num_tokens, num_q_heads, head_dim)


def _head_rows(
    kv_cache: torch.Tensor,
    half: slice,
    offsets: torch.Tensor,
    head: int,
    pages: list[int],
    length: int,
    block_ids: list[int],
    region_start: int,
    seq_len: int,
) -> torch.Tensor:
    """One head's K (``half`` = first half of each head-page) or V rows of one
    request in the cache dtype, ``[length + seq_len - region_start, D]``: its
    compacted tokens (logical pages), then its standard slots (ISA pages read
    through ``offsets``)."""
    page_size, head_dim = kv_cache.shape[2] // 2, kv_cache.shape[3]
    parts: list[torch.Tensor] = []
    num_pages = -(-length // page_size)
    if num_pages:
        ids = torch.tensor(pages[:num_pages], dtype=torch.long)
        by_page = kv_cache.view(-1, 2 * page_size, head_dim)  # [NB * H, 2 * bs, D]
        parts.append(by_page[ids, half].reshape(-1, head_dim)[:length])
    if seq_len > region_start:
        first_block, last_block = region_start // page_size, (seq_len - 1) // page_size
        ids = torch.tensor(block_ids[first_block : last_block + 1], dtype=torch.long)
        isa = kv_cache[ids, head, half].reshape(ids.numel(), page_size * head_dim)
        logical = isa[:, offsets].reshape(-1, head_dim)
        lo = region_start - first_block * page_size
        parts.append(logical[lo : lo + seq_len - region_start])
    if not parts:
        return kv_cache.new_zeros(0, head_dim)
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def head_paged_attention_torch(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    key_offsets: torch.Tensor,
    value_offsets: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`head_paged_attention` in torch, one (request, KV head) at a time."""
    page_size = kv_cache.shape[2] // 2
    out, lse = _outputs(query, out, lse)
    out.zero_()
    lse.fill_(float("-inf"))
    key_half, value_half = slice(0, page_size), slice(page_size, 2 * page_size)
    key_index = key_offsets.to(torch.long)
    value_index = value_offsets.to(torch.long)
    tables = batch.head_page_table.tolist()
    blocks = batch.for_attention()[2].tolist()

    def read(r: int, h: int, length: int, start: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        args = (h, tables[r][h], length, blocks[r], start, seq_len)
        return (
            _head_rows(kv_cache, key_half, key_index, *args),
            _head_rows(kv_cache, value_half, value_index, *args),
        )

    attend_head_tokens(query, kv_cache.shape[1], batch, read, scale, out, lse)
    return out, lse


def _outputs(
    query: torch.Tensor, out: torch.Tensor | None, lse: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    num_tokens, num_q_heads, head_dim = query.shape
    if out is None:
        out = torch.empty(num_tokens, num_q_heads, head_dim, dtype=torch.float32)
    if lse is None:
        lse = torch.empty(num_tokens, num_q_heads, dtype=torch.float32)
    return out, lse


# --------------------------------------------------------------------- dispatch


def head_paged_attention(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    key_offsets: torch.Tensor,
    value_offsets: torch.Tensor,
    batch: HeadPagedBatch,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    native: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of every query over its KV head's compacted pages, causal
    standard region and evicted-token moments; ``(out [T, Hq, D], lse [T, Hq])``
    in fp32 (natural-log lse, ``0 / -inf`` for a head with nothing to read).

    Args:
        query: ``[T, Hq, D]`` (fp32, bf16 or fp16; the last dim contiguous).
        kv_cache: ``[num_blocks, H, 2 * page_size, D]``, one layer of vLLM's
            CPU cache (fp32, bf16 or fp16).
        key_offsets, value_offsets: ``[page_size * D]`` offset in a K (V) page
            of logical element ``(t, d)`` (``PageLayout.key_index`` /
            ``value_index``).
        batch: the requests' page tables, standard regions and moments (every
            attention field set).
        out, lse: optional preallocated fp32 outputs.
        native: use the C++ kernel when it is available.
    """
    module = load_cpu_ops() if native else None
    if module is None:
        return head_paged_attention_torch(
            query, kv_cache, key_offsets, value_offsets, batch, scale, out, lse
        )
    query_start_loc, seq_lens, block_table, region_start = batch.for_attention()
    out, lse = _outputs(query, out, lse)
    moments = batch.moments if batch.has_moments else None
    module.head_paged_attention(
        query,
        kv_cache.contiguous(),
        query_start_loc.contiguous(),
        seq_lens.contiguous(),
        batch.head_page_table.contiguous(),
        batch.head_lens.contiguous(),
        block_table.contiguous(),
        region_start.contiguous(),
        key_offsets.contiguous(),
        value_offsets.contiguous(),
        float(scale),
        moments.count if moments is not None else None,
        moments.key_mean if moments is not None else None,
        moments.value_mean if moments is not None else None,
        moments.cross_cov if moments is not None else None,
        batch.moment_rows.contiguous() if moments is not None else None,
        out,
        lse,
        batch.prefix_lens.contiguous() if batch.prefix_lens is not None else None,
    )
    return out, lse


# --------------------------------------------------------------- compaction copies


def gather_heads(
    module: ModuleType,
    kv_cache: torch.Tensor,
    head_pages: torch.Tensor,
    head_lens: torch.Tensor,
    block_row: torch.Tensor,
    start: int,
    end: int,
    key_offsets: torch.Tensor,
    value_offsets: torch.Tensor,
    longest: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every KV head's live tokens of one request, ``(keys, values)`` ``[H,
    max(head_lens) + end - start, D]`` in the cache's dtype: head ``h``'s
    ``head_lens[h]`` compacted tokens (its pages ``head_pages[h]``, logical
    order), then its standard slots ``[start, end)`` of ``block_row`` (vLLM's
    page layout, read through ``key_offsets`` / ``value_offsets``), then zeros
    (``longest``: ``max(head_lens)``, where the caller knows it).
    One call of the extension ``module`` (:func:`load_cpu_ops`)."""
    num_heads, head_dim = kv_cache.shape[1], kv_cache.shape[3]
    lens = head_lens.to(torch.int64)
    if longest is None:
        longest = int(lens.max()) if lens.numel() else 0
    width = longest + end - start
    keys = kv_cache.new_empty(num_heads, width, head_dim)
    values = kv_cache.new_empty(num_heads, width, head_dim)
    module.gather_heads(
        kv_cache, head_pages.to(torch.int32).contiguous(), lens.contiguous(),
        block_row.to(torch.int32).contiguous(), int(start), int(end),
        key_offsets, value_offsets, keys, values,
    )
    return keys, values


def write_heads(
    module: ModuleType,
    kv_cache: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    kept: torch.Tensor,
    counts: torch.Tensor,
    page_table: torch.Tensor,
) -> None:
    """Head ``h``'s rows ``kept[h, :counts[h]]`` of ``keys, values [H, S, D]``,
    in that order, into its head-pages ``page_table[h]`` (logical order; the
    rest of the last page zeroed), in place in ``kv_cache`` (contiguous: a copy
    would take the writes). One call of the extension ``module``."""
    module.write_heads(
        kv_cache, keys.contiguous(), values.contiguous(), kept.to(torch.int64).contiguous(),
        counts.to(torch.int64).contiguous(), page_table.to(torch.int32).contiguous(),
    )


__all__ = [
    "BUILD_TIMEOUT_S",
    "KernelStatus",
    "gather_heads",
    "head_paged_attention",
    "head_paged_attention_torch",
    "kernel_status",
    "load_cpu_ops",
    "region_attention",
    "serving_kernel",
    "write_heads",
]
