"""The learned policy's serving pieces outside vLLM: its score against the lookahead score's ("Make Each Token Count", §4.2)
closed form, the global allocation against brute force, the gate
checkpoints (ours, the authors' format, the shipped ones), config rules,
the log-β gather against a slot-by-slot loop, and the unsupported-model error."""

from __future__ import annotations

import json
import math
import warnings

import pytest
import torch

from vllm_kvevict.config import KVEvictionConfigError, build_config
from vllm_kvevict.eviction.allocation import GlobalAllocation, allocate_head_tokens
from vllm_kvevict.policies import ScoringInputs, make_policy
from vllm_kvevict.policies.gate_checkpoints import (
    TRIMKV_FILE,
    GateCheckpointError,
    gates_for_model,
    load_gates,
    save_gates,
    shipped_gates,
)
from vllm_kvevict.policies.retention_gate import RetentionGateConfig, RetentionGates
from vllm_kvevict.top_k import select_top


def _random_inputs(gen: torch.Generator, heads: int, live: int, step: int) -> ScoringInputs:
    keys = torch.randn(heads, live, 8, generator=gen)
    positions = torch.sort(torch.randperm(step, generator=gen)[:live]).values.repeat(heads, 1)
    inputs = ScoringInputs(keys, keys, positions, None, None, 1.0)
    inputs.log_beta = torch.nn.functional.logsigmoid(torch.randn(heads, live, generator=gen) * 2 + 3)
    inputs.step = step
    return inputs


@pytest.mark.parametrize("horizon", [1, 2, 5])
def test_learned_score_is_the_lookahead_sum(horizon: int) -> None:
    """score = log Σ_{k=1..H} β^(step + k - i), summed explicitly in fp64."""
    gen = torch.Generator().manual_seed(horizon)
    inputs = _random_inputs(gen, heads=2, live=50, step=300)
    score = make_policy("learned", {"horizon": horizon}).score(inputs)
    beta = inputs.log_beta.double().exp()
    age = (inputs.step - inputs.key_positions).double()
    explicit = sum(beta ** (age + k) for k in range(1, horizon + 1)).log()
    assert torch.allclose(score.double(), explicit, rtol=1e-5, atol=1e-6)


def test_learned_score_needs_the_gate_outputs() -> None:
    keys = torch.randn(1, 4, 8)
    with pytest.raises(ValueError, match="log_beta"):
        make_policy("learned").score(ScoringInputs(keys, keys, torch.arange(4)[None], None, None, 1.0))


@pytest.mark.parametrize("seed", range(4))
def test_global_allocation_is_one_ranking_in_whole_pages(seed: int) -> None:
    """Streams of different layers and heads get different lengths, at most
    ``total_pages`` whole pages in all, and the kept entries are the global top
    of what fits (brute force: sort every entry)."""
    gen = torch.Generator().manual_seed(seed)
    streams, width, page = 12, 96, 8
    scores = torch.randn(streams, width, generator=gen) * torch.rand(streams, 1, generator=gen) * 4
    live = torch.randint(40, width + 1, (streams,), generator=gen)
    scores[torch.arange(width)[None, :] >= live[:, None]] = float("-inf")
    total_pages = 40
    counts = allocate_head_tokens(GlobalAllocation(), scores, total_pages, page)
    assert int(((counts + page - 1) // page).sum()) <= total_pages
    assert int(counts.sum()) == total_pages * page  # every stream has enough live tokens
    assert len(set(counts.tolist())) > 1
    # Before page rounding the counts are exactly the brute-force top-B.
    raw = GlobalAllocation().token_counts(scores, total_pages * page)
    order = torch.argsort(scores.flatten(), descending=True)[: total_pages * page]
    assert raw.tolist() == torch.bincount(order // width, minlength=streams).tolist()
    kept = select_top(scores, counts)
    for s, count in enumerate(counts.tolist()):
        chosen = kept[s, :count]
        assert bool((chosen >= 0).all()) and bool((chosen < live[s]).all())
        best = torch.sort(scores[s], descending=True).values[:count]
        assert torch.equal(torch.sort(scores[s, chosen], descending=True).values, best)


def test_global_allocation_floor_and_pinned_entries() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(6, 64, generator=gen)
    scores[0] -= 100  # a stream the ranking would starve
    scores[:, :4] = float("inf")  # sinks
    counts = allocate_head_tokens(GlobalAllocation(floor=16), scores, total_pages=24, page_size=8)
    assert int(counts.min()) >= 16 and int(counts.sum()) == 24 * 8
    starved = allocate_head_tokens(GlobalAllocation(), scores, total_pages=24, page_size=8)
    assert int(starved[0]) < 16 and int(starved[0]) >= 4


def test_config_rules_for_the_learned_policy(tmp_path) -> None:
    config = build_config({"policy": "learned", "budget": 256})
    assert config.head_budget == "global" and config.uses_head_pages
    assert config.build_allocation() == GlobalAllocation(floor=0)
    floored = build_config({"policy": "learned", "policy_options": {"min_tokens_per_head": 32}})
    assert floored.build_allocation() == GlobalAllocation(floor=32)
    with pytest.raises(KVEvictionConfigError, match="drop head_budget 'uniform'"):
        build_config({"policy": "learned", "head_budget": "uniform"})
    with pytest.raises(KVEvictionConfigError, match="policy 'learned'"):
        build_config({"policy": "snapkv", "head_budget": "global"})
    with pytest.raises(KVEvictionConfigError, match="storage 'head_pages'"):
        build_config({"policy": "learned", "storage": "slots"})
    with pytest.raises(KVEvictionConfigError, match="not a folder"):
        build_config({"policy": "learned", "policy_options": {"gates": str(tmp_path / "none")}})
    with pytest.raises(KVEvictionConfigError, match="horizon"):
        build_config({"policy": "learned", "policy_options": {"horizon": 0}})


# ------------------------------------------------------------------ checkpoints


def _trimkv_checkpoint(folder, gen, hidden=48, layers=3, heads=2, width=16, tie=True,
                       distinct=False) -> dict[str, torch.Tensor]:
    """A gate checkpoint in the authors' layout: six tensors per
    layer under ``model.layers.N.self_attn.retention_gate``."""
    state = {}
    w3, b = torch.randn(heads, width, generator=gen), torch.randn(heads, generator=gen)
    for layer in range(layers):
        prefix = f"model.layers.{layer}.self_attn.retention_gate"
        state[f"{prefix}.linear1.weight"] = torch.randn(width, hidden, generator=gen)
        state[f"{prefix}.linear1.bias"] = torch.randn(width, generator=gen)
        state[f"{prefix}.linear2.weight"] = torch.randn(width, width, generator=gen)
        state[f"{prefix}.linear2.bias"] = torch.randn(width, generator=gen)
        if distinct:
            w3, b = torch.randn(heads, width, generator=gen), torch.randn(heads, generator=gen)
        state[f"{prefix}.linear3.weight"] = w3.clone()
        state[f"{prefix}.bias"] = b.clone()
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.to(torch.bfloat16) for k, v in state.items()}, folder / TRIMKV_FILE)
    (folder / "config.json").write_text(json.dumps({
        "hidden_size": hidden, "num_hidden_layers": layers, "num_key_value_heads": heads,
        "retention_gate_intermediate_size": width, "tie_retention_gate_layers": tie,
        "hidden_act": "silu", "retention_gate_bias_init": 18.0,
    }))
    return {k: v.to(torch.bfloat16).float() for k, v in state.items()}


def _rg10(state: dict[str, torch.Tensor], layer: int, x: torch.Tensor, readout_layer: int) -> torch.Tensor:
    """The authors' RetentionGate10 forward written out from the raw tensors."""
    p = f"model.layers.{layer}.self_attn.retention_gate"
    r = f"model.layers.{readout_layer}.self_attn.retention_gate"
    u = torch.nn.functional.silu(x @ state[f"{p}.linear1.weight"].T + state[f"{p}.linear1.bias"])
    u = torch.nn.functional.silu(u @ state[f"{p}.linear2.weight"].T + state[f"{p}.linear2.bias"])
    return torch.nn.functional.logsigmoid(u @ state[f"{r}.linear3.weight"].T + state[f"{r}.bias"])


@pytest.mark.parametrize("tie", [True, False])
def test_trimkv_checkpoint_loads_and_computes_rg10(tmp_path, tie: bool) -> None:
    gen = torch.Generator().manual_seed(int(tie))
    state = _trimkv_checkpoint(tmp_path, gen, tie=tie, distinct=not tie)
    gates = load_gates(tmp_path)
    assert gates.config == RetentionGateConfig(48, 3, 2, width=16, bias_init=18.0, tie_readout=tie)
    x = torch.randn(5, 48, generator=gen)
    for layer in range(3):
        with torch.no_grad():
            got = gates(layer, x)
        assert torch.allclose(got, _rg10(state, layer, x, layer), atol=1e-5)


def test_trimkv_distinct_readouts_under_tying_use_the_last_layers(tmp_path) -> None:
    """The authors' strict=False load into a tied model keeps the copy loaded last."""
    gen = torch.Generator().manual_seed(7)
    state = _trimkv_checkpoint(tmp_path, gen, tie=True, distinct=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gates = load_gates(tmp_path)
    assert any("distinct readouts" in str(w.message) for w in caught)
    x = torch.randn(4, 48, generator=gen)
    with torch.no_grad():
        assert torch.allclose(gates(0, x), _rg10(state, 0, x, readout_layer=2), atol=1e-5)


def test_trimkv_checkpoint_errors_name_the_problem(tmp_path) -> None:
    gen = torch.Generator().manual_seed(3)
    state = _trimkv_checkpoint(tmp_path / "a", gen)
    del state["model.layers.1.self_attn.retention_gate.linear2.bias"]
    torch.save(state, tmp_path / "a" / TRIMKV_FILE)
    with pytest.raises(GateCheckpointError, match="layer 1 has 5 gate tensors"):
        load_gates(tmp_path / "a")
    (tmp_path / "b").mkdir()
    torch.save({"lm_head.weight": torch.zeros(2, 2)}, tmp_path / "b" / TRIMKV_FILE)
    (tmp_path / "b" / "config.json").write_text("{}")
    with pytest.raises(GateCheckpointError, match="not a TrimKV"):
        load_gates(tmp_path / "b")
    (tmp_path / "c").mkdir()
    with pytest.raises(GateCheckpointError, match="neither"):
        load_gates(tmp_path / "c")


def test_gates_for_model_checks_shapes_and_finds_shipped_gates(tmp_path) -> None:
    gates = RetentionGates(RetentionGateConfig(hidden_size=32, num_layers=2, num_kv_heads=2, width=8))
    save_gates(tmp_path, gates, {})
    loaded = gates_for_model(str(tmp_path), 32, 2, 2)
    assert all(torch.equal(a.half().float(), b) for a, b in zip(gates.state_dict().values(),
                                                                loaded.state_dict().values()))
    with pytest.raises(GateCheckpointError, match="train gates for it"):
        gates_for_model(str(tmp_path), 64, 2, 2, "some/model")
    with pytest.raises(GateCheckpointError, match="no shipped gates"):
        gates_for_model(None, 7, 7, 7, "some/model")
    # The default model's gates ship in the package.
    folder = shipped_gates(576, 30, 3)
    assert folder is not None
    shipped = load_gates(folder)
    assert shipped.config.width == 64
    size = sum(p.stat().st_size for p in folder.iterdir())
    assert size < 4 * 2**20


# -------------------------------------------------------------------- serving


def test_gather_log_beta_matches_a_slot_by_slot_loop() -> None:
    from vllm_kvevict.eviction.global_pages import gather_log_beta

    gen = torch.Generator().manual_seed(0)
    heads, bs, num_blocks = 3, 4, 10
    table = torch.randn(num_blocks * heads, bs, generator=gen)
    lens = torch.tensor([5, 0, 9])
    pages = torch.tensor([[7, 2, 0], [0, 0, 0], [11, 4, 20]], dtype=torch.int32)
    block_row = torch.tensor([3, 8, 1, 6], dtype=torch.int32)
    region_start, point = 5, 14
    got = gather_log_beta(table, pages, lens, block_row, region_start, point)
    for h in range(heads):
        want = [float(table[int(pages[h, t // bs]), t % bs]) for t in range(int(lens[h]))]
        want += [float(table[int(block_row[s // bs]) * heads + h, s % bs]) for s in range(region_start, point)]
        assert got[h, : len(want)].tolist() == pytest.approx(want)
        assert bool((got[h, len(want):] == 0).all())


def test_global_kv_views_every_layer_of_one_allocation() -> None:
    from vllm_kvevict.plugin.worker.worker_state import WorkerEvictionState

    state = WorkerEvictionState(3, 2, 4, 8, 64, 0, torch.float32, torch.device("cpu"), max_head_pages=4)
    num_blocks, heads, bs, dim = 5, 2, 4, 8
    buffer = torch.randn(3 * num_blocks * heads * 2 * bs * dim)
    layers = [buffer[i * num_blocks * heads * 2 * bs * dim:][: num_blocks * heads * 2 * bs * dim]
              .view(num_blocks, heads, 2 * bs, dim) for i in range(3)]
    for index in (2, 0, 1):
        whole, offset = state.global_kv(index, layers[index], bs)
        assert offset == index * num_blocks
        assert torch.equal(whole[offset : offset + num_blocks], layers[index])
    assert state.log_beta_pages.shape == (3 * num_blocks * heads, bs)
    with pytest.raises(RuntimeError, match="dense view"):
        state.global_kv(0, layers[0].transpose(0, 1), bs)


def test_unsupported_architectures_get_a_clear_error() -> None:
    from vllm_kvevict.plugin.worker.gate_capture import decoder_attention_modules

    class GPT2LMHeadModel(torch.nn.Module):
        pass

    with pytest.raises(KVEvictionConfigError, match="not for GPT2LMHeadModel"):
        decoder_attention_modules(GPT2LMHeadModel())


def test_the_capture_op_passes_its_input_through_and_keeps_log_beta() -> None:
    from vllm_kvevict.plugin.worker import gate_capture

    gates = RetentionGates(RetentionGateConfig(hidden_size=16, num_layers=2, num_kv_heads=2, width=8,
                                               bias_init=1.0))
    saved = gate_capture._capture
    gate_capture._capture = gate_capture.GateCapture(gates, {"layers.1.attn": 1})
    try:
        hidden = torch.randn(6, 16)
        out = torch.ops.kvevict.retention_gate(hidden, "layers.1.attn")
        assert torch.equal(out, hidden) and out.data_ptr() != hidden.data_ptr()
        log_beta = gate_capture._capture.take("layers.1.attn", 6)
        with torch.no_grad():
            assert torch.equal(log_beta, gates(1, hidden))
        with pytest.raises(RuntimeError, match="no retention-gate input"):
            gate_capture._capture.take("layers.1.attn", 6)
        # Compiled: the op survives and runs at every call.
        compiled = torch.compile(lambda x: torch.ops.kvevict.retention_gate(x, "layers.1.attn") * 2,
                                 backend="eager", fullgraph=True)
        assert torch.equal(compiled(hidden), hidden * 2)
        assert gate_capture._capture.take("layers.1.attn", 6).shape == (6, 2)
    finally:
        gate_capture._capture = saved
    assert math.isfinite(float(log_beta.sum()))


def test_constant_retention_is_a_uniform_sliding_window() -> None:
    """One β for every token and stream makes the global top-B keep
    each stream's most recent tokens, the same number in every stream."""
    streams, width, page, point = 6, 120, 8, 400
    positions = torch.sort(torch.randperm(point)[:width]).values.repeat(streams, 1)
    keys = torch.randn(streams, width, 4)
    inputs = ScoringInputs(keys, keys, positions, None, None, 1.0)
    inputs.log_beta = torch.full((streams, width), math.log(0.97))
    inputs.step = point
    policy = make_policy("learned")
    scores = policy.masked_scores(inputs, 0, 0, point)
    counts = allocate_head_tokens(GlobalAllocation(), scores, total_pages=30, page_size=page)
    assert counts.tolist() == [40] * streams
    kept = select_top(scores, counts)
    assert all(kept[s].tolist() == list(range(width - 40, width)) for s in range(streams))
