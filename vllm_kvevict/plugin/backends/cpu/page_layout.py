"""How vLLM's CPU kernels lay out one (block, head) page, learned by probing.

``cpu_attn_reshape_and_cache`` stores keys and values in an ISA-specific order
inside each page (for the ``vec`` ISA a key page is ``[head_dim, block_size]``,
a value page ``[block_size, head_dim]``; ``amx`` packs differently). Rather than
hard-code those orders, we write known digits through the op itself once and
read back where each (token, dim) landed. Writing always goes through the op,
so only reading needs the learned index.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from vllm import _custom_ops as ops

_DIGIT = 16  # small integers are exact in every cache dtype (fp32/fp16/bf16)


@dataclass(frozen=True)
class PageLayout:
    key_index: torch.Tensor  # [bs * D]: flat page offset of logical (t, d) = t * D + d
    value_index: torch.Tensor
    block_size: int
    head_dim: int

    # Where a page is the logical [bs, D] or its transpose [D, bs] (vLLM's
    # vec ISA: values, and keys), reading is a strided copy, not a gather.
    key_order: str | None = field(init=False)
    value_order: str | None = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key_order", _plain_order(self.key_index, self.block_size, self.head_dim))
        object.__setattr__(self, "value_order", _plain_order(self.value_index, self.block_size, self.head_dim))

    def read_pages(self, cache: torch.Tensor, block_ids: torch.Tensor, is_key: bool) -> torch.Tensor:
        """Pages of ``block_ids`` in logical order, ``[H, nb * bs, D]``."""
        bs, head_dim = self.block_size, self.head_dim
        pages = cache.index_select(0, block_ids.long())  # [nb, H, bs, D] contiguous
        num_blocks, num_heads = pages.shape[:2]
        order = self.key_order if is_key else self.value_order
        if order == "transposed":
            logical = pages.view(num_blocks, num_heads, head_dim, bs).transpose(-1, -2)
        elif order == "logical":
            logical = pages
        else:
            index = self.key_index if is_key else self.value_index
            logical = pages.view(num_blocks, num_heads, -1)[..., index].view(num_blocks, num_heads, bs, head_dim)
        return logical.permute(1, 0, 2, 3).reshape(num_heads, -1, head_dim)


def _plain_order(index: torch.Tensor, block_size: int, head_dim: int) -> str | None:
    """``"logical"`` when page offset = logical index, ``"transposed"`` when
    logical ``(t, d)`` sits at ``d * bs + t``, else None."""
    logical = torch.arange(block_size * head_dim)
    if torch.equal(index, logical):
        return "logical"
    t, d = logical // head_dim, logical % head_dim
    if torch.equal(index, d * block_size + t):
        return "transposed"
    return None


def probe_page_layout(block_size: int, head_dim: int, dtype: torch.dtype, isa: str) -> PageLayout:
    size = block_size * head_dim
    digits = 1
    while _DIGIT**digits < size:
        digits += 1
    logical = torch.arange(size).view(block_size, 1, head_dim)  # token t, one head, dim d
    key_where = torch.zeros(size, dtype=torch.long)
    value_where = torch.zeros(size, dtype=torch.long)
    for digit in range(digits):
        value = (logical // _DIGIT**digit) % _DIGIT
        cache = torch.zeros(1, 1, block_size * 2, head_dim, dtype=dtype)
        key_cache, value_cache = cache.chunk(2, dim=2)
        ops.cpu_attn_reshape_and_cache(
            value.to(dtype), value.to(dtype), key_cache, value_cache,
            torch.arange(block_size, dtype=torch.int64), isa,
            k_scale=1.0, v_scale=1.0, kv_cache_dtype="auto",
        )
        key_where += key_cache.reshape(-1).round().long() * _DIGIT**digit
        value_where += value_cache.reshape(-1).round().long() * _DIGIT**digit
    # *_where[j] = logical index stored at page offset j; invert it.
    key_index = torch.empty(size, dtype=torch.long)
    key_index[key_where] = torch.arange(size)
    value_index = torch.empty(size, dtype=torch.long)
    value_index[value_where] = torch.arange(size)
    for name, where in (("key", key_where), ("value", value_where)):
        if not torch.equal(where.sort().values, torch.arange(size)):
            raise RuntimeError(
                f"vLLM's CPU {name} page layout for isa={isa} is not a permutation; "
                "this vLLM build is not supported by vllm-kvevict"
            )
    return PageLayout(key_index, value_index, block_size, head_dim)
