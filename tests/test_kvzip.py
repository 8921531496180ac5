"""KVzip (policy ``kvzip``): the reference decoder's reconstruction scores
against a brute-force Eq. (2) on stock transformers, the global selection
against a brute-force ranking, one shared prefill against the decoder's own,
and the serving path's refusal.

The model is a tiny random Llama with the default model's tokenizer (its
ChatML template gives the repeat prompt's turn change), built in a temporary
folder; prompts are random token ids.
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from vllm_kvevict.config import (
    ADDITIONAL_CONFIG_KEY,
    EvictionConfig,
    KVEvictionConfigError,
    build_config,
    config_from_additional,
    config_from_cli,
)
from vllm_kvevict.evaluation.reference_eval import shares_prompt
from vllm_kvevict.evaluation.settings import parse_settings
from vllm_kvevict.policies import make_policy
from vllm_kvevict.reference import ReferenceEvictingDecoder

from tiny_model import build_tiny_llama

SINK, RECENT, CHUNK, ANCHOR = 4, 8, 16, 8
SERVING_REFUSAL = "kvzip is scored by the reference evaluation only: use kvevict eval --engine reference"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 layers, 4 query heads on 2 KV heads (G = 2), head_dim 16."""
    return build_tiny_llama(
        tmp_path_factory.mktemp("kvzip_tiny") / "model", seed=3, num_hidden_layers=2, hidden_size=64,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
    )


def random_prompt(seed: int, length: int) -> list[int]:
    """Ordinary token ids (the tokenizer's special tokens sit below 100)."""
    return torch.randint(100, 40000, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def kvzip_config(budget: int, **overrides: object) -> EvictionConfig:
    return EvictionConfig(**{
        "policy": "kvzip", "budget": budget, "sink_tokens": SINK, "recent_window": RECENT,
        "decode_interval": 4, "policy_options": {"chunk_size": CHUNK, "anchor_tokens": ANCHOR},
        **overrides,
    })


def brute_force_scores(model_dir: Path, prompt: list[int]) -> list[torch.Tensor]:
    """Eq. (2) written out: per chunk, stock transformers (eager attention)
    runs prompt + repeat input in one causal pass; post-RoPE queries and keys
    come from hooks on q_proj and k_proj turned by the model's rotary
    embedding, and the local softmax over [sinks, chunk, input's own keys]
    is taken query by query in fp64. The repeat ids are written from the
    strings of the original code and ChatML's turn change, spelled out here."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, attn_implementation="eager").eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    cfg = model.config
    hq, h, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    group = hq // h
    scale = 1.0 / math.sqrt(d)

    def enc(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    turn = enc("<|im_end|>\n<|im_start|>assistant\n")
    length = len(prompt)
    end = length - RECENT
    scores = [torch.zeros(h, length, dtype=torch.float64) for _ in range(cfg.num_hidden_layers)]
    captured: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for index, layer in enumerate(model.model.layers):
        for name in ("q_proj", "k_proj"):
            hooks.append(getattr(layer.self_attn, name).register_forward_hook(
                lambda module, args, out, key=(index, name): captured.__setitem__(key, out.detach())
            ))
    try:
        for start in range(SINK, end, CHUNK):
            stop = min(start + CHUNK, end)
            if start == SINK:
                head = enc("\n\nRepeat the previous context exactly.")
            else:
                head = enc("\n\nRepeat the part of the previous context exactly, starting with ") + prompt[start - ANCHOR : start]
            repeat = head + turn + prompt[start:stop]
            ids = torch.tensor([prompt + repeat])
            positions = torch.arange(ids.shape[1])[None]
            with torch.no_grad():
                model(input_ids=ids, position_ids=positions)
                cos, sin = model.model.rotary_emb(torch.zeros(1, dtype=torch.float64), positions)
            n = len(repeat)
            for index in range(cfg.num_hidden_layers):
                q = captured[(index, "q_proj")][0].double().view(-1, hq, d).transpose(0, 1)[None]
                k = captured[(index, "k_proj")][0].double().view(-1, h, d).transpose(0, 1)[None]
                q, k = apply_rotary_pos_emb(q, k, cos.double(), sin.double())
                q, k = q[0], k[0]  # [Hq, T, D], [H, T, D]
                for kv in range(h):
                    for g in range(group):
                        for t in range(n):
                            query = q[kv * group + g, length + t]
                            keys = torch.cat([k[kv, :SINK], k[kv, start:stop], k[kv, length : length + t + 1]])
                            probs = torch.softmax(keys @ query * scale, dim=0)[SINK : SINK + stop - start]
                            row = scores[index][kv, start:stop]
                            scores[index][kv, start:stop] = torch.maximum(row, probs)
    finally:
        for hook in hooks:
            hook.remove()
    return scores


@pytest.mark.parametrize("seed", [11, 12])
def test_reconstruction_scores_equal_a_brute_force_eq2(tiny: Path, seed: int) -> None:
    prompt = random_prompt(seed, 70)  # candidates [4, 62): chunks of 16, 16, 16 and 10
    decoder = ReferenceEvictingDecoder(tiny, None, block_size=8)
    decoder.reconstruction_rows = 64 if seed % 2 else 7  # the repeat input whole, or in blocks
    state = decoder.run_prompt(prompt, keep_queries=1)
    decoder.continue_from(state, kvzip_config(32), 1)
    (got,) = state.reconstructions.values()
    want = brute_force_scores(tiny, prompt)
    for layer, (mine, theirs) in enumerate(zip(got, want, strict=True)):
        assert mine.dtype == torch.float32 and mine.shape == (2, 70)
        torch.testing.assert_close(mine.double(), theirs, rtol=2e-5, atol=1e-7, msg=f"layer {layer}")
        # Sinks and the recent window are kept whatever they score: not repeated.
        assert not mine[:, :SINK].any() and not mine[:, 70 - RECENT :].any()
        assert bool((mine[:, SINK : 70 - RECENT] > 0).all())


@pytest.mark.parametrize("seed", [21, 22])
def test_selection_keeps_the_global_top_budget(tiny: Path, seed: int) -> None:
    """One-token pages: the request keeps exactly layers x KV heads x (P - F)
    tokens, the best by score over every layer and head (sinks and the
    recent window first), ties to the earlier (layer, head, position)."""
    prompt = random_prompt(seed, 70)
    budget = 24 + seed % 2 * 7
    decoder = ReferenceEvictingDecoder(tiny, None, block_size=1)
    state = decoder.run_prompt(prompt, keep_queries=1)
    config = kvzip_config(budget)
    decoder.continue_from(state, config, 1)  # the first token only: no decode step
    (scores,) = state.reconstructions.values()
    stacked = torch.stack(scores)  # [L, H, P]
    protected = (torch.arange(70) < SINK) | (torch.arange(70) >= 70 - RECENT)
    ranked = stacked.masked_fill(protected, float("inf")).flatten()
    num_layers, num_heads = stacked.shape[:2]
    total = num_layers * num_heads * budget
    order = torch.sort(ranked, descending=True, stable=True).indices[:total]
    want = torch.zeros(ranked.numel(), dtype=torch.bool)
    want[order] = True
    want = want.view(num_layers, num_heads, 70)
    kept = torch.zeros_like(want)
    for layer, positions in enumerate(decoder.retained_positions):
        for head in range(num_heads):
            live = positions[head][positions[head] < 70]
            assert live.numel() == len(set(live.tolist()))
            kept[layer, head, live] = True
    assert int(kept.sum()) == total
    assert torch.equal(kept, want)
    assert len({int(kept[layer, head].sum()) for layer in range(num_layers) for head in range(num_heads)}) > 1


@pytest.mark.parametrize("seed", [31, 32])
def test_continue_from_equals_generate(tiny: Path, seed: int) -> None:
    """The shared prefill's route (run_prompt, then the pass from its state)
    and the decoder's own chunked prefill (the pass at the end-of-prompt
    eviction) give the same tokens and keep the same positions, decode-time
    evictions included; a second kvzip setting on the state reuses its scores."""
    prompt = random_prompt(seed, 75)
    config = kvzip_config(32)
    own = ReferenceEvictingDecoder(tiny, config, block_size=8, chunk_size=20)
    want = own.generate(prompt, 30)
    shared = ReferenceEvictingDecoder(tiny, None, block_size=8, chunk_size=20)
    state = shared.run_prompt(prompt, keep_queries=1)
    shared.continue_from(state, build_config({"policy": "knorm", "budget": 32, "recent_window": 8, "prefill_mode": "end_of_prompt"}), 3)
    shared.continue_from(state, kvzip_config(48), 3)
    assert len(state.reconstructions) == 1
    got = shared.continue_from(state, config, 30)
    assert got == want
    assert len(state.reconstructions) == 1
    for mine, theirs in zip(shared.retained_positions, own.retained_positions, strict=True):
        assert torch.equal(mine, theirs)
    # Evicted within the prompt, and every generated token (fed back: all but
    # the last) kept, beyond the recent window too: decode-time evictions at
    # 83 and 99 (frontiers 48 and 64) drop prompt tokens alone.
    fed = set(range(75, 75 + 29))
    for positions in own.retained_positions:
        for head in positions.tolist():
            live = {p for p in head if p < 1 << 40}
            assert len(live & set(range(75))) < 75 and fed <= live


def test_a_missing_reconstruction_is_an_error_not_a_fallback() -> None:
    policy = make_policy("kvzip")
    from vllm_kvevict.policies.base import ScoringInputs

    keys = torch.randn(2, 5, 4)
    with pytest.raises(ValueError, match="reconstruction"):
        policy.score(ScoringInputs(keys, keys, torch.arange(5).expand(2, -1), None, None, 1.0))
    scores = torch.rand(2, 5)
    inputs = ScoringInputs(keys, keys, torch.arange(5).expand(2, -1), None, None, 1.0, reconstruction=scores)
    assert torch.equal(policy.score(inputs), scores)
    assert torch.equal(policy.score(inputs.head(1, 3)), scores[1:2, :3])


def test_serving_refuses_kvzip_and_the_reference_evaluation_takes_it() -> None:
    for call in (
        lambda: config_from_cli("kvzip", None),
        lambda: config_from_cli(None, '{"policy": "kvzip", "budget": 256}'),
        lambda: config_from_additional({ADDITIONAL_CONFIG_KEY: {"policy": "kvzip"}}),
        lambda: config_from_additional({ADDITIONAL_CONFIG_KEY: build_config({"policy": "kvzip"})}),
    ):
        with pytest.raises(KVEvictionConfigError) as caught:
            call()
        assert str(caught.value) == SERVING_REFUSAL
    parser = argparse.ArgumentParser(prog="kvevict eval")
    with pytest.raises(SystemExit):
        parse_settings(parser, ["snapkv@0.2", "kvzip@0.2"], None)
    (setting,) = parse_settings(parser, ["kvzip@0.2"], None, served=False)
    config = build_config({**setting.eviction, "budget": 256})
    assert (config.prefill_mode, config.head_budget, config.pools_layers) == ("end_of_prompt", "global", True)
    assert shares_prompt(config)
    for wrong in ({"prefill_mode": "per_chunk"}, {"head_budget": "adaptive"}):
        with pytest.raises(KVEvictionConfigError, match="prefill_mode 'end_of_prompt' and head_budget 'global'"):
            build_config({"policy": "kvzip", **wrong})


def test_serving_refusal_reaches_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvevict eval")
    with pytest.raises(SystemExit):
        parse_settings(parser, ["kvzip@0.2"], None)
    assert f"setting kvzip@0.2: {SERVING_REFUSAL}" in capsys.readouterr().err
