"""Worker side: how much memory the per-request side buffers take, and when
they are allocated.

Beside the KV cache each evicting worker keeps, per request row (one for
each of ``--max-num-seqs`` sequences), per layer and per KV head:

* ``positions``: the original position of every token a head can hold after
  an eviction (int32), on every policy;
* ``query ring``: the last ``observation_window`` post-RoPE queries of every
  query head, in the model's dtype, on query-based policies;
* ``page tables``: each head's head-page ids and its token count (int32),
  plus each row's standard-region start (int64), with ``head_pages`` storage;
* ``moments``: MomentKV's evicted-token statistics (fp32 count, key and value
  means, value-key covariance of ``D x D``, ``D`` or no values), with
  ``moment_correction``;
* ``log β``: one fp32 per token slot of the whole KV pool and KV head, when
  layers are pooled (``head_budget`` global or pyramid).

:func:`side_buffer_bytes` is that formula. All rows are allocated once, when
the worker reports its KV-cache specs (after the model is loaded, before vLLM
measures memory to size the KV pool), so vLLM sizes the pool around them and
a setting whose buffers cannot be allocated stops start-up with
:func:`allocation_error`'s one line instead of failing mid-run. The log β
pages are the exception: they follow the pool's size, which vLLM decides by
measuring, so they are allocated when the pool's block count is known,
just before the pool itself.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from vllm_kvevict.config import EvictionConfig, KVEvictionConfigError
from vllm_kvevict.moments import Covariance

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec

POSITION_DTYPE = torch.int32
PAGE_DTYPE = torch.int32
REGION_START_DTYPE = torch.int64
MOMENT_DTYPE = torch.float32
LOG_BETA_DTYPE = torch.float32


def moment_values_per_head(head_dim: int, covariance: Covariance) -> int:
    """fp32 values of one head's MomentKV statistics: count, key mean, value
    mean and the value-key covariance (``D x D``, its diagonal, or none)."""
    covariance_values = {"full": head_dim * head_dim, "diagonal": head_dim, "none": 0}[covariance]
    return 1 + 2 * head_dim + covariance_values


def side_buffer_terms(
    num_layers: int,
    num_kv_heads: int,
    num_q_heads: int,
    head_dim: int,
    rows: int,
    retained_capacity: int,
    query_window: int,
    query_dtype: torch.dtype,
    max_head_pages: int = 0,
    moment_correction: bool = False,
    moment_covariance: Covariance = "full",
    pool_slots: int = 0,
) -> dict[str, int]:
    """Bytes of each side buffer of one worker (one tensor-parallel rank).

    ``L`` layers, ``H`` KV heads and ``Hq`` query heads of this rank, head
    size ``D``, ``rows`` request rows (``--max-num-seqs``), ``C`` =
    ``retained_capacity`` tokens a head can hold after an eviction, ``W`` =
    ``query_window`` (0 for policies that read no queries), ``P`` =
    ``max_head_pages`` (0 without head_pages storage):

    * positions: ``L x rows x H x C x 4``;
    * query_ring: ``L x rows x W x Hq x D x bytes(query_dtype)``;
    * page_tables: ``L x rows x H x (P + 1) x 4 + rows x 8`` (page ids, token
      counts, standard-region starts), with head_pages storage;
    * moments: ``L x rows x H x (1 + 2D + D², 3D or 0 more) x 4``, with the
      MomentKV correction (on head_pages storage);
    * log_beta: ``pool_slots x H x 4``, where ``pool_slots`` is the KV pool's
      token slots over every layer (blocks x layers x block size), when
      layers are pooled.
    """
    streams = num_layers * rows * num_kv_heads
    head_paged = max_head_pages > 0
    moment_values = moment_values_per_head(head_dim, moment_covariance)
    return {
        "positions": streams * retained_capacity * POSITION_DTYPE.itemsize,
        "query_ring": num_layers * rows * query_window * num_q_heads * head_dim * query_dtype.itemsize,
        "page_tables": (
            streams * (max_head_pages + 1) * PAGE_DTYPE.itemsize + rows * REGION_START_DTYPE.itemsize
            if head_paged else 0
        ),
        "moments": (
            streams * moment_values * MOMENT_DTYPE.itemsize if head_paged and moment_correction else 0
        ),
        "log_beta": pool_slots * num_kv_heads * LOG_BETA_DTYPE.itemsize,
    }


def side_buffer_bytes(*args: Any, **kwargs: Any) -> int:
    """Total bytes of one worker's side buffers: the sum of
    :func:`side_buffer_terms` (same arguments)."""
    return sum(side_buffer_terms(*args, **kwargs).values())


@dataclass(frozen=True)
class SideBufferLayout:
    """The shapes of one worker's per-request side buffers (all but log β)."""

    num_layers: int
    num_kv_heads: int
    num_q_heads: int
    head_dim: int
    rows: int
    retained_capacity: int
    query_window: int
    query_dtype: torch.dtype
    max_head_pages: int = 0
    moment_correction: bool = False
    moment_covariance: Covariance = "full"

    def terms(self) -> dict[str, int]:
        return side_buffer_terms(
            self.num_layers, self.num_kv_heads, self.num_q_heads, self.head_dim, self.rows,
            self.retained_capacity, self.query_window, self.query_dtype, self.max_head_pages,
            self.moment_correction, self.moment_covariance,
        )

    @property
    def nbytes(self) -> int:
        return sum(self.terms().values())

    def describe_terms(self) -> str:
        """The formula's non-zero terms with this layout's numbers."""
        L, rows, H = self.num_layers, self.rows, self.num_kv_heads
        head = f"{L} layers x {rows} rows x {H} KV heads"
        terms = self.terms()
        text = {
            "positions": f"positions {head} x {self.retained_capacity} tokens x 4 B",
            "query_ring": (
                f"query ring {L} layers x {rows} rows x {self.query_window} queries x "
                f"{self.num_q_heads} query heads x {self.head_dim} x {self.query_dtype.itemsize} B"
            ),
            "page_tables": f"page tables {head} x {self.max_head_pages + 1} x 4 B",
            "moments": (
                f"moments {head} x "
                f"{moment_values_per_head(self.head_dim, self.moment_covariance)} x 4 B"
            ),
        }
        return ", ".join(
            f"{text[name]} = {format_bytes(size)}" for name, size in terms.items() if size and name in text
        )


def side_buffer_layout(
    config: EvictionConfig,
    spec: EvictingAttentionSpec,
    num_layers: int,
    num_q_heads: int,
    vllm_config: VllmConfig,
) -> SideBufferLayout:
    """The side buffers one worker needs for ``num_layers`` evicting layers
    of ``spec`` (this rank's KV heads) and ``num_q_heads`` query heads, with a
    row for each of ``--max-num-seqs`` sequences."""
    schedule = spec.schedule
    max_head_pages = 0
    if config.uses_head_pages:
        # After an eviction a request's compacted tokens fill the blocks
        # [F, P // bs); one head may take every head-page they hold (with
        # pooled layers, those of every layer, but never more than a whole
        # sequence).
        streams = spec.num_kv_heads * (num_layers if config.pools_layers else 1)
        max_model_len = vllm_config.model_config.max_model_len if config.pools_layers else None
        max_head_pages = schedule.max_head_pages(streams, max_model_len)
    return SideBufferLayout(
        num_layers=num_layers,
        num_kv_heads=spec.num_kv_heads,
        num_q_heads=num_q_heads,
        head_dim=spec.head_size,
        rows=vllm_config.scheduler_config.max_num_seqs,
        retained_capacity=schedule.retained_capacity(max_head_pages),
        query_window=config.observation_window if config.build_policy().needs_queries else 0,
        query_dtype=vllm_config.model_config.dtype,
        max_head_pages=max_head_pages,
        moment_correction=config.moment_correction,
        moment_covariance=config.moment_covariance,
    )


def format_bytes(size: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}"
    return f"{size} B"


def allocation_error(layout: SideBufferLayout, device: torch.device, reason: str) -> KVEvictionConfigError:
    """The one-line start-up error for side buffers that do not fit."""
    fixes = ["budget"] + (["observation_window"] if layout.query_window else []) + ["--max-num-seqs"]
    return KVEvictionConfigError(
        f"KV eviction's side buffers need {format_bytes(layout.nbytes)} ({layout.nbytes} bytes) "
        f"on {device} for {layout.rows} sequences (--max-num-seqs) and could not be allocated "
        f"({reason}): {layout.describe_terms()}; lower {', '.join(fixes[:-1])} or {fixes[-1]}"
    )


def log_beta_error(
    nbytes: int, pool_slots: int, num_kv_heads: int, device: torch.device, reason: str
) -> KVEvictionConfigError:
    """The one-line start-up error for log β pages that do not fit."""
    return KVEvictionConfigError(
        f"pooled-layer eviction keeps one fp32 log β per KV-pool slot and KV head: "
        f"{pool_slots} slots x {num_kv_heads} KV heads x 4 B = {format_bytes(nbytes)} "
        f"({nbytes} bytes) on {device}, which could not be allocated ({reason}); "
        "give the KV cache less memory (--gpu-memory-utilization or --kv-cache-memory-bytes)"
    )


def _is_allocation_failure(exc: BaseException) -> bool:
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    message = str(exc)
    return isinstance(exc, RuntimeError) and ("can't allocate" in message or "out of memory" in message)


def host_memory_available() -> int:
    """Bytes the host can still give this process without swapping."""
    import psutil

    return int(psutil.virtual_memory().available)


@contextlib.contextmanager
def allocating(nbytes: int, device: torch.device, error: Any) -> Iterator[None]:
    """Run an allocation of ``nbytes`` on ``device``; ``error(reason)`` (a
    :class:`KVEvictionConfigError`) is raised instead of the allocator's
    failure. On the host, more than the memory available is refused before
    trying: the kernel would otherwise end the process when the buffers are
    first written, with no message."""
    if device.type == "cpu":
        available = host_memory_available()
        if nbytes > available:
            raise error(f"{format_bytes(available)} of host memory available")
    try:
        yield
    except Exception as exc:  # only allocation failures are converted
        if not _is_allocation_failure(exc):
            raise
        raise error(f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}") from None
