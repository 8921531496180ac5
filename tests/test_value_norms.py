"""The value factor's Triton kernel (``triton_kernels/value_norms.py``) against
its torch reference, and CriticalKV's and DefensiveKV's scores with it against
their torch path, on fresh random inputs.

Without a GPU the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``
on CPU tensors, set by ``triton_mode`` before triton is imported; see
``tests/triton_mode.py``); with CUDA the compiled kernel runs. The values sit
in a larger NaN-filled buffer, so a read past a row's tokens or head dim
shows as NaN.
"""

from __future__ import annotations

import pytest
import torch

from triton_mode import DEVICE, run_in_fresh_process, skip_unless

from vllm_kvevict.policies import criticalkv  # noqa: E402
from vllm_kvevict.policies.base import PADDING_POSITION, ScoringInputs  # noqa: E402
from vllm_kvevict.policies.criticalkv import CriticalKVPolicy, projected_value_norms  # noqa: E402
from vllm_kvevict.policies.defensivekv import DefensiveKVPolicy  # noqa: E402
from vllm_kvevict.triton_kernels import value_norms as vn  # noqa: E402


@pytest.fixture(autouse=True)
def _interpretable(request: pytest.FixtureRequest) -> None:
    skip_unless(request, "test_value_norms_in_fresh_process")


def test_value_norms_in_fresh_process() -> None:
    """This file in a new interpreter, when this one imported triton too early."""
    print(run_in_fresh_process(__file__, "test_value_norms_in_fresh_process"))


def _poisoned_values(
    num_requests: int, num_kv_heads: int, num_tokens: int, head_dim: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """``[R, H, S, D]`` random values as a strided view of a larger
    NaN-filled ``[R, S + 3, H, D + 8]`` buffer (vLLM's token-major order)."""
    shape = (num_requests, num_tokens + 3, num_kv_heads, head_dim + 8)
    buffer = torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)
    view = buffer[:, 1 : num_tokens + 1, :, 4 : head_dim + 4]
    view.copy_(torch.randn(view.shape, generator=gen).to(dtype))
    return view.permute(0, 2, 1, 3)


def _projection(
    num_q_heads: int, head_dim: int, d_model: int, dtype: torch.dtype, gen: torch.Generator
) -> torch.Tensor:
    """``[Hq, D, d_model]`` as the server passes it: a view of
    ``o_proj.weight.T`` (``[d_model, Hq * D]``), not a copy."""
    weight = (torch.randn(d_model, num_q_heads * head_dim, generator=gen) / head_dim**0.5).to(dtype).to(DEVICE)
    return weight.t().reshape(num_q_heads, head_dim, d_model)


# (requests, KV heads, group, tokens, head dim, d_model)
SHAPES = {
    "one-head-one-token": (1, 1, 1, 1, 32, 64),
    "gqa4-ragged-tiles": (1, 2, 4, 130, 64, 200),
    "odd-group-head-dim-80": (2, 3, 3, 65, 80, 96),
    "batched-requests": (3, 2, 2, 70, 32, 130),
    "no-tokens": (2, 2, 2, 0, 32, 64),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", list(SHAPES))
def test_value_norms_match_reference(name: str, dtype: torch.dtype) -> None:
    num_requests, num_kv_heads, group, num_tokens, head_dim, d_model = SHAPES[name]
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    values = _poisoned_values(num_requests, num_kv_heads, num_tokens, head_dim, dtype, gen)
    projection = _projection(num_kv_heads * group, head_dim, d_model, dtype, gen)

    norms = vn.projected_value_norms(values, projection)
    expected = vn.projected_value_norms_reference(values, projection)
    assert norms.shape == (num_requests, num_kv_heads, num_tokens) and norms.dtype == torch.float32
    assert torch.isfinite(norms).all()
    torch.testing.assert_close(norms, expected, rtol=2e-5, atol=1e-5)
    # [H, S, D] in, [H, S] out: one request's rows.
    torch.testing.assert_close(vn.projected_value_norms(values[-1], projection), norms[-1], rtol=0, atol=0)


def test_value_norms_reference_is_the_definition() -> None:
    """The reference against the formula written out, one token at a time."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    values = torch.randn(2, 5, 32, generator=gen)
    projection = torch.randn(6, 32, 40, generator=gen)
    norms = vn.projected_value_norms_reference(values, projection)
    for h in range(2):
        for j in range(5):
            each = [(values[h, j] @ projection[h * 3 + g]).abs().sum() for g in range(3)]
            assert torch.isclose(norms[h, j], torch.stack(each).mean(), rtol=1e-5)


def test_value_norms_refuse_mismatched_shapes() -> None:
    values = torch.zeros(2, 4, 32, device=DEVICE)
    with pytest.raises(ValueError, match="multiple of the 2 KV heads"):
        vn.projected_value_norms(values, torch.zeros(3, 32, 16, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[Hq, D=32, d_model\]"):
        vn.projected_value_norms(values, torch.zeros(4, 16, 16, device=DEVICE))


def _scoring_inputs(gen: torch.Generator, dtype: torch.dtype) -> ScoringInputs:
    """One layer of 3 KV heads x 2 query heads, 96 tokens, the last 16 the
    window; head 1 no longer holds five positions (as after an earlier
    eviction), its last five slots padding."""
    num_kv_heads, group, num_tokens, head_dim, window = 3, 2, 96, 32, 16
    keys = torch.randn(num_kv_heads, num_tokens, head_dim, generator=gen).to(dtype)
    values = torch.randn(num_kv_heads, num_tokens, head_dim, generator=gen).to(dtype)
    positions = torch.arange(num_tokens).repeat(num_kv_heads, 1)
    held = torch.cat([torch.arange(10), torch.arange(15, num_tokens)])
    positions[1] = torch.cat([held, torch.full((5,), PADDING_POSITION)])
    queries = torch.randn(num_kv_heads * group, window, head_dim, generator=gen).to(dtype)
    return ScoringInputs(
        keys.to(DEVICE), values.to(DEVICE), positions.to(DEVICE), queries.to(DEVICE),
        torch.arange(num_tokens - window, num_tokens, device=DEVICE), head_dim**-0.5,
        output_projection=_projection(num_kv_heads * group, head_dim, 48, dtype, gen),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_policies_score_alike_with_the_kernel(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """CriticalKV's refined scores and DefensiveKV's scores with the kernel
    (what a GPU runs) against the same policies' torch path."""
    gen = torch.Generator().manual_seed(torch.seed() % 2**31)
    counts = torch.tensor([40, 20, 60], device=DEVICE)
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(criticalkv, "_fused_value_norms", lambda values, fused=fused: fused)
        inputs = _scoring_inputs(torch.Generator().manual_seed(gen.initial_seed()), dtype)
        critical = CriticalKVPolicy(base="snapkv")
        refined = critical.refine_scores(inputs, critical.score(inputs), counts)
        results[fused] = (refined, DefensiveKVPolicy().score(inputs), inputs)
    for torch_path, kernel_path in zip(results[False][:2], results[True][:2]):
        assert torch.equal(torch.isinf(torch_path), torch.isinf(kernel_path))
        finite = torch.isfinite(torch_path)
        torch.testing.assert_close(kernel_path[finite], torch_path[finite], rtol=2e-5, atol=1e-7)
    # Tokens that are not asked for stay 0 on both paths.
    inputs = results[True][2]
    tokens = torch.rand(inputs.values.shape[:2], generator=gen).to(DEVICE) < 0.5
    monkeypatch.setattr(criticalkv, "_fused_value_norms", lambda values: True)
    fused = projected_value_norms(inputs.values, inputs.output_projection, tokens)
    monkeypatch.setattr(criticalkv, "_fused_value_norms", lambda values: False)
    plain = projected_value_norms(inputs.values, inputs.output_projection, tokens)
    assert bool((fused[~tokens] == 0).all()) and bool((plain[~tokens] == 0).all())
    torch.testing.assert_close(fused, plain, rtol=2e-5, atol=1e-7)


def test_the_kernel_runs_on_a_gpu_only() -> None:
    """A GPU scores with the kernel; CPU tensors take the torch path."""
    assert criticalkv._fused_value_norms(torch.randn(2, 8, 32, device=DEVICE)) == (DEVICE.type == "cuda")
    assert not criticalkv._fused_value_norms(torch.randn(2, 8, 32))
