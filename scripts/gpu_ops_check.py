"""vLLM's compiled ops that a Llama runs, on this GPU, against torch.

Loads ``vllm._C_stable_libtorch`` (in the GPU payload it is cut to the
Hopper code, see ``scripts/gpu_payload.py``) and runs ``rms_norm``,
``fused_add_rms_norm``, ``silu_and_mul``, ``rotary_embedding`` (NeoX and
GPT-J styles) and ``reshape_and_cache_flash`` on random inputs in fp32 and
bf16, each compared with a torch implementation of the same function. One
line per op and dtype; exit status 1 if any op fails to load, to run (a cubin
missing for this GPU shows here as "no kernel image"), or to agree.

    python scripts/gpu_ops_check.py [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback

import torch

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative to the reference's largest magnitude


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * weight.float()).to(x.dtype)


def rotary_ref(positions, x, head_size, cache, is_neox):
    """``x`` [T, H * head_size] rotated by ``cache`` [max_pos, head_size] (cos | sin halves)."""
    tokens = x.shape[0]
    x = x.view(tokens, -1, head_size).float()
    cos, sin = cache[positions].float().chunk(2, dim=-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    if is_neox:
        x1, x2 = x[..., : head_size // 2], x[..., head_size // 2:]
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    else:
        x1, x2 = x[..., 0::2], x[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
    return out.flatten(1)


def cases(dtype: torch.dtype, generator: torch.Generator):
    """(name, run the op, the reference) for each op."""
    from vllm import _custom_ops as ops

    dev = "cuda"

    def randn(*shape):
        return torch.randn(*shape, generator=generator, device=dev, dtype=torch.float32).to(dtype)

    tokens, hidden, eps = 37, 2048, 1e-5
    x, weight = randn(tokens, hidden), randn(hidden)

    def rms():
        out = torch.empty_like(x)
        ops.rms_norm(out, x, weight, eps)
        return out

    yield "rms_norm", rms, lambda: rms_norm_ref(x, weight, eps)

    residual = randn(tokens, hidden)

    def fused():
        inp, res = x.clone(), residual.clone()
        ops.fused_add_rms_norm(inp, res, weight, eps)
        return torch.cat([inp, res], dim=-1)

    def fused_ref():
        total = (x.float() + residual.float()).to(dtype)
        return torch.cat([rms_norm_ref(total, weight, eps), total], dim=-1)

    yield "fused_add_rms_norm", fused, fused_ref

    gate_up = randn(tokens, 2 * 4096)

    def silu():
        out = torch.empty(tokens, 4096, device=dev, dtype=dtype)
        torch.ops._C.silu_and_mul(out, gate_up)
        return out

    def silu_ref():
        g, u = gate_up.float().chunk(2, dim=-1)
        return (torch.nn.functional.silu(g) * u).to(dtype)

    yield "silu_and_mul", silu, silu_ref

    head_size, heads, kv_heads, max_pos = 64, 8, 2, 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_size, 2, device=dev, dtype=torch.float32) / head_size))
    angles = torch.arange(max_pos, device=dev, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), generator=generator, device=dev)
    query, key = randn(tokens, heads * head_size), randn(tokens, kv_heads * head_size)
    for is_neox in (True, False):
        def rope(is_neox=is_neox):
            q, k = query.clone(), key.clone()
            ops.rotary_embedding(positions, q, k, head_size, cache, is_neox)
            return torch.cat([q, k], dim=-1)

        def rope_ref(is_neox=is_neox):
            return torch.cat([rotary_ref(positions, query, head_size, cache, is_neox),
                              rotary_ref(positions, key, head_size, cache, is_neox)], dim=-1).to(dtype)

        yield f"rotary_embedding ({'neox' if is_neox else 'gptj'})", rope, rope_ref

    blocks, block_size = 16, 32
    new_k, new_v = randn(tokens, kv_heads, head_size), randn(tokens, kv_heads, head_size)
    slots = torch.randperm(blocks * block_size, generator=generator, device=dev)[:tokens]
    scale = torch.ones((), device=dev, dtype=torch.float32)

    def cache_write():
        k_cache = torch.zeros(blocks, block_size, kv_heads, head_size, device=dev, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        ops.reshape_and_cache_flash(new_k, new_v, k_cache, v_cache, slots, "auto", scale, scale)
        return torch.cat([k_cache, v_cache], dim=-1)

    def cache_ref():
        k_cache = torch.zeros(blocks * block_size, kv_heads, head_size, device=dev, dtype=dtype)
        v_cache = torch.zeros_like(k_cache)
        k_cache[slots], v_cache[slots] = new_k, new_v
        return torch.cat([k_cache, v_cache], dim=-1).view(blocks, block_size, kv_heads, 2 * head_size)

    yield "reshape_and_cache_flash", cache_write, cache_ref


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    results = []
    try:
        import vllm._C_stable_libtorch  # noqa: F401 - registers torch.ops._C and _C_cache_ops
    except Exception as exc:  # noqa: BLE001 - reported as the check's result
        traceback.print_exc()
        print(f"gpu_ops_check: vLLM's compiled ops did not load: {type(exc).__name__}: {exc}")
        return 1
    name = torch.cuda.get_device_name(0)
    capability = ".".join(map(str, torch.cuda.get_device_capability(0)))
    print(f"{name} (sm {capability}), torch {torch.__version__}")
    for dtype in (torch.float32, torch.bfloat16):
        generator = torch.Generator(device="cuda").manual_seed(0)
        for op, run, reference in cases(dtype, generator):
            row = {"op": op, "dtype": str(dtype).removeprefix("torch.")}
            try:
                got = run()
                torch.cuda.synchronize()
                want = reference()
                error = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-6)).item()
                row.update(error=error, passed=error <= TOLERANCE[dtype])
            except Exception as exc:  # noqa: BLE001 - one op's failure is its row
                row.update(error=None, passed=False, exception=f"{type(exc).__name__}: {exc}".splitlines()[0])
            results.append(row)
            detail = row.get("exception") or f"max error {row['error']:.2e} of the reference's largest value"
            print(f"{'passed' if row['passed'] else 'FAILED'} {op} {row['dtype']}: {detail}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": name, "capability": capability, "torch": torch.__version__, "ops": results}, handle,
                      indent=1)
    failed = [r for r in results if not r["passed"]]
    print(f"gpu_ops_check: {len(results) - len(failed)} of {len(results)} passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
