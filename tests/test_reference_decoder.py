"""Tests of the reference evicting decoder (the oracle for the vLLM plugin).

The checks are independent of the code under test where it matters:
* without eviction, the custom attention path must reproduce stock
  transformers greedy decoding token for token;
* with StreamingLLM, the retained set is known in closed form, so a stock
  transformers model with a KV cache and an explicit 4-D mask hiding the
  evicted tokens is a second, independent implementation of eviction;
* with SnapKV, the retained counts, sinks and recent window follow the
  schedule, and KV heads really choose different tokens.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from vllm_kvevict.config import EvictionConfig
from vllm_kvevict.default_model import fetch_default_model
from vllm_kvevict.reference import ReferenceEvictingDecoder

# A varied passage (not a repetition) so that greedy continuations depend on
# which tokens are retained. 359 tokens with the SmolLM2 tokenizer.
PASSAGE = (
    "Marie Curie was born in Warsaw in 1867, the youngest of five children of two "
    "teachers. Because women could not enroll at the university in Russian-controlled "
    "Poland, she studied in secret at the so-called Flying University before moving to "
    "Paris in 1891, where she earned degrees in physics and mathematics at the Sorbonne. "
    "There she met Pierre Curie, a physicist who worked on crystals and magnetism; they "
    "married in 1895 and began to study the mysterious rays that Henri Becquerel had "
    "found coming from uranium salts. Working in a drafty shed, the couple processed tons "
    "of pitchblende by hand and in 1898 announced two new elements, polonium, named after "
    "her homeland, and radium. In 1903 the Curies shared the Nobel Prize in Physics with "
    "Becquerel. After Pierre was killed by a horse-drawn wagon in 1906, Marie took over his "
    "professorship, becoming the first woman to teach at the Sorbonne, and in 1911 she "
    "received a second Nobel Prize, this time in chemistry, for isolating pure radium. "
    "During the First World War she designed mobile X-ray units, nicknamed little Curies, "
    "and trained about one hundred and fifty women to operate them near the front lines. "
    "Her daughter Irene later won a Nobel Prize of her own with her husband Frederic "
    "Joliot for discovering artificial radioactivity. Marie died in 1934 of aplastic "
    "anemia, most likely caused by years of exposure to radiation; her notebooks are "
    "still so radioactive that they are kept in lead-lined boxes. Question: in which "
    "city was Marie Curie born, and which two elements did she discover? Answer:"
)

EVICTION = dict(budget=64, sink_tokens=4, recent_window=16, observation_window=8, decode_interval=8)
BLOCK_SIZE = 32
CHUNK_SIZE = 64
NEW_TOKENS = 20


# ----------------------------------------------------------------- helpers


def expected_eviction_point(n: int, prompt_len: int, interval: int, prefill_mode: str) -> int:
    """The last eviction point at or below ``n`` (callers ask at step ends):
    every prefill chunk end (``per_chunk``) or only the prompt's end
    (``end_of_prompt``), then every ``interval`` decode steps."""
    if n < prompt_len:
        return n if prefill_mode == "per_chunk" else 0
    return prompt_len + (n - prompt_len) // interval * interval


def expected_streaming_retained(
    n: int, prompt_len: int, budget: int, block_size: int, interval: int, sinks: int,
    prefill_mode: str,
) -> list[int]:
    """StreamingLLM's retained positions after ``n`` processed tokens.

    Written from the schedule's documented rule, not with EvictionSchedule:
    the last eviction point P keeps ``P - F`` tokens, F = floor((P - budget) / block) * block: the sinks plus
    the most recent ``P - F - sinks`` positions before P; everything >= P is
    kept too.
    """
    point = expected_eviction_point(n, prompt_len, interval, prefill_mode)
    frontier = max(0, (point - budget) // block_size) * block_size
    if frontier == 0:  # the frontier never moved: nothing was ever evicted
        return list(range(n))
    keep = point - frontier
    return list(range(sinks)) + list(range(point - (keep - sinks), n))


def greedy_with_masked_cache(
    model: torch.nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    chunk_size: int,
    retained: Callable[[int], list[int]],
) -> list[int]:
    """Greedy decoding with stock transformers (its own attention, DynamicCache)
    where each step sees only ``retained(n_before)`` of the cached tokens plus
    its own tokens causally: an independent implementation of eviction whose
    retained set is the same for all layers and heads (StreamingLLM)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    prompt_len = len(prompt_ids)
    tokens = list(prompt_ids)
    out: list[int] = []
    n = 0
    with torch.inference_mode():
        while len(out) < max_new_tokens:
            n_after = min(n + chunk_size, prompt_len) if n < prompt_len else n + 1
            visible = torch.zeros(n_after - n, n_after, dtype=torch.bool)
            if n > 0:
                visible[:, torch.tensor(retained(n), dtype=torch.long)] = True
            visible[:, n:] = torch.ones(n_after - n, n_after - n, dtype=torch.bool).tril()
            mask = torch.zeros(1, 1, n_after - n, n_after).masked_fill(~visible, float("-inf"))
            logits = model(
                input_ids=torch.tensor([tokens[n:n_after]]),
                position_ids=torch.arange(n, n_after)[None],
                attention_mask=mask,
                past_key_values=cache,
                use_cache=True,
            ).logits
            n = n_after
            if n >= prompt_len:
                out.append(int(torch.argmax(logits[0, -1])))
                tokens.append(out[-1])
    return out


def hf_greedy(model: torch.nn.Module, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """Stock ``model.generate`` greedy, full cache, never stopping at EOS."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None
    config.do_sample = False
    config.max_new_tokens = max_new_tokens
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[0, len(prompt_ids) :].tolist()


# ----------------------------------------------------------------- tiny model (fast)


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random 2-layer GQA Llama: exercises every code path in a second."""
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        max_position_embeddings=256, initializer_range=0.2,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    path = tmp_path_factory.mktemp("tiny_llama")
    LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def tiny_prompt() -> list[int]:
    return torch.randint(0, 97, (45,), generator=torch.Generator().manual_seed(1)).tolist()


def test_tiny_full_cache_matches_transformers(tiny_model_dir: Path, tiny_prompt: list[int]) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    expected = hf_greedy(model, tiny_prompt, 12)
    decoder = ReferenceEvictingDecoder(tiny_model_dir, None, chunk_size=7)
    assert decoder.generate(tiny_prompt, 12) == expected
    # Reusable: a second request starts from an empty store.
    assert decoder.generate(tiny_prompt[:20], 5) == hf_greedy(model, tiny_prompt[:20], 5)
    assert decoder.generate(tiny_prompt, 12) == expected
    assert [p.shape for p in decoder.retained_positions] == [(2, 45 + 11)] * 2


def test_tiny_budget_never_reached_is_full_cache(tiny_model_dir: Path, tiny_prompt: list[int]) -> None:
    full = ReferenceEvictingDecoder(tiny_model_dir, None, chunk_size=7).generate(tiny_prompt, 12)
    config = EvictionConfig(policy="snapkv", budget=200, sink_tokens=2, recent_window=4,
                            observation_window=4, decode_interval=3)
    decoder = ReferenceEvictingDecoder(tiny_model_dir, config, block_size=8, chunk_size=7)
    assert decoder.generate(tiny_prompt, 12) == full
    assert all(torch.equal(p, torch.arange(56).expand(2, -1)) for p in decoder.retained_positions)


@pytest.mark.parametrize("prefill_mode", ["per_chunk", "end_of_prompt"])
def test_tiny_streaming_matches_masked_transformers(
    tiny_model_dir: Path, tiny_prompt: list[int], prefill_mode: str
) -> None:
    config = EvictionConfig(policy="streamingllm", budget=12, sink_tokens=2, recent_window=4,
                            decode_interval=3, prefill_mode=prefill_mode)
    block, chunk, new = 4, 7, 12
    decoder = ReferenceEvictingDecoder(tiny_model_dir, config, block_size=block, chunk_size=chunk)
    got = decoder.generate(tiny_prompt, new)

    def retained(n: int) -> list[int]:
        return expected_streaming_retained(n, len(tiny_prompt), 12, block, 3, 2, prefill_mode)

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="eager").eval()
    assert got == greedy_with_masked_cache(model, tiny_prompt, new, chunk, retained)
    # Eviction must matter here, otherwise the comparison above proves little.
    assert got != hf_greedy(model, tiny_prompt, new)
    n = len(tiny_prompt) + new - 1
    for positions in decoder.retained_positions:
        assert positions.tolist() == [retained(n)] * 2


class _SpyPolicy:
    """Wraps the decoder's policy and records what it is asked to score."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.needs_queries: bool = inner.needs_queries
        self.needs_rotary: bool = inner.needs_rotary
        self.needs_output_projection: bool = inner.needs_output_projection
        self.scores_ragged_heads: bool = inner.scores_ragged_heads
        self.refines = True  # refine_scores below records the selection
        self.calls: list[tuple[Any, ...]] = []

    @property
    def name(self) -> str:
        return self.inner.name

    def score(self, inputs: Any) -> torch.Tensor:
        return self.inner.score(inputs)

    def mask_scores(
        self, scores: torch.Tensor, inputs: Any, num_sink: int, num_recent: int, point: int,
        live: Any = None,
    ) -> torch.Tensor:
        self._scored = (num_sink, num_recent, point)
        return self.inner.mask_scores(scores, inputs, num_sink, num_recent, point, live)

    def refine_scores(self, inputs: Any, scores: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        # Every head keeps the same count here (slots storage): the policy's
        # own selection of that many tokens.
        num_sink, num_recent, point = self._scored
        num_keep = int(counts[0])
        kept = self.inner.select(inputs, num_keep, num_sink, num_recent, point)
        self.calls.append((inputs, num_keep, num_sink, num_recent, point, kept))
        return self.inner.refine_scores(inputs, scores, counts)


@pytest.mark.parametrize("prefill_mode", ["per_chunk", "end_of_prompt"])
def test_tiny_snapkv_scoring_inputs(
    tiny_model_dir: Path, tiny_prompt: list[int], prefill_mode: str
) -> None:
    """The policy gets the right points, budgets, post-RoPE keys and queries.

    Layer 0's keys and queries do not depend on eviction (they are
    projections of the embeddings), so they are recomputed independently here
    from the model's weights and RoPE.
    """
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    budget, block, interval, window, chunk, new = 12, 4, 3, 5, 7, 12
    config = EvictionConfig(policy="snapkv", budget=budget, sink_tokens=2, recent_window=4,
                            observation_window=window, decode_interval=interval,
                            prefill_mode=prefill_mode)
    decoder = ReferenceEvictingDecoder(tiny_model_dir, config, block_size=block, chunk_size=chunk)
    spy = _SpyPolicy(decoder.policy)
    decoder.policy = spy
    generated = decoder.generate(tiny_prompt, new)
    prompt_len = len(tiny_prompt)

    # Eviction points: chunk ends (per_chunk) or the prompt's end, then every
    # `interval` decode steps; a policy call happens only where the frontier
    # moved (else nothing is over budget).
    n = prompt_len + new - 1
    points = sorted({min(e, prompt_len) for e in range(chunk, prompt_len + chunk, chunk)})
    if prefill_mode == "end_of_prompt":
        points = [prompt_len]
    points += list(range(prompt_len + interval, n + 1, interval))
    expected_calls, prev_frontier = [], 0
    for point in points:
        frontier = max(0, (point - budget) // block) * block
        if frontier > prev_frontier:
            expected_calls += [(point, point - frontier)] * 2  # 2 layers
        prev_frontier = frontier
    assert [(c[4], c[1]) for c in spy.calls] == expected_calls

    # Independent layer-0 post-RoPE queries/keys for the whole sequence.
    model = decoder.model
    tokens = torch.tensor([tiny_prompt + generated[:-1]])
    positions = torch.arange(n)[None]
    attn = model.model.layers[0].self_attn
    with torch.inference_mode():
        hidden = model.model.layers[0].input_layernorm(model.model.embed_tokens(tokens))
        q = attn.q_proj(hidden).view(1, n, -1, 16).transpose(1, 2)
        k = attn.k_proj(hidden).view(1, n, -1, 16).transpose(1, 2)
        cos, sin = model.model.rotary_emb(hidden, positions)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
    q, k = q[0], k[0]  # [Hq, n, D], [H, n, D]

    for inputs, num_keep, num_sink, num_recent, point, kept in spy.calls[0::2]:  # layer 0
        assert (num_sink, num_recent) == (2, 4)
        assert inputs.scale == pytest.approx(16**-0.5)
        obs = torch.arange(max(0, point - window), point)
        assert torch.equal(inputs.query_positions, obs)
        torch.testing.assert_close(inputs.queries, q[:, obs])
        key_pos = inputs.key_positions
        assert key_pos.shape[1] > num_keep and int(key_pos.max()) < point
        for head in range(2):
            torch.testing.assert_close(inputs.keys[head], k[head, key_pos[head]])
        assert kept.shape == (2, num_keep)


# ----------------------------------------------------------------- real model


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return Path(fetch_default_model())


@pytest.fixture(scope="module")
def prompt_ids(model_dir: Path) -> list[int]:
    ids = AutoTokenizer.from_pretrained(model_dir)(PASSAGE).input_ids
    assert 300 <= len(ids) <= 400
    return ids


@pytest.fixture(scope="module")
def hf_model(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def test_full_cache_matches_transformers_generate(
    model_dir: Path, prompt_ids: list[int], hf_model: torch.nn.Module
) -> None:
    expected = hf_greedy(hf_model, prompt_ids, 16)
    decoder = ReferenceEvictingDecoder(model_dir, None, chunk_size=CHUNK_SIZE)
    assert decoder.generate(prompt_ids, 16) == expected
    n = len(prompt_ids) + 15
    assert all(torch.equal(p, torch.arange(n).expand(3, -1)) for p in decoder.retained_positions)


@pytest.mark.parametrize("prefill_mode", ["end_of_prompt", "per_chunk"])
def test_snapkv_retained_tokens_follow_schedule(
    model_dir: Path, prompt_ids: list[int], prefill_mode: str
) -> None:
    config = EvictionConfig(policy="snapkv", prefill_mode=prefill_mode, **EVICTION)
    decoder = ReferenceEvictingDecoder(model_dir, config, block_size=BLOCK_SIZE, chunk_size=CHUNK_SIZE)
    tokens = decoder.generate(prompt_ids, NEW_TOKENS)
    assert len(tokens) == NEW_TOKENS

    prompt_len = len(prompt_ids)
    n = prompt_len + NEW_TOKENS - 1  # the last sampled token is never fed back
    sched = config.schedule(BLOCK_SIZE, CHUNK_SIZE)
    assert sched.prefill_mode == prefill_mode
    last_point = sched.last_eviction_point(n, prompt_len)
    expected_count = n - sched.frontier(n, prompt_len)
    if prompt_len == 359:  # worked by hand: P = 375, F = 288
        assert (last_point, expected_count) == (375, 90)

    assert decoder.processed_tokens == n
    assert len(decoder.retained_positions) == 30
    heads_differ = False
    for positions in decoder.retained_positions:
        assert positions.shape == (3, expected_count)
        for head in positions.tolist():
            assert head == sorted(set(head))
            assert head[:4] == [0, 1, 2, 3]
            assert set(range(last_point - config.recent_window, n)) <= set(head)
            assert max(head) < n
        heads_differ |= len({tuple(h) for h in positions.tolist()}) > 1
    assert heads_differ, "SnapKV selects per KV head; every layer kept identical sets"


def test_streaming_llm_keeps_sinks_and_recent(
    model_dir: Path, prompt_ids: list[int], hf_model: torch.nn.Module
) -> None:
    config = EvictionConfig(policy="streamingllm", prefill_mode="per_chunk", **EVICTION)
    decoder = ReferenceEvictingDecoder(model_dir, config, block_size=BLOCK_SIZE, chunk_size=CHUNK_SIZE)
    tokens = decoder.generate(prompt_ids, NEW_TOKENS)

    prompt_len = len(prompt_ids)
    n = prompt_len + NEW_TOKENS - 1

    def retained(m: int) -> list[int]:
        return expected_streaming_retained(
            m, prompt_len, config.budget, BLOCK_SIZE, config.decode_interval,
            config.sink_tokens, config.prefill_mode,
        )

    expected = retained(n)
    if prompt_len == 359:  # worked by hand: P = 375, F = 288, keep 87 = 4 sinks + [292, 375)
        assert expected == [0, 1, 2, 3] + list(range(292, 378))
    for positions in decoder.retained_positions:
        assert positions.tolist() == [expected] * 3

    # An independent implementation of the same eviction (stock transformers,
    # cache + explicit mask) must produce the same greedy tokens.
    assert tokens == greedy_with_masked_cache(hf_model, prompt_ids, NEW_TOKENS, CHUNK_SIZE, retained)


# ------------------------------------------------ one prompt, several settings


@pytest.mark.parametrize(
    "overrides",
    [
        dict(policy="snapkv"),
        dict(policy="snapkv", head_budget="adaptive"),
        dict(policy="momentkv"),
        dict(policy="snapkv", head_budget="adaptive", moment_correction=True),
        dict(policy="criticalkv"),
        dict(policy="pyramidkv"),
        None,
    ],
    ids=["snapkv", "adakv", "momentkv", "correction", "criticalkv", "pyramidkv", "full"],
)
def test_continue_from_one_prefill_equals_generate(
    model_dir: Path, prompt_ids: list[int], overrides: dict[str, Any] | None
) -> None:
    """run_prompt + continue_from (one full-cache prefill shared by settings)
    gives generate's tokens and retained positions, per setting, on a decoder
    that ran other settings before."""
    config = None if overrides is None else EvictionConfig(
        prefill_mode="end_of_prompt", **{**EVICTION, "decode_interval": 8}, **overrides
    )
    expected = ReferenceEvictingDecoder(model_dir, config, chunk_size=CHUNK_SIZE)
    want = expected.generate(prompt_ids, NEW_TOKENS)
    shared = ReferenceEvictingDecoder(model_dir, None, chunk_size=CHUNK_SIZE)
    state = shared.run_prompt(prompt_ids, keep_queries=32)
    other = EvictionConfig(policy="knorm", budget=96, prefill_mode="end_of_prompt")  # runs first; must leave nothing behind
    shared.continue_from(state, other, 5)
    got = shared.continue_from(state, config, NEW_TOKENS)
    assert got == want
    for mine, theirs in zip(shared.retained_positions, expected.retained_positions, strict=True):
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize(
    "overrides",
    [dict(policy="snapkv"), dict(policy="snapkv", head_budget="adaptive"), dict(policy="momentkv"), None],
    ids=["snapkv", "adakv", "momentkv", "full"],
)
def test_question_after_the_context_eviction(
    model_dir: Path, prompt_ids: list[int], overrides: dict[str, Any] | None
) -> None:
    """Query-agnostic: continue_from a context-only state with the question's
    ids equals the decoder's own chunked prefill of the context (evicting at
    its end), then the question written in steps that end at the decode-time
    eviction points (every 8 tokens after the context), then greedy decoding:
    the same tokens and retained positions, those evictions included. The
    full cache gives the whole prompt's tokens."""
    split = 300
    context, question = prompt_ids[:split], prompt_ids[split:]
    assert len(question) > 2 * EVICTION["decode_interval"]  # pieces end at decode-time points
    config = None if overrides is None else EvictionConfig(prefill_mode="end_of_prompt", **EVICTION, **overrides)
    shared = ReferenceEvictingDecoder(model_dir, None, chunk_size=CHUNK_SIZE)
    state = shared.run_prompt(context, keep_queries=EVICTION["observation_window"])
    shared.continue_from(state, EvictionConfig(policy="knorm", budget=96, prefill_mode="end_of_prompt"), 3,
                         question_ids=question[:5])  # runs first; must leave nothing behind
    got = shared.continue_from(state, config, NEW_TOKENS, question_ids=question)
    if config is None:
        whole = ReferenceEvictingDecoder(model_dir, None, chunk_size=CHUNK_SIZE)
        assert got == whole.generate(prompt_ids, NEW_TOKENS)
        return

    own = ReferenceEvictingDecoder(model_dir, config, chunk_size=CHUNK_SIZE)
    own.generate(context, 1)  # evicts at the context's end
    interval = EVICTION["decode_interval"]
    with torch.inference_mode():  # the decode-time points: split + 8, split + 16, ...
        for n in range(split, len(prompt_ids), interval):
            end = min(n + interval, len(prompt_ids))
            logits = own._run_step(prompt_ids[n:end], n, end, split)
        want = [int(torch.argmax(logits))]
        for n in range(len(prompt_ids), len(prompt_ids) + NEW_TOKENS - 1):
            want.append(int(torch.argmax(own._run_step([want[-1]], n, n + 1, split))))
    assert got == want
    kept = [store.positions for store in own._layers]
    for mine, theirs in zip(shared.retained_positions, kept, strict=True):
        assert torch.equal(mine, theirs)
    assert all(bool((positions < split).sum(dim=1).lt(split).all()) for positions in kept)


def test_continue_from_refuses_evictions_inside_the_prompt(model_dir: Path, prompt_ids: list[int]) -> None:
    decoder = ReferenceEvictingDecoder(model_dir, None)
    state = decoder.run_prompt(prompt_ids, keep_queries=8)
    with pytest.raises(ValueError, match="end-of-prompt eviction"):
        decoder.continue_from(state, EvictionConfig(policy="snapkv", prefill_mode="per_chunk", **EVICTION), 4)
    with pytest.raises(ValueError, match="keep_queries=32"):
        decoder.continue_from(state, EvictionConfig(
            policy="snapkv", prefill_mode="end_of_prompt", **{**EVICTION, "observation_window": 32}), 4)


def test_pyramidkv_layers_keep_falling_budgets_at_the_uniform_memory(model_dir: Path, prompt_ids: list[int]) -> None:
    """PyramidKV in the reference: after the end-of-prompt eviction every
    layer keeps whole pages, the first layer more than the last, heads of a
    layer alike, and the layers together the uniform budget's pages."""
    config = EvictionConfig(
        policy="pyramidkv", prefill_mode="end_of_prompt", **{**EVICTION, "budget": 128}
    )
    decoder = ReferenceEvictingDecoder(model_dir, config, block_size=BLOCK_SIZE, chunk_size=CHUNK_SIZE)
    decoder.generate(prompt_ids, 1)  # the eviction at the prompt's end, no decode step after it
    counts = torch.stack([(p < len(prompt_ids)).sum(-1) for p in decoder.retained_positions])  # [L, H]
    assert bool((counts == counts[:, :1]).all())
    assert int(counts[0, 0]) > int(counts[-1, 0])
    assert bool((counts[:-1, 0] >= counts[1:, 0]).all())
    layers, heads = counts.shape
    pages = ((counts + BLOCK_SIZE - 1) // BLOCK_SIZE).sum()
    assert int(pages) <= layers * heads * (128 // BLOCK_SIZE)
    assert int(counts.sum()) > layers * heads * (128 - BLOCK_SIZE)
