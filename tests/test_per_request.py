"""Per-request eviction settings (``kv_eviction`` / ``kv_eviction_budget`` in a
request's extra arguments): parsing and limits, the scheduler's per-request
schedules and admission, the worker's, and end to end through the OpenAI API
against the suite's shared ``vllm serve --kv-eviction snapkv`` (budget 512,
default model): with slots storage, requests at budgets 64 and 256 and an opted-out one in one
batch, each compared with the reference decoder at its own settings, and every
refusal a 400; with head_pages storage (the shared head_pages server), a request at budget
96 and an opted-out one."""

from __future__ import annotations

import random
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
from helpers import HEAD_PAGES_SERVER_CONFIG, SNAPKV_SERVER_CONFIG, kvevict_samples

from vllm_kvevict.config import KVEvictionConfigError, build_config
from vllm_kvevict.request_settings import RequestEviction, request_schedule
from vllm_kvevict.evaluation.server import scrape
from vllm_kvevict.schedule import NEVER_EVICTS, EvictionSchedule, cdiv

SERVER = {"policy": "snapkv", "budget": 256}
BS = 32


def frontier_brute_force(n: int, prompt_len: int, budget: int, schedule: EvictionSchedule) -> int:
    """The frontier after ``n`` processed tokens, from the eviction points listed
    one by one (not the schedule's closed forms)."""
    points = []
    if not schedule.holds_whole_prompt(prompt_len):
        points += [p for p in range(1, prompt_len) if p % schedule.prefill_interval == 0]
    points.append(prompt_len)
    points += [p for p in range(prompt_len + 1, n + 1) if (p - prompt_len) % schedule.decode_interval == 0]
    reached = [p for p in points if p <= n]
    if not reached:
        return 0
    return max(0, (max(reached) - budget) // schedule.block_size) * schedule.block_size


# --- parsing and limits ------------------------------------------------------


@pytest.mark.parametrize(
    "extra_args, expected",
    [
        (None, RequestEviction()),
        ({}, RequestEviction()),
        ({"other": 1}, RequestEviction()),
        ({"kv_eviction": "off"}, RequestEviction(off=True)),
        ({"kv_eviction": {"budget": 64}}, RequestEviction(budget=64)),
        ({"kv_eviction": {}}, RequestEviction()),
        ({"kv_eviction_budget": 96}, RequestEviction(budget=96)),
    ],
)
def test_request_settings_are_read_in_both_spellings(extra_args, expected):
    assert RequestEviction.from_extra_args(extra_args) == expected


@pytest.mark.parametrize(
    "extra_args, message",
    [
        ({"kv_eviction": "on"}, 'kv_eviction must be "off" or a mapping such as {"budget": 256}, got \'on\''),
        ({"kv_eviction": 64}, "got 64; through vllm_xargs pass {\"kv_eviction_budget\": 256}"),
        ({"kv_eviction": {"budget": 64, "policy": "h2o"}}, "unknown kv_eviction setting 'policy'"),
        ({"kv_eviction": {"budget": "64"}}, "kv_eviction.budget must be a whole number of tokens, got '64'"),
        ({"kv_eviction_budget": 64.0}, "kv_eviction_budget must be a whole number of tokens, got 64.0"),
        ({"kv_eviction_budget": True}, "kv_eviction_budget must be a whole number of tokens, got True"),
        ({"kv_eviction": "off", "kv_eviction_budget": 64}, "give either 'kv_eviction' or 'kv_eviction_budget', not both"),
        # A misspelt key is refused, not served at the server's budget.
        ({"kv_eviction_budgett": 128}, "unknown per-request setting 'kv_eviction_budgett'; the settings are {\"kv_eviction_budget\": 256} and {\"kv_eviction\": \"off\"}"),
        ({"kv_eviction_off": 1, "kv_eviction_budget": 64}, "unknown per-request setting 'kv_eviction_off'"),
    ],
)
def test_malformed_request_settings_are_refused_with_the_fix(extra_args, message):
    with pytest.raises(KVEvictionConfigError) as error:
        RequestEviction.from_extra_args(extra_args)
    assert message in str(error.value)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(
    "settings, server, message",
    [
        (RequestEviction(budget=257), SERVER, "budget 257 is above this server's budget 256 (what its memory was provisioned for); ask for at most 256"),
        (RequestEviction(budget=35), SERVER, "budget 35 cannot hold the server's sink_tokens + recent_window (36); ask for a budget of at least 36"),
        (RequestEviction(budget=0), SERVER, "ask for a budget of at least 36"),
        (RequestEviction(budget=-5), SERVER, "ask for a budget of at least 36"),
        (RequestEviction(off=True), None, "need a server started with --kv-eviction"),
        (RequestEviction(budget=64), None, "need a server started with --kv-eviction"),
        (RequestEviction(budget=63), {**SERVER, "storage": "head_pages"}, "budget 63 rounds down to 32 with storage head_pages (whole blocks of 32 tokens per head), which cannot hold sink_tokens + recent_window (36); ask for a budget of at least 64"),
        (RequestEviction(off=True), {"policy": "learned", "budget": 256}, "this server ranks every layer together (head_budget 'global')"),
        (RequestEviction(budget=64), {**SERVER, "policy": "pyramidkv"}, "(head_budget 'pyramid')"),
    ],
)
def test_request_settings_beyond_the_server_are_refused(settings, server, message):
    config = build_config(server) if server is not None else None
    with pytest.raises(KVEvictionConfigError) as error:
        settings.check(config, BS)
    assert message in str(error.value)


@pytest.mark.parametrize("settings", [RequestEviction(), RequestEviction(budget=36), RequestEviction(budget=256), RequestEviction(off=True)])
def test_request_settings_within_the_server_pass(settings):
    settings.check(build_config(SERVER), BS)
    RequestEviction().check(None)  # no settings: any server
    if settings.budget != 36:
        settings.check(build_config({**SERVER, "head_budget": "adaptive"}), BS)


def test_request_schedule_is_the_servers_with_the_requests_budget():
    server = build_config(SERVER).schedule(BS, 512)
    assert request_schedule(server, None) is server
    assert request_schedule(server, {"kv_eviction": {"budget": 64}}) == EvictionSchedule(
        64, server.decode_interval, BS, server.prefill_mode, server.end_of_prompt_max_tokens, 512
    )
    assert request_schedule(server, {"kv_eviction_budget": 96}).budget == 96
    assert request_schedule(server, {"kv_eviction": "off"}) is NEVER_EVICTS
    # What the front end refuses never reaches the engine; if it did, both sides
    # would fall back to the same schedule rather than disagree or stop.
    assert request_schedule(server, {"kv_eviction": "sometimes"}) is server
    assert request_schedule(server, {"kv_eviction_budget": 10_000}) is server


def test_front_end_refuses_an_opted_out_request_the_pool_cannot_hold():
    from vllm_kvevict.plugin.frontend.request_guard import check_request_eviction

    vllm_config = SimpleNamespace(
        additional_config={"kv_eviction": SERVER},
        cache_config=SimpleNamespace(num_gpu_blocks=40, block_size=BS),
        model_config=SimpleNamespace(max_model_len=4096),
    )

    def request(extra_args, prompt_len, max_tokens):
        params = SimpleNamespace(extra_args=extra_args, max_tokens=max_tokens)
        return SimpleNamespace(sampling_params=params, prompt_token_ids=[1] * prompt_len)

    check_request_eviction(vllm_config, request({"kv_eviction": "off"}, 1000, 280))  # 1280 tokens
    with pytest.raises(KVEvictionConfigError, match=r"prompt \+ max_tokens = 1281 tokens\) does not fit in the KV cache \(1280 tokens\)"):
        check_request_eviction(vllm_config, request({"kv_eviction": "off"}, 1000, 281))
    with pytest.raises(KVEvictionConfigError, match="= 4096 tokens"):  # max_tokens unset: up to max_model_len
        check_request_eviction(vllm_config, request({"kv_eviction": "off"}, 1000, None))
    check_request_eviction(vllm_config, request({"kv_eviction_budget": 64}, 3000, None))
    check_request_eviction(vllm_config, request(None, 3000, None))


# --- scheduler side ----------------------------------------------------------


def _manager(budget: int, prefill_mode: str = "per_chunk", num_blocks: int = 400):
    import torch
    from vllm.v1.core.block_pool import BlockPool

    from vllm_kvevict.plugin.kv_spec import EvictingAttentionSpec
    from vllm_kvevict.plugin.scheduler.manager import EvictionManager

    spec = EvictingAttentionSpec(
        block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32,
        schedule=EvictionSchedule(budget, 8, 16, prefill_mode, 0, 64),  # type: ignore[arg-type]
        max_step_tokens=64,
    )
    pool = BlockPool(num_gpu_blocks=num_blocks, enable_caching=False, hash_block_size=16)
    return EvictionManager(
        spec, block_pool=pool, enable_caching=False, kv_cache_group_id=0, scheduler_block_size=16
    )


@pytest.mark.parametrize("seed", range(3))
def test_manager_frees_and_admits_each_request_on_its_own_schedule(seed):
    """Three requests interleaved on one manager (server budget 160): one at its
    own budget, one at the server's, one opted out; every block each holds
    checked against the frontier of its own budget, brute force."""
    pytest.importorskip("vllm")
    rng = random.Random(seed)
    manager = _manager(160)
    server = manager.schedule
    own = rng.choice([36, 48, 64, 100])
    requests = {
        "own": ({"kv_eviction": {"budget": own}}, own),
        "server": (None, 160),
        "off": ({"kv_eviction": "off"}, None),
    }
    lengths = {r: (rng.randint(150, 500), rng.randint(10, 40)) for r in requests}
    done = {r: 0 for r in requests}
    peaks = {r: 0 for r in requests}
    while any(done[r] < sum(lengths[r]) for r in requests):
        for req, (extra_args, budget) in requests.items():
            prompt_len, decode = lengths[req]
            n = done[req]
            if n >= prompt_len + decode:
                continue
            step = min(rng.randint(1, 64), prompt_len - n) if n < prompt_len else 1
            manager.track_request(req, extra_args)  # what allocate_slots does first
            schedule = request_schedule(server, extra_args)
            bound = schedule.max_blocks_per_request(64)
            if n == 0:
                # Admission of the whole sequence is capped at the request's own bound.
                whole = cdiv(prompt_len + decode, 16)
                admitted = manager.get_num_blocks_to_allocate(
                    req, prompt_len + decode, (), 0, 0, prompt_len + decode, apply_admission_cap=True
                )
                assert admitted == (whole if bound is None else min(whole, bound))
            manager.remove_skipped_blocks(req, n, prompt_len)
            manager.allocate_new_blocks(req, n + step, n + step)
            frontier = 0 if budget is None else frontier_brute_force(n, prompt_len, budget, schedule)
            blocks = manager.req_to_blocks[req]
            assert all(b.is_null for b in blocks[: frontier // 16])
            assert not any(b.is_null for b in blocks[frontier // 16 :])
            held = cdiv(n + step, 16) - frontier // 16
            peaks[req] = max(peaks[req], held)
            if bound is not None:
                assert held <= bound
            done[req] = n + step
    # The server's admission cap is unchanged by the per-request ones.
    assert manager.max_admission_blocks_per_request == server.max_blocks_per_request(64)
    for req in requests:
        manager.free(req)
    assert manager.request_schedules == {}
    traces = {t["request_id"]: t for t in manager.stats.as_dict()["recent_requests"]}
    for req, (_, budget) in requests.items():
        assert traces[req]["budget"] == budget
        assert traces[req]["peak_blocks"] == peaks[req]
    assert traces["off"]["free_points"] == [] and traces["off"]["retained"] == traces["off"]["tokens"]
    assert traces["own"]["free_points"]
    assert manager.block_pool.get_num_free_blocks() == manager.block_pool.num_gpu_blocks - 1


def test_a_preempted_request_keeps_its_schedule_on_resumption():
    pytest.importorskip("vllm")
    manager = _manager(160)
    manager.track_request("r", {"kv_eviction_budget": 48})
    manager.remove_skipped_blocks("r", 0, 300)
    manager.allocate_new_blocks("r", 64, 64)
    manager.free("r")  # preempted: vLLM frees its blocks
    assert "r" not in manager.request_schedules
    manager.track_request("r", {"kv_eviction_budget": 48})  # resumed: allocated again
    assert manager.schedule_of("r").budget == 48


# --- worker side -------------------------------------------------------------


def test_worker_keeps_each_requests_schedule_until_it_is_released():
    import torch

    from vllm_kvevict.plugin.worker.worker_state import WorkerEvictionState

    state = WorkerEvictionState(2, 2, 2, 32, 160 + BS, 0, torch.float32, torch.device("cpu"), rows=2)
    server = build_config(SERVER).schedule(BS, 512)
    assert state.request_schedule("a", server, {"kv_eviction_budget": 64}).budget == 64
    assert state.request_schedule("b", server, {"kv_eviction": "off"}) is NEVER_EVICTS
    assert state.request_schedule("c", server, None) is server
    state.release({"a", "b", "c"})
    assert state.schedules == {}


# --- end to end: the shared SnapKV server (budget 512), budgets 64 and 256 and "off" in one batch

E2E_SERVER = SNAPKV_SERVER_CONFIG
E2E_POOL_BLOCKS = 160  # 5120 tokens: the three requests' whole sequences together
E2E_MAX_TOKENS = 72


@pytest.fixture(scope="module")
def per_request_server(snapkv_server):
    """The suite's shared `vllm serve --kv-eviction snapkv` (budget 512)."""
    return snapkv_server


def _client(server):
    from openai import OpenAI

    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=600)


def _complete(server, prompt_ids: list[int], xargs: dict | None) -> list[int]:
    body = {"ignore_eos": True, "return_token_ids": True}
    if xargs is not None:
        body["vllm_xargs"] = xargs
    reply = _client(server).completions.create(
        model="smollm2", prompt=prompt_ids, max_tokens=E2E_MAX_TOKENS, temperature=0, extra_body=body,
    )
    return list(reply.choices[0].token_ids)


def _prompts_of_distinct_lengths(tokenizer, rng: random.Random, names: list[str]) -> dict[str, list[int]]:
    """Random needle prompts of 900 to 1400 tokens, no two of the same length:
    the manager's traces are told apart by prompt length."""
    from helpers import needle_prompt

    prompts: dict[str, list[int]] = {}
    while len(prompts) < len(names):
        ids = tokenizer(needle_prompt(
            tokenizer, rng.randint(10_000, 99_999), target_tokens=rng.randint(900, 1400)
        )).input_ids
        if all(len(ids) != len(other) for other in prompts.values()):
            prompts[names[len(prompts)]] = ids
    return prompts


def _expected_trace(prompt_len: int, budget: int | None, schedule: EvictionSchedule) -> dict:
    """What the manager must record for a request prefilled in any chunks and
    decoded one token a step: every block it holds, brute force from the
    eviction points (end_of_prompt: nothing is freed before the prompt's end)."""
    last = prompt_len + E2E_MAX_TOKENS - 2  # processed tokens when the last token's slot is allocated

    def frontier(n: int) -> int:
        return 0 if budget is None else frontier_brute_force(n, prompt_len, budget, schedule)

    held = [cdiv(prompt_len, BS)]  # the whole prompt, allocated before its eviction
    held += [cdiv(n + 1, BS) - frontier(n) // BS for n in range(prompt_len, last + 1)]
    free_points = [
        n for n in range(prompt_len, last + 1) if frontier(n) // BS > frontier(n - 1) // BS
    ]
    return {
        "budget": budget, "prompt_len": prompt_len, "tokens": last, "retained": last - frontier(last),
        "peak_blocks": max(held), "blocks": held[-1], "free_points": free_points,
    }


@pytest.mark.e2e
def test_requests_with_their_own_budgets_and_an_opted_out_one_share_a_batch(
    per_request_server, model_dir, tokenizer
):
    """Budgets 64 and 256 (below the server's 512) and "off", sent
    at once: each request's blocks follow its own schedule, and its greedy
    output equals the reference decoder at its own settings (no eviction for
    "off")."""
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    rng = random.Random()
    cases = {
        "small": ({"kv_eviction_budget": 64}, 64),
        "server": ({"kv_eviction_budget": 256}, 256),
        "off": ({"kv_eviction": "off"}, None),
    }
    prompts = _prompts_of_distinct_lengths(tokenizer, rng, list(cases))
    before = kvevict_samples(scrape(per_request_server.url))
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(_complete, per_request_server, prompts[name], xargs) for name, (xargs, _) in cases.items()}
        served = {name: future.result() for name, future in futures.items()}
    stats, _ = per_request_server.wait_idle()
    time.sleep(0.5)  # past the metrics' export throttle
    after = kvevict_samples(scrape(per_request_server.url))
    by_setting = {
        dict(labels)["setting"]: value - before.get((name, labels), 0)
        for (name, labels), value in after.items() if name == "kvevict_requests_by_setting_total"
    }
    assert by_setting == {"server": 0, "own_budget": 2, "off": 1}, by_setting
    assert stats["max_admission_blocks_per_request"] is None  # end_of_prompt: whole prompts
    traces = {t["prompt_len"]: t for t in stats["recent_requests"]}
    schedule = build_config(E2E_SERVER).schedule(BS, 512)
    for name, (_, budget) in cases.items():
        expected = _expected_trace(len(prompts[name]), budget, schedule)
        trace = traces[len(prompts[name])]
        assert {k: trace[k] for k in expected} == expected, name
    assert traces[len(prompts["small"])]["retained"] < traces[len(prompts["server"])]["retained"]

    for name, (_, budget) in cases.items():
        config = None if budget is None else build_config({**E2E_SERVER, "budget": budget})
        reference = ReferenceEvictingDecoder(model_dir, config, block_size=BS, chunk_size=512).generate(
            prompts[name], E2E_MAX_TOKENS
        )
        assert served[name] == reference, name


@pytest.mark.e2e
@pytest.mark.parametrize(
    "xargs, message",
    [
        ({"kv_eviction_budget": 1024}, "kv_eviction budget 1024 is above this server's budget 512"),
        ({"kv_eviction_budget": 8}, "ask for a budget of at least 36"),
        ({"kv_eviction_budget": "64"}, "kv_eviction_budget must be a whole number of tokens, got '64'"),
        ({"kv_eviction": "sometimes"}, 'kv_eviction must be "off" or a mapping'),
        ({"kv_eviction": "off", "kv_eviction_budget": 64}, "not both"),
        ({"kv_eviction_budgett": 128}, "unknown per-request setting 'kv_eviction_budgett'"),
    ],
)
def test_invalid_settings_are_a_400_and_the_server_serves_on(per_request_server, tokenizer, xargs, message):
    import openai

    prompt = tokenizer("The capital of France is").input_ids
    with pytest.raises(openai.BadRequestError) as error:
        _client(per_request_server).completions.create(
            model="smollm2", prompt=prompt, max_tokens=4, extra_body={"vllm_xargs": xargs}
        )
    assert error.value.status_code == 400
    assert message in str(error.value)
    assert len(_complete(per_request_server, prompt, {"kv_eviction_budget": 64})) == E2E_MAX_TOKENS



HEAD_PAGES_SERVER = HEAD_PAGES_SERVER_CONFIG


@pytest.fixture(scope="module")
def head_pages_per_request_server(head_pages_server):
    """The suite's shared head_pages server (AdaKV + SnapKV, the MomentKV correction, budget 512)."""
    return head_pages_server


@pytest.mark.e2e
def test_head_pages_serve_a_budget_and_an_opted_out_request_in_one_batch(
    head_pages_per_request_server, model_dir, tokenizer
):
    """With per-head page tables (AdaKV + the MomentKV correction) a request at
    budget 96 and an opted-out one, sent at once, each equal the reference
    decoder at its own settings; the opted-out one frees nothing."""
    from vllm_kvevict.reference import ReferenceEvictingDecoder

    server = head_pages_per_request_server
    rng = random.Random()
    cases = {"small": ({"kv_eviction_budget": 96}, 96), "off": ({"kv_eviction": "off"}, None)}
    prompts = _prompts_of_distinct_lengths(tokenizer, rng, list(cases))
    with ThreadPoolExecutor(len(cases)) as pool:
        futures = {name: pool.submit(_complete, server, prompts[name], xargs) for name, (xargs, _) in cases.items()}
        served = {name: future.result() for name, future in futures.items()}
    stats, _ = server.wait_idle()
    traces = {t["prompt_len"]: t for t in stats["recent_requests"]}
    off = traces[len(prompts["off"])]
    assert off["budget"] is None and off["free_points"] == []
    assert off["peak_blocks"] == cdiv(len(prompts["off"]) + E2E_MAX_TOKENS - 1, BS)
    small = traces[len(prompts["small"])]
    assert small["budget"] == 96 and small["free_points"][0] == len(prompts["small"])
    for name, (_, budget) in cases.items():
        config = None if budget is None else build_config({**HEAD_PAGES_SERVER, "budget": budget})
        reference = ReferenceEvictingDecoder(model_dir, config, block_size=BS, chunk_size=512).generate(
            prompts[name], E2E_MAX_TOKENS
        )
        assert served[name] == reference, name
