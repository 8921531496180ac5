"""Preemption, aborts and isolation for each storage mode, through the offline ``LLM``.

One engine per storage mode, each with a shipped config's policy and storage
and a small schedule (budget 64, a decode eviction every 4 tokens, per-chunk
prefill every 128 tokens, which is also the step's token budget) in a KV pool
of 12 blocks, the fewest that admit a request. What is asserted here
(outputs equal to the same request run alone, every block back, no poisoned
read) does not depend on what the model knows: the slots and pooled-layer
engines serve the tiny random Llama (conftest's ``tiny_model_dir``: the
default model's architecture and tokenizer, 4 layers, 4 KV heads), whose
steps cost a fraction of the default model's. The head-pages engines serve
the default model: on the tiny one, the request recomputed after its
preemption gave a token different from its run alone two tokens after the
recompute ended (all three head-pages cases, twice; slots and pooled layers
gave equal outputs), a difference the default model's outputs do not show.

* ``slots``: SnapKV (configs/snapkv.yaml);
* ``head_pages``: AdaKV + SnapKV (configs/adakv_snapkv.yaml);
* ``head_pages_moments``: MomentKV, head pages with the moment correction
  (configs/momentkv.yaml);
* ``global``: the learned policy (configs/learned.yaml) with seeded random
  gates for the tiny model, one ranking over every layer's pooled blocks;
* ``head_pages_prefix``: AdaKV + SnapKV with ``prefix_caching: shared`` (the
  first 64 tokens of a prompt protected and cached; two more pool blocks).

The whole suite runs with ``KVEVICT_POISON_FREED_BLOCKS=1`` (see conftest):
blocks returned to vLLM's pool are filled with NaN and every attention output
is checked for it (the worker's ``nan_outputs``).

Preemption. vLLM admits a request when the blocks of its prompt are free, and
an evicting request grows while it decodes until it holds its budget. Three
requests with one-block prompts and a fourth with a ~200-token prompt,
admitted last, outgrow the pool, and vLLM preempts the youngest (recompute
mode: its blocks are freed and it restarts from token 0 with its generated
tokens as part of the recomputed prefix). Its recomputed prefix crosses the
end of its prompt and several decode points in one step; the worker evicts at
each point inside the pass and recomputes the attention of the tokens after
it, and counts such steps (``multi_point_steps`` in its stats file). Each
request's greedy output then equals the same request run alone. (That a
request alone equals the transformers reference decoder is shown per storage
mode by test_e2e_serve.py, test_head_pages.py and test_learned_e2e.py.)

Pooled layers (``global``) are ranked once, after the last layer, at the
step's last eviction point: tokens of the step after an earlier point attend
to the cache as it was before that point, so a step that crosses several
points can change the output. Measured with this engine on the default model: four requests of
88 to 232 prompt tokens run together, without preemption, in three steps
that each crossed a prefill point and the end of a prompt; three of the four
outputs differed from their runs alone from the first token (three times out
of three). For pooled layers the test asserts what holds: every request
completes, no NaN, nothing leaked, and requests batched so that no step
crosses two points give the output they give alone.
"""

from __future__ import annotations

import json
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from helpers import model_block_bytes, needle_prompt

pytestmark = pytest.mark.e2e

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
POOL_BLOCKS = 12  # the fewest that admit a request: budget + interval + step + block
CHUNK = 128
SCHEDULE = {
    "budget": 64,
    "decode_interval": 4,
    "prefill_mode": "per_chunk",
    "prefill_interval": CHUNK,
}
MAX_TOKENS = 80


@dataclass(frozen=True)
class StorageCase:
    storage: str  # what the worker uses (slots, head_pages, global)
    config_file: str  # configs/NAME.yaml: the policy and its storage settings
    # Whether a request's output is independent of how the scheduler cut its
    # steps (every eviction point applied inside the forward pass).
    same_output_under_load: bool = True
    options: tuple[tuple[str, object], ...] = ()  # settings on top of the config's
    extra_blocks: int = 0  # pool blocks on top of POOL_BLOCKS
    tiny_model: bool = True  # the tiny random Llama, else the default model

    def eviction(self, gates_dir: str) -> dict:
        """The config file's settings, the schedule, the case's options; on
        the tiny model, the learned policy's gates are its (``gates_dir``)."""
        from vllm_kvevict.config import parse_config_source

        settings = parse_config_source(str(CONFIG_DIR / f"{self.config_file}.yaml"))
        if settings["policy"] == "learned" and self.tiny_model:
            settings["policy_options"] = {**settings.get("policy_options", {}), "gates": gates_dir}
        return {**settings, **SCHEDULE, **dict(self.options)}


CASES = {
    "slots": StorageCase("slots", "snapkv"),
    "head_pages": StorageCase("head_pages", "adakv_snapkv", tiny_model=False),
    "head_pages_moments": StorageCase("head_pages", "momentkv", tiny_model=False),
    "global": StorageCase("global", "learned", same_output_under_load=False),
    # prefix_caching shared: the long prompt's first two blocks are protected
    # and cached (the pool grows by them); a preempted request finds them again.
    "head_pages_prefix": StorageCase(
        "head_pages", "adakv_snapkv",
        options=(("prefix_caching", "shared"), ("max_protected_prefix_tokens", 64)), extra_blocks=2,
        tiny_model=False,
    ),
}


@dataclass
class Engine:
    llm: object
    case: StorageCase
    eviction: dict
    stats_path: Path

    def stats(self) -> dict:
        return json.loads(self.stats_path.read_text())

    def worker_stats(self) -> dict:
        return json.loads(Path(f"{self.stats_path}.worker0").read_text())

    def wait_idle(self, timeout: float = 30) -> tuple[dict, dict]:
        """The counters once no request holds a block or a side-buffer row
        (the worker frees a finished request's row at its next step)."""
        deadline = time.monotonic() + timeout
        while True:
            stats, worker = self.stats(), self.worker_stats()
            if (
                stats["live_requests"] == 0
                and stats["free_blocks"] == stats["num_blocks"] - 1
                and worker["rows_in_use"] == 0
            ):
                return stats, worker
            if time.monotonic() > deadline:
                raise TimeoutError(f"not idle after {timeout}s: {stats} {worker}")
            time.sleep(0.1)

    def preemptions(self) -> int:
        return self.counter("vllm:num_preemptions")

    def counter(self, name: str) -> int:
        return int(sum(m.value for m in self.llm.get_metrics() if m.name == name))


@pytest.fixture(scope="module")
def tiny_gates(tiny_model_dir, tmp_path_factory) -> str:
    from tiny_model import build_tiny_gates

    return str(build_tiny_gates(Path(tiny_model_dir), tmp_path_factory.mktemp("preemption_gates") / "gates"))


@pytest.fixture(scope="module", params=list(CASES))
def engine(request, model_dir, tiny_model_dir, tiny_gates, tmp_path_factory):
    from vllm import LLM

    from vllm_kvevict.config import build_config
    from vllm_kvevict.evaluation.serving_bench import kv_cache_memory_bytes

    case = CASES[request.param]
    eviction = case.eviction(tiny_gates)
    model = tiny_model_dir if case.tiny_model else model_dir
    config = build_config(eviction)
    storage = "global" if config.pools_layers else "head_pages" if config.uses_head_pages else "slots"
    assert storage == case.storage, f"configs/{case.config_file}.yaml no longer uses {case.storage}"
    stats_path = tmp_path_factory.mktemp(f"preemption_{request.param}") / "stats.json"
    os.environ["KVEVICT_STATS_PATH"] = str(stats_path)  # inherited by the engine process
    llm = LLM(
        model,
        dtype="float32",
        max_model_len=4096,
        block_size=32,
        max_num_batched_tokens=CHUNK,
        max_num_seqs=8,
        enforce_eager=True,
        disable_log_stats=False,
        kv_cache_memory_bytes=kv_cache_memory_bytes(POOL_BLOCKS + case.extra_blocks, model_block_bytes(model)),
        enable_prefix_caching=eviction.get("prefix_caching") == "shared",
        additional_config={"kv_eviction": eviction},
    )
    try:
        yield Engine(llm, case, eviction, stats_path)
    finally:
        del os.environ["KVEVICT_STATS_PATH"]
        llm.llm_engine.engine_core.shutdown()


def _short_prompt(tokenizer, key: int) -> list[int]:
    text = f"The pass key is {key}. Remember it. Now write a long story about the number {key}."
    return tokenizer(text).input_ids


def _generate(llm, prompts: list[list[int]], max_tokens: int = MAX_TOKENS) -> list:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outputs]


def test_preempted_requests_evict_as_before(engine, tokenizer):
    """Under preemption and shared step budgets, with freed blocks poisoned:
    every request completes with finite logprobs, no attention output reads
    NaN, every block and side-buffer row comes back, and (but for pooled
    layers, below) each output equals the request run alone."""
    llm = engine.llm
    rng = random.Random()
    keys = [rng.randint(10000, 99999) for _ in range(4)]
    prompts = [_short_prompt(tokenizer, k) for k in keys[:3]]
    prompts.append(tokenizer(needle_prompt(tokenizer, keys[3], target_tokens=200)).input_ids)
    assert all(len(p) <= 32 for p in prompts[:3]) and 160 <= len(prompts[3]) <= 224

    alone = []
    for prompt in prompts:
        before = engine.preemptions()
        alone.extend(_generate(llm, [prompt]))
        assert engine.preemptions() == before, "a request alone must fit the pool"
    _, worker_before = engine.wait_idle()

    before = engine.preemptions()
    hits = engine.counter("vllm:prefix_cache_hits")
    together = _generate(llm, prompts)
    preemptions = engine.preemptions() - before
    if engine.eviction.get("prefix_caching") == "shared":
        # the long prompt's protected blocks, cached by its run alone
        assert engine.counter("vllm:prefix_cache_hits") > hits
    stats, worker = engine.wait_idle()
    multi_point = worker["multi_point_steps"] - worker_before["multi_point_steps"]
    assert preemptions > 0, "the load was meant to force preemption"
    # The preempted request had decoded past two decode points: its recomputed
    # prefix crosses them in one step.
    traces = stats["recent_requests"]
    runs = {}
    for trace in traces:
        runs.setdefault(trace["request_id"], []).append(trace)
    preempted = [t[0] for t in runs.values() if len(t) > 1]
    assert any(
        t["tokens"] >= t["prompt_len"] + 2 * SCHEDULE["decode_interval"] for t in preempted
    ), traces
    assert multi_point > 0, "steps crossing several eviction points were expected"
    for i, output in enumerate(together):
        assert len(output.token_ids) == MAX_TOKENS
        assert all(math.isfinite(lp[t].logprob) for t, lp in zip(output.token_ids, output.logprobs)), i
    assert stats["blocks_freed_by_eviction"] > 0
    assert worker["nan_outputs"] == 0
    assert worker["blocks_poisoned"] > worker_before["blocks_poisoned"]

    if engine.case.same_output_under_load:
        for i, (a, t) in enumerate(zip(alone, together)):
            assert t.token_ids == a.token_ids, f"request {i}: output changed under preemption"
        return
    # Pooled layers apply the points inside one step at the step's last point,
    # so a step that crosses several may change the output. Requests batched
    # so that no step crosses two points (prompts of one chunk, no
    # preemption) give the output they give alone.
    before = engine.preemptions()
    pair = _generate(llm, prompts[:2])
    _, after = engine.wait_idle()
    assert engine.preemptions() == before
    assert after["multi_point_steps"] == worker["multi_point_steps"]
    assert [p.token_ids for p in pair] == [a.token_ids for a in alone[:2]]
    assert after["nan_outputs"] == 0


def _add(core, request_id: str, prompt: list[int], **options) -> str:
    from vllm import SamplingParams

    params = SamplingParams(temperature=0, ignore_eos=True, **options)
    return core.add_request(request_id, {"prompt_token_ids": prompt}, params)


def _drive(core, abort_after: dict[str, int]) -> dict[str, int]:
    """Step the engine until no request is left, aborting request ``r`` once
    it has ``abort_after[r]`` tokens; the tokens each request got."""
    got = dict.fromkeys(abort_after, 0)
    aborted: set[str] = set()
    while core.has_unfinished_requests():
        for output in core.step():
            rid = output.request_id
            got[rid] = len(output.outputs[0].token_ids)
            limit = abort_after.get(rid)
            if limit is not None and got[rid] >= limit and not output.finished and rid not in aborted:
                core.abort_request([rid])
                aborted.add(rid)
    return got


def test_aborts_and_early_stops_free_every_block_and_row(engine, tokenizer):
    """Requests aborted mid-decode, during chunked prefill and several at
    once, and requests ending on max_tokens or a stop string between two
    eviction points: every block goes back to vLLM's pool, every side-buffer
    row is freed, no attention output reads a poisoned block, and a later
    answer is unchanged."""
    from vllm import SamplingParams

    llm, core = engine.llm, engine.llm.llm_engine
    rng = random.Random()
    prompt = tokenizer(needle_prompt(tokenizer, rng.randint(10000, 99999), target_tokens=200)).input_ids
    # max_tokens 42: the request ends between two decode points (every 4 tokens)
    params = SamplingParams(max_tokens=42, temperature=0, ignore_eos=True)
    (expected,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(expected.outputs[0].token_ids) == 42
    before, _ = engine.wait_idle()

    # Aborted mid-decode, past the prompt's evictions and two decode points.
    _add(core, "decode", prompt, max_tokens=200)
    assert _drive(core, {"decode": 10}) == {"decode": 10}
    # Cancelled during chunked prefill, once the prompt's first chunks were
    # evicted (~1,000 tokens in chunks of 128).
    long_prompt = tokenizer(needle_prompt(tokenizer, rng.randint(10000, 99999), 1000)).input_ids
    freed = engine.stats()["blocks_freed_by_eviction"]
    internal_id = _add(core, "prefill", long_prompt, max_tokens=20)
    deadline = time.monotonic() + 60
    while engine.stats()["blocks_freed_by_eviction"] == freed and time.monotonic() < deadline:
        time.sleep(0.02)
    core.abort_request(["prefill"])
    # Several at once, dropped at random points.
    several = {}
    for i in range(3):
        _add(core, f"several{i}", _short_prompt(tokenizer, rng.randint(10000, 99999)), max_tokens=60)
        several[f"several{i}"] = rng.randint(1, 40)
    assert _drive(core, several) == several
    # A stop string: the last characters of the known greedy answer's first 21
    # tokens, so the request stops by its 21st token whatever the answer's words
    # (a needle answer can be one run of digits, whose only word ends at token 42).
    text = expected.outputs[0].text
    head = tokenizer.decode(expected.outputs[0].token_ids[:21], skip_special_tokens=True)  # as vLLM's text
    assert text.startswith(head) and head.strip(), (head, text)
    stop = head[-4:]
    (stopped,) = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=42, temperature=0, ignore_eos=True, stop=[stop]),
        use_tqdm=False,
    )
    assert stopped.outputs[0].stop_reason == stop, (stop, text, stopped.outputs[0])
    assert len(stopped.outputs[0].token_ids) < 42 and text.startswith(stopped.outputs[0].text)

    stats, worker = engine.wait_idle()
    cancelled = next(t for t in stats["recent_requests"] if t["request_id"] == internal_id)
    assert 0 < cancelled["tokens"] < cancelled["prompt_len"], cancelled  # still in its prompt
    assert stats["requests_admitted"] >= before["requests_admitted"] + 6
    assert worker["nan_outputs"] == 0
    # Nothing the aborted requests left behind changes a later answer.
    (again,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert again.outputs[0].token_ids == expected.outputs[0].token_ids
