"""MomentKV's evicted-token summary against the paper's mathematics: the
statistics after k folds equal those computed from scratch (Eqs. 22-24), the
correction is exact when every evicted key is the same, and it reduces the
attention-output error against full attention on random data."""

import math

import pytest
import torch

from vllm_kvevict.moments import EvictedMoments, merge_partial_states


def _full_attention(q, keys, values, scale):
    return torch.softmax(q @ keys.T * scale, -1) @ values


def _corrected(q, kept_k, kept_v, summary, scale):
    logits = q @ kept_k.T * scale
    lse = torch.logsumexp(logits, -1)
    out = torch.softmax(logits, -1) @ kept_v
    e_out, e_lse = summary[0, 0].partial_state(q, scale)
    return merge_partial_states(out, lse, e_out, e_lse)[0]


@pytest.mark.parametrize("covariance", ["full", "diagonal", "none"])
@pytest.mark.parametrize("seed", range(5))
def test_statistics_after_k_folds_equal_from_scratch(seed, covariance):
    gen = torch.Generator().manual_seed(seed)
    dim = 16
    batches = [torch.randint(1, 9, (1,), generator=gen).item() for _ in range(6)]
    keys = [torch.randn(n, dim, generator=gen, dtype=torch.float64) * 3 + 5 for n in batches]
    values = [torch.randn(n, dim, generator=gen, dtype=torch.float64) - 2 for n in batches]
    summary = EvictedMoments.zeros(2, 2, dim, covariance=covariance)
    for k, v in zip(keys, values):
        summary[1, 1].fold_(k.float(), v.float())
    k_all, v_all = torch.cat(keys), torch.cat(values)
    n = k_all.shape[0]
    s_tilde = v_all.T @ k_all - torch.outer(v_all.sum(0), k_all.sum(0)) / n  # Eq. 24
    assert float(summary.count[1, 1]) == n
    assert torch.allclose(summary.key_mean[1, 1].double(), k_all.mean(0), atol=1e-5)
    assert torch.allclose(summary.value_mean[1, 1].double(), v_all.mean(0), atol=1e-5)
    want = {"full": s_tilde, "diagonal": s_tilde.diagonal(), "none": s_tilde.new_zeros(0)}[covariance]
    assert summary.covariance == covariance
    assert summary.cross_cov[1, 1].shape == want.shape
    assert torch.allclose(summary.cross_cov[1, 1].double(), want, atol=1e-3 * n)
    assert float(summary.count[0].abs().sum() + summary.cross_cov[0].abs().sum()) == 0.0
    per_head = {"full": 1 + 2 * dim + dim * dim, "diagonal": 1 + 3 * dim, "none": 1 + 2 * dim}
    assert summary.bytes_per_row == 2 * 4 * per_head[covariance]  # 2 heads, fp32


@pytest.mark.parametrize("covariance", ["diagonal", "none"])
def test_reduced_covariance_partial_state_is_the_papers_model_with_reduced_c(covariance):
    """o_E = v̄ + τ diag(C) ⊙ q / n (diagonal) or v̄ (none, the zeroth-order
    correction), from the raw evicted tokens in fp64; lse_E unchanged."""
    gen = torch.Generator().manual_seed(3)
    dim, scale = 32, 1 / math.sqrt(32)
    keys = torch.randn(23, dim, generator=gen, dtype=torch.float64)
    values = torch.randn(23, dim, generator=gen, dtype=torch.float64) + keys * 0.5
    q = torch.randn(5, dim, generator=gen, dtype=torch.float64)
    summary = EvictedMoments.zeros(1, 1, dim, covariance=covariance)
    summary[0, 0].fold_(keys[:10].float(), values[:10].float())
    summary[0, 0].fold_(keys[10:].float(), values[10:].float())
    out, lse = summary[0, 0].partial_state(q.float(), scale)
    k_bar, v_bar = keys.mean(0), values.mean(0)
    c_diag = ((values - v_bar) * (keys - k_bar)).sum(0)
    want = v_bar + (scale * q * c_diag / 23 if covariance == "diagonal" else 0.0)
    assert torch.allclose(out.double(), want.expand(5, dim), atol=1e-5)
    assert torch.allclose(lse.double(), math.log(23) + scale * q @ k_bar, atol=1e-5)


@pytest.mark.parametrize("covariance", ["full", "diagonal", "none"])
@pytest.mark.parametrize("seed", range(5))
def test_correction_is_exact_when_evicted_keys_are_equal(seed, covariance):
    gen = torch.Generator().manual_seed(seed)
    dim, scale = 32, 1 / math.sqrt(32)
    keys = torch.randn(40, dim, generator=gen)
    values = torch.randn(40, dim, generator=gen)
    keys[25:] = keys[25]  # the evicted tokens share one key; values differ
    q = torch.randn(6, dim, generator=gen) * 2
    summary = EvictedMoments.zeros(1, 1, dim, covariance=covariance)
    summary[0, 0].fold_(keys[25:], values[25:])
    corrected = _corrected(q, keys[:25], values[:25], summary, scale)
    assert torch.allclose(corrected, _full_attention(q, keys, values, scale), atol=1e-5)
    plain = _full_attention(q, keys[:25], values[:25], scale)
    assert not torch.allclose(plain, _full_attention(q, keys, values, scale), atol=1e-3)


def test_correction_reduces_error_on_random_data():
    """Keys clustered around a mean, random queries: evicting half the tokens
    (the lowest attention from the queries' mean) and correcting with their
    moments is closer to full attention than dropping them."""
    gen = torch.Generator().manual_seed(0)
    dim, scale = 64, 1 / math.sqrt(64)
    errors_plain, errors_corrected = [], []
    for _ in range(20):
        keys = torch.randn(256, dim, generator=gen) * 0.5 + torch.randn(dim, generator=gen)
        values = torch.randn(256, dim, generator=gen) + keys @ torch.randn(dim, dim, generator=gen) * 0.1
        q = torch.randn(8, dim, generator=gen)
        order = torch.argsort((q.mean(0) @ keys.T), descending=True)
        kept, evicted = order[:128], order[128:]
        summary = EvictedMoments.zeros(1, 1, dim)
        summary[0, 0].fold_(keys[evicted], values[evicted])
        full = _full_attention(q, keys, values, scale)
        plain = _full_attention(q, keys[kept], values[kept], scale)
        corrected = _corrected(q, keys[kept], values[kept], summary, scale)
        errors_plain.append(float((plain - full).norm(dim=-1).mean()))
        errors_corrected.append(float((corrected - full).norm(dim=-1).mean()))
    reduction = 1 - sum(errors_corrected) / sum(errors_plain)
    print(f"\nmean attention-output error: dropped {sum(errors_plain) / 20:.4f}, "
          f"corrected {sum(errors_corrected) / 20:.4f} ({reduction:.0%} lower)")
    assert reduction > 0.3


@pytest.mark.e2e
def test_correction_reduces_error_on_smollm2_keys_and_values(model_dir, tokenizer):
    """Real post-RoPE queries, keys and values of the default model on a
    ~1k-token prompt: per (layer, KV head), keep the half of the first 960
    tokens the observation window attends to most (SnapKV-style votes), and
    compare the last 32 queries' attention outputs with full attention, with
    the evicted half dropped or folded into the summary."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    from helpers import needle_prompt

    captured: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def capture(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        captured[module.layer_idx] = (query[0].float(), key[0].float(), value[0].float())
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key.repeat_interleave(query.shape[1] // key.shape[1], 1),
            value.repeat_interleave(query.shape[1] // key.shape[1], 1), is_causal=True,
            scale=scaling,
        )
        return out.transpose(1, 2), None

    AttentionInterface.register("kvevict_capture", capture)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="kvevict_capture")
    ids = tokenizer(needle_prompt(tokenizer, 40404, target_tokens=1200)).input_ids[:992]
    assert len(ids) == 992
    with torch.no_grad():
        model(input_ids=torch.tensor([ids]))
    scale = float(model.model.layers[0].self_attn.scaling)
    dropped, corrected_err = [], []
    reduced: dict[str, list[float]] = {"full": [], "diagonal": [], "none": []}
    for layer, (q, k, v) in captured.items():
        group = q.shape[0] // k.shape[0]
        for h in range(k.shape[0]):
            queries = q[h * group : (h + 1) * group, -32:]  # [G, 32, D] at positions 960..991
            keys, values = k[h], v[h]
            prefix = 960
            full = torch.softmax(queries @ keys.T * scale, -1) @ values  # causal: all keys precede
            votes = torch.softmax(queries @ keys[:prefix].T * scale, -1).mean((0, 1))
            order = torch.argsort(votes, descending=True)
            kept = torch.cat([order[: prefix // 2].sort().values, torch.arange(prefix, keys.shape[0])])
            evicted = order[prefix // 2 :]
            plain = torch.softmax(queries @ keys[kept].T * scale, -1) @ values[kept]
            dropped.append(float((plain - full).norm(dim=-1).mean()))
            for covariance in ("full", "diagonal", "none"):
                summary = EvictedMoments.zeros(1, 1, keys.shape[1], covariance=covariance)
                summary[0, 0].fold_(keys[evicted], values[evicted])
                fixed = _corrected(queries, keys[kept], values[kept], summary, scale)
                error = float((fixed - full).norm(dim=-1).mean())
                reduced[covariance].append(error)
            corrected_err.append(reduced["full"][-1])
    mean_dropped = sum(dropped) / len(dropped)
    mean_corrected = sum(corrected_err) / len(corrected_err)
    better = sum(c < d for c, d in zip(corrected_err, dropped))
    print(f"\nSmolLM2, {len(dropped)} (layer, KV head) pairs, half of 960 tokens evicted: mean "
          f"attention-output error dropped {mean_dropped:.4f}, corrected {mean_corrected:.4f} "
          f"({1 - mean_corrected / mean_dropped:.0%} lower; better in {better}/{len(dropped)} heads)")
    for covariance, errors in reduced.items():
        mean = sum(errors) / len(errors)
        print(f"  covariance {covariance}: error {mean:.4f} ({1 - mean / mean_dropped:.0%} lower than dropping)")
        assert mean < mean_dropped
    assert mean_corrected < mean_dropped
