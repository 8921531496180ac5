"""Settings of `kvevict eval` and `kvevict bench`: parsing, budgets, and the
early refusals, against values worked out by hand and the plugin's own rules."""

from __future__ import annotations

import random

import pytest

from vllm_kvevict.config import KVEvictionConfigError, build_config
from vllm_kvevict.evaluation.reference_eval import check_settings
from vllm_kvevict.evaluation.settings import (
    FULL,
    ServingSetting,
    eviction_config,
    minimum_budget,
    parse_setting,
    parse_settings,
)
from vllm_kvevict.policies import POLICIES


def test_full_endpoints_fractions_and_fixed_budgets() -> None:
    assert parse_setting(" full ") == ServingSetting(FULL)
    endpoint = parse_setting("gpu=http://host:8000/")
    assert (endpoint.name, endpoint.url, endpoint.managed) == ("gpu", "http://host:8000", False)
    quarter = parse_setting("snapkv@0.25")
    assert (quarter.name, quarter.policy, quarter.fraction) == ("snapkv@0.25", "snapkv", 0.25)
    assert quarter.managed and quarter.budget(4000) == 992
    # The shipped config snapkv (configs/snapkv.yaml) is used for a name that has one.
    assert quarter.eviction["policy_options"]["kernel_size"] == 15
    assert "budget" not in quarter.eviction  # the budget comes from the prompts
    assert parse_setting("adakv_snapkv@0.2").eviction["head_budget"] == "adaptive"
    assert parse_setting("streamingllm@1").fraction == 1.0
    fixed = parse_setting("tova@1024")
    assert fixed.budget_tokens == 1024 and fixed.budget(5000) == 1024
    for name in POLICIES:
        assert parse_setting(f"{name}@0.5").policy == name


def test_budget_is_the_fraction_of_the_mean_prompt_in_whole_blocks() -> None:
    rng = random.Random()
    for _ in range(50):
        fraction = round(rng.uniform(0.05, 1.0), 6)
        mean_prompt = rng.uniform(500, 9000)
        block = rng.choice([8, 16, 32])
        budget = parse_setting(f"knorm@{fraction}").budget(mean_prompt, block)
        assert budget % block == 0 and 0 <= fraction * mean_prompt - budget < block
    assert parse_setting("momentkv@0.5").budget(4000) == 1984
    assert parse_setting("snapkv@0.25").budget(3843.5) == 960


@pytest.mark.parametrize("text, message", [
    ("nosuchpolicy@0.5", "unknown policy or config 'nosuchpolicy'.*snapkv"),
    ("snapkv@0", "kept fraction in \\(0, 1\\]"),
    ("snapkv@-0.2", "kept fraction in \\(0, 1\\]"),
    ("snapkv@1.5", "multiple of 32"),
    ("snapkv@100", "multiple of 32"),
    ("snapkv@half", "neither a kept fraction"),
    ("snapkv", "expected 'full'"),
    ("@0.5", "expected 'full'"),
    ("mine=localhost:8000", "NAME=http"),
    ("full+agnostic@0.5", "after an eviction config without \\+prefix"),
    ("snapkv+prefix+agnostic@0.5", "after an eviction config without \\+prefix"),
])
def test_bad_settings_fail_early_with_the_fix(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        parse_setting(text)


def test_options_the_plugin_refuses_fail_at_parse_time() -> None:
    with pytest.raises(ValueError, match="head_pages"):
        parse_setting("snapkv@0.5", {"head_budget": "adaptive", "storage": "slots"})


def test_a_budget_below_the_minimum_is_refused_with_the_smallest_that_works() -> None:
    # 1% of 4000 = 40 -> 32 tokens: cannot hold 4 sink tokens + a 32-token window.
    for policy in ("snapkv", "momentkv"):
        setting = parse_setting(f"{policy}@0.01")  # the budget depends on the prompts
        with pytest.raises(ValueError, match="budget 32 tokens is refused.*at least 64 tokens"):
            eviction_config(setting, 4000)
        assert minimum_budget(setting.eviction) == 64
    with pytest.raises(ValueError, match="at least 64"):
        parse_setting("snapkv@32")  # a fixed budget is checked at once
    # Smaller sinks and window make 32 tokens enough; the result is what vLLM gets.
    extra = {"sink_tokens": 0, "recent_window": 16}
    config = eviction_config(parse_setting("snapkv@0.01", extra), 4000)
    assert config["budget"] == 32 and build_config(config).recent_window == 16
    with pytest.raises(KVEvictionConfigError):
        build_config({"policy": "snapkv", "budget": 32})
    assert eviction_config(parse_setting("full"), 4000) is None


def test_query_agnostic_settings_are_named_apart_and_refused_where_they_cannot_run(capsys) -> None:
    import argparse

    agnostic = parse_setting("layer_defensivekv+agnostic@0.2")
    aware = parse_setting("layer_defensivekv@0.2")
    assert (agnostic.name, agnostic.query_agnostic, aware.query_agnostic) == (
        "layer_defensivekv+agnostic@0.2", True, False)
    assert agnostic.eviction == aware.eviction and agnostic.budget(4000) == aware.budget(4000)
    check_settings([agnostic, parse_setting("kvzip+agnostic@0.2"), parse_setting(FULL)])
    # Served engines read the whole prompt: refused, naming the engine that can.
    parser = argparse.ArgumentParser(prog="kvevict eval")
    with pytest.raises(SystemExit):
        parse_settings(parser, ["snapkv+agnostic@0.2"], None)
    assert "--engine reference" in capsys.readouterr().err
    assert parse_settings(parser, ["snapkv+agnostic@0.2"], None, served=False)[0].query_agnostic
    # Evictions inside the context or gates read while it runs: no context-only state to continue from.
    for spec, options in (("snapkv+agnostic@0.2", {"prefill_mode": "per_chunk"}), ("learned+agnostic@0.2", None)):
        with pytest.raises(ValueError, match="evicts once, at the context's end"):
            check_settings([parse_setting(spec, options)])
