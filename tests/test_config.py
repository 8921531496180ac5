"""EvictionConfig and the ways it is read: inline JSON, .json/.yaml files,
``--kv-eviction`` overrides, ``additional_config``; every mistake is one line
that names the fix."""

import json
from pathlib import Path

import pytest

from vllm_kvevict.config import (
    ADDITIONAL_CONFIG_KEY,
    EvictionConfig,
    KVEvictionConfigError,
    build_config,
    config_from_additional,
    config_from_cli,
    help_text,
    parse_config_source,
)
from vllm_kvevict.policies import POLICIES

FIELDS = [
    "policy",
    "budget",
    "sink_tokens",
    "recent_window",
    "observation_window",
    "decode_interval",
    "prefill_mode",
    "prefill_interval",
    "end_of_prompt_max_tokens",
    "policy_options",
    "poison_freed_blocks",
    "attention_kernel",
    "head_budget",
    "head_budget_floor",
    "pyramid_beta",
    "moment_correction",
    "moment_covariance",
    "storage",
    "prefix_caching",
    "max_protected_prefix_tokens",
]
POLICY_NAMES = [
    "criticalkv", "defensivekv", "expected_attention", "h2o", "keydiff", "knorm",
    "layer_defensivekv", "momentkv", "pyramidkv", "random", "snapkv", "streamingllm", "tova",
]

SETTINGS = {
    "policy": "snapkv",
    "budget": 300,
    "sink_tokens": 2,
    "recent_window": 16,
    "observation_window": 8,
    "decode_interval": 5,
    "prefill_mode": "hybrid",
    "prefill_interval": 256,
    "end_of_prompt_max_tokens": 2048,
    "policy_options": {"kernel_size": 5, "pooling": "avg"},
    "poison_freed_blocks": True,
    "attention_kernel": "torch",
    "head_budget": "adaptive",
    "head_budget_floor": 0.3,
    "pyramid_beta": 10.0,
    "moment_correction": True,
    "moment_covariance": "diagonal",
    "storage": "head_pages",
    "prefix_caching": "shared",
    "max_protected_prefix_tokens": 512,
}
YAML_TEXT = """\
policy: snapkv
budget: 300
sink_tokens: 2
recent_window: 16
observation_window: 8
decode_interval: 5
prefill_mode: hybrid
prefill_interval: 256
end_of_prompt_max_tokens: 2048
policy_options:
  kernel_size: 5
  pooling: avg
poison_freed_blocks: true
attention_kernel: torch
head_budget: adaptive
head_budget_floor: 0.3
pyramid_beta: 10.0
moment_correction: true
moment_covariance: diagonal
storage: head_pages
prefix_caching: shared
max_protected_prefix_tokens: 512
"""


def _one_line_error(fn, *args):
    with pytest.raises(KVEvictionConfigError) as info:
        fn(*args)
    message = str(info.value)
    assert message and "\n" not in message, repr(message)
    return message


def test_inline_json_and_files_agree(tmp_path):
    """Inline JSON, a .json file and a .yaml/.yml file give the same config, with the
    values written (not defaults)."""
    json_path = tmp_path / "evict.json"
    json_path.write_text(json.dumps(SETTINGS, indent=2))
    yaml_path = tmp_path / "evict.yaml"
    yaml_path.write_text(YAML_TEXT)
    yml_path = tmp_path / "evict.yml"
    yml_path.write_text(YAML_TEXT)
    configs = [
        config_from_cli(None, json.dumps(SETTINGS)),
        config_from_cli(None, "  " + json.dumps(SETTINGS) + "\n"),
        config_from_cli(None, str(json_path)),
        config_from_cli(None, str(yaml_path)),
        config_from_cli(None, str(yml_path)),
    ]
    for config in configs:
        assert config == configs[0]
        assert config.model_dump() == SETTINGS
    assert parse_config_source(str(yaml_path)) == SETTINGS


def test_defaults_and_no_flags():
    """Without flags eviction is off; with only a policy the documented defaults apply."""
    assert config_from_cli(None, None) is None
    config = config_from_cli("streamingllm", None)
    assert config.model_dump() == {
        "policy": "streamingllm",
        "budget": 512,
        "sink_tokens": 4,
        "recent_window": 32,
        "observation_window": 32,
        "decode_interval": 32,
        "prefill_mode": "per_chunk",
        "prefill_interval": None,
        "end_of_prompt_max_tokens": 4096,
        "policy_options": {},
        "poison_freed_blocks": False,
        "attention_kernel": "auto",
        "head_budget": "uniform",
        "head_budget_floor": 0.2,
        "pyramid_beta": 1.5,
        "moment_correction": False,
        "moment_covariance": "full",
        "storage": None,
        "prefix_caching": "off",
        "max_protected_prefix_tokens": 1024,
    }


def test_flag_and_config_naming_different_policies_are_refused():
    """A config written for another policy is not run under the flag's policy
    with its settings; the same policy, or none in the config, is accepted."""
    with pytest.raises(KVEvictionConfigError) as error:
        config_from_cli("snapkv", '{"policy": "h2o", "budget": 256}')
    message = str(error.value)
    assert message == (
        "--kv-eviction snapkv and --kv-eviction-config's policy 'h2o' differ; give one policy: "
        "--kv-eviction h2o, or a config for snapkv (or one without 'policy')"
    )
    with pytest.raises(KVEvictionConfigError, match="policy 'momentkv' differ"):
        config_from_cli("snapkv", str(Path(__file__).resolve().parent.parent / "configs" / "momentkv.yaml"))
    assert config_from_cli("h2o", '{"policy": "h2o", "budget": 256}').policy == "h2o"
    assert config_from_cli("h2o", '{"budget": 256}').budget == 256


def test_summary_names_the_settings_a_server_runs():
    """The start-up line: every setting that decides what is kept and where,
    the defaults resolved (SnapKV evicts at the prompt's end, adaptive head
    budgets store head pages, learned ranks every layer)."""
    snapkv = config_from_cli("snapkv", None)
    assert snapkv.summary("vllm") == (
        "policy snapkv, budget 512 tokens per KV head (sink 4, recent 32), prefill end_of_prompt, "
        "decode every 32 steps, storage slots, head budget uniform, attention kernel vllm, "
        "prefix caching off"
    )
    moments = config_from_cli("momentkv", '{"budget": 256, "head_budget": "adaptive"}')
    assert moments.summary("cpp") == (
        "policy momentkv, budget 256 tokens per KV head (sink 4, recent 32), prefill end_of_prompt, "
        "decode every 32 steps, storage head_pages, head budget adaptive, moment correction full, "
        "attention kernel cpp, prefix caching off"
    )
    chunked = config_from_cli(
        "streamingllm", '{"prefill_interval": 1024, "prefix_caching": "shared", "max_protected_prefix_tokens": 256}'
    )
    assert "prefill per_chunk every 1024 tokens," in chunked.summary("vllm")
    assert chunked.summary("vllm").endswith("prefix caching shared, up to 256 tokens protected")
    assert ", storage global, head budget global," in config_from_cli("learned", None).summary("torch")


def test_prefill_mode_defaults_per_policy():
    """prefill_mode defaults to the policy's choice; an explicit value wins."""
    assert config_from_cli("snapkv", None).prefill_mode == "end_of_prompt"
    assert config_from_cli("streamingllm", None).prefill_mode == "per_chunk"
    assert config_from_cli("snapkv", '{"prefill_mode": null}').prefill_mode == "end_of_prompt"
    assert config_from_cli("snapkv", '{"prefill_mode": "per_chunk"}').prefill_mode == "per_chunk"
    assert (
        config_from_cli("streamingllm", '{"prefill_mode": "end_of_prompt"}').prefill_mode
        == "end_of_prompt"
    )
    # the default follows the policy, named by the flag or by the file
    assert config_from_cli("streamingllm", '{"budget": 256}').prefill_mode == "per_chunk"
    assert config_from_cli(None, '{"policy": "streamingllm"}').prefill_mode == "per_chunk"
    message = _one_line_error(config_from_cli, "snapkv", '{"prefill_mode": "lazy"}')
    assert "prefill_mode" in message and "per_chunk" in message and "end_of_prompt" in message
    # the resolved mode survives the trip through additional_config
    config = config_from_cli("snapkv", None)
    again = config_from_additional({ADDITIONAL_CONFIG_KEY: config.to_additional_config()})
    assert again == config and again.prefill_mode == "end_of_prompt"


def test_schedule_from_config():
    config = config_from_cli("snapkv", '{"budget": 100, "decode_interval": 9}')
    schedule = config.schedule(32, 512)
    assert (schedule.budget, schedule.decode_interval, schedule.block_size, schedule.prefill_mode,
            schedule.prefill_interval) == (100, 9, 32, "end_of_prompt", 512)
    config = config_from_cli("snapkv", '{"prefill_interval": 96}')
    assert config.schedule(32, 512).prefill_interval == 96


def test_each_setting_is_validated_once_per_process():
    """The same settings give back the same config object, whichever way they
    come in, and its policy object is built once; additional_config stays plain."""
    from_cli = config_from_cli("snapkv", '{"budget": 320, "decode_interval": 11}')
    additional = {ADDITIONAL_CONFIG_KEY: from_cli.to_additional_config()}
    assert config_from_additional(additional) is from_cli
    assert config_from_additional(json.loads(json.dumps(additional))) is from_cli
    assert build_config({"policy": "snapkv", "budget": 320, "decode_interval": 11}) is from_cli
    assert from_cli.build_policy() is from_cli.build_policy()
    assert json.loads(json.dumps(additional)) == additional
    other = config_from_additional({ADDITIONAL_CONFIG_KEY: {"policy": "snapkv", "budget": 321}})
    assert other is not from_cli and other.budget == 321


def test_non_string_policy_is_a_config_error():
    _one_line_error(build_config, {"policy": ["snapkv"]})


def test_flag_policy_with_a_file_of_settings(tmp_path):
    """--kv-eviction names the policy, the file (without one, or naming the
    same) the other settings; a file naming another policy is refused
    (test_flag_and_config_naming_different_policies_are_refused)."""
    path = tmp_path / "evict.yaml"
    path.write_text("budget: 256\ndecode_interval: 7\n")
    config = config_from_cli("streamingllm", str(path))
    assert config.policy == "streamingllm"
    assert config.budget == 256 and config.decode_interval == 7
    path.write_text("policy: streamingllm\nbudget: 99\n")
    assert config_from_cli("streamingllm", str(path)).budget == 99


def test_additional_config_round_trip(tmp_path):
    """config_from_additional accepts the dict form, a config object and a source string."""
    assert config_from_additional(None) is None
    assert config_from_additional({}) is None
    assert config_from_additional({"other": 1}) is None
    config = build_config(SETTINGS)
    dumped = config.to_additional_config()
    assert json.loads(json.dumps(dumped)) == SETTINGS  # plain, picklable data
    assert config_from_additional({ADDITIONAL_CONFIG_KEY: dumped}) == config
    assert config_from_additional({ADDITIONAL_CONFIG_KEY: config}) is config
    assert config_from_additional({ADDITIONAL_CONFIG_KEY: json.dumps(SETTINGS)}) == config
    path = tmp_path / "c.yaml"
    path.write_text(YAML_TEXT)
    assert config_from_additional({ADDITIONAL_CONFIG_KEY: str(path)}) == config


def test_config_is_frozen():
    config = build_config(SETTINGS)
    with pytest.raises(Exception):
        config.budget = 1


def test_unknown_policy_lists_choices():
    for call in [
        lambda: config_from_cli("bogus", None),
        lambda: config_from_cli(None, '{"policy": "bogus"}'),
        lambda: config_from_additional({ADDITIONAL_CONFIG_KEY: {"policy": "bogus"}}),
    ]:
        message = _one_line_error(call)
        assert "bogus" in message
        for name in POLICY_NAMES:
            assert name in message


def test_malformed_inline_json():
    message = _one_line_error(config_from_cli, "snapkv", '{"budget": 12,')
    assert "JSON" in message and "pass a JSON object" in message


def test_malformed_json_file(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{"budget": }')
    message = _one_line_error(config_from_cli, "snapkv", str(path))
    assert str(path) in message and "fix the file's syntax" in message


def test_malformed_yaml_file(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("policy: snapkv\nbudget: [1, 2\n  sink_tokens: : 3\n")
    message = _one_line_error(config_from_cli, None, str(path))
    assert str(path) in message and "fix the file's syntax" in message


def test_nonexistent_path(tmp_path):
    missing = tmp_path / "nope.yaml"
    message = _one_line_error(config_from_cli, "snapkv", str(missing))
    assert str(missing) in message
    assert "existing file" in message and "JSON object" in message


def test_non_mapping_sources(tmp_path):
    """A list or scalar instead of a mapping is refused, inline, in files, in additional_config."""
    # Inline "[1]" is not recognised as inline JSON (only '{' is); it still gets
    # a one-line error that tells the user to pass a JSON object.
    message = _one_line_error(config_from_cli, "snapkv", "[1]")
    assert "JSON object" in message
    for name, text in [("list.json", "[1, 2]"), ("scalar.yaml", "42\n"), ("list.yaml", "- a\n- b\n")]:
        path = tmp_path / name
        path.write_text(text)
        message = _one_line_error(config_from_cli, "snapkv", str(path))
        assert "mapping" in message
    message = _one_line_error(config_from_additional, {ADDITIONAL_CONFIG_KEY: [1]})
    assert "mapping" in message


@pytest.mark.parametrize(
    "budget,sink,recent", [(10, 4, 32), (35, 3, 33), (1, 1, 1), (63, 0, 64)]
)
def test_budget_below_protected_tokens(budget, sink, recent):
    """budget < sink_tokens + recent_window is refused; the message has both numbers."""
    source = json.dumps({"budget": budget, "sink_tokens": sink, "recent_window": recent})
    message = _one_line_error(config_from_cli, "streamingllm", source)
    assert str(budget) in message and str(sink + recent) in message
    # the boundary itself is fine
    ok = json.dumps({"budget": sink + recent, "sink_tokens": sink, "recent_window": recent})
    assert config_from_cli("streamingllm", ok).budget == sink + recent


@pytest.mark.parametrize("budget", [0, -8])
def test_budget_at_or_below_zero_names_the_floor(budget):
    """budget 0 names the real floor, sink_tokens + recent_window, not a bound of 1."""
    message = _one_line_error(config_from_cli, "snapkv", json.dumps({"budget": budget}))
    assert message.endswith(
        f"budget {budget} cannot hold sink_tokens (4) + recent_window (32); raise budget to "
        "at least 36 or shrink the window"
    ), message
    message = _one_line_error(
        config_from_cli, "snapkv", json.dumps({"budget": 0, "sink_tokens": 0, "recent_window": 0})
    )
    assert "raise budget to at least 1" in message


def test_unknown_key_is_named():
    message = _one_line_error(config_from_cli, "snapkv", '{"budgett": 100}')
    assert "budgett" in message


def test_unknown_key_message_names_the_fix():
    message = _one_line_error(config_from_cli, "snapkv", '{"budgett": 100}')
    assert all(name in message for name in FIELDS), message


def test_unknown_policy_option():
    message = _one_line_error(
        config_from_cli, "snapkv", '{"policy_options": {"bogus": 1}}'
    )
    assert "bogus" in message and "kernel_size" in message and "pooling" in message
    message = _one_line_error(
        config_from_cli, "streamingllm", '{"policy_options": {"kernel_size": 7}}'
    )
    assert "kernel_size" in message and "none" in message


def test_invalid_policy_option_values():
    for options in ['{"kernel_size": 4}', '{"kernel_size": 0}', '{"pooling": "min"}']:
        message = _one_line_error(
            config_from_cli, "snapkv", '{"policy_options": %s}' % options
        )
        assert "snapkv" in message


def test_config_without_policy():
    message = _one_line_error(config_from_cli, None, '{"budget": 256}')
    assert "--kv-eviction" in message
    for name in POLICY_NAMES:
        assert name in message
    message = _one_line_error(
        config_from_additional, {ADDITIONAL_CONFIG_KEY: {"budget": 256}}
    )
    assert "policy" in message


@pytest.mark.parametrize(
    "settings",
    [
        {"budget": 0},
        {"sink_tokens": -1},
        {"observation_window": 0},
        {"decode_interval": 0},
        {"attention_kernel": "cuda"},
        {"budget": "many"},
    ],
)
def test_field_constraints(settings):
    message = _one_line_error(config_from_cli, "snapkv", json.dumps(settings))
    assert next(iter(settings)) in message


def test_help_text_mentions_every_field():
    text = help_text()
    assert set(EvictionConfig.model_fields) == set(FIELDS)
    for name in FIELDS:
        assert name in text
    assert "budget (512)" in text and "policy (required)" in text
    for name in POLICY_NAMES:
        assert name in text


CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
YAML_FILES = sorted(CONFIG_DIR.glob("*.yaml")) + sorted(CONFIG_DIR.glob("*.yml")) if CONFIG_DIR.is_dir() else []


@pytest.mark.skipif(not YAML_FILES, reason="no configs/*.yaml in this checkout")
@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.name)
def test_shipped_configs_load(path):
    """Every shipped example config is valid; a policy-named file holds that policy."""
    data = parse_config_source(str(path))
    if "policy" in data:
        config = build_config(data)
        if path.stem in POLICY_NAMES:
            assert config.policy == path.stem
        configs = [config]
    else:  # a policy-neutral file: valid with every policy given by the flag
        configs = [config_from_cli(name, str(path)) for name in POLICY_NAMES]
    for config in configs:
        assert config.budget >= config.sink_tokens + config.recent_window
        for key, value in data.items():
            if key != "policy":
                assert getattr(config, key) == value


def test_head_pages_storage_resolution():
    base = {"policy": "snapkv", "budget": 512}
    assert not build_config(base).uses_head_pages
    assert build_config({**base, "head_budget": "adaptive"}).uses_head_pages
    assert build_config({**base, "moment_correction": True}).uses_head_pages
    assert build_config({**base, "storage": "head_pages"}).uses_head_pages
    with pytest.raises(KVEvictionConfigError, match="need storage 'head_pages'; drop storage 'slots'"):
        build_config({**base, "storage": "slots", "head_budget": "adaptive"})
    with pytest.raises(KVEvictionConfigError, match="head_budget_floor"):
        build_config({**base, "head_budget_floor": 1.5})
    with pytest.raises(KVEvictionConfigError, match="set moment_correction: true"):
        build_config({**base, "moment_covariance": "diagonal"})
    assert build_config({"policy": "momentkv", "moment_covariance": "none"}).moment_correction
    # The pooled layers' ranking folds no evicted token: the correction is refused, not ignored.
    for policy in ("layer_defensivekv", "learned"):
        with pytest.raises(KVEvictionConfigError, match="drop moment_correction, or use head_budget 'adaptive'"):
            build_config({"policy": policy, "moment_correction": True})
    with pytest.raises(KVEvictionConfigError, match="head_budget 'pyramid' ranks every layer"):
        build_config({"policy": "pyramidkv", "moment_correction": True})


def test_head_pages_budget_must_hold_protected_tokens_in_whole_blocks():
    config = build_config({"policy": "snapkv", "budget": 40, "head_budget": "adaptive"})
    with pytest.raises(KVEvictionConfigError, match="raise budget to at least 64"):
        config.check_block_size(32)
    config.check_block_size(8)  # 40 is whole blocks of 8 and holds 4 + 32


README = Path(__file__).resolve().parent.parent / "README.md"
POLICY_CONFIGS = [p for p in YAML_FILES if p.stem in POLICIES]


@pytest.mark.skipif(not POLICY_CONFIGS, reason="no configs/POLICY.yaml in this checkout")
@pytest.mark.parametrize("path", POLICY_CONFIGS, ids=lambda p: p.name)
def test_a_policy_named_config_is_that_policys_defaults(path):
    """configs/NAME.yaml holds the measured best settings of policy NAME, and
    `--kv-eviction NAME` without a config gives the same: a config that sets
    another value than the policy's default is a disagreement to resolve (in
    the policy's defaults, or in a config named otherwise)."""
    assert _effective(build_config(parse_config_source(str(path)))) == _effective(
        build_config({"policy": path.stem})
    )


def _effective(config: EvictionConfig) -> tuple:
    """A config's settings with its policy options resolved (defaults filled
    in, CriticalKV's base built)."""
    import dataclasses

    settings = config.model_dump()
    settings.pop("policy_options")
    policy = config.build_policy()
    options = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy) if f.name != "base_options"}
    return settings, options, getattr(policy, "base_policy", None)


def _readme_setting_row(key: str) -> str:
    rows = [line for line in README.read_text().splitlines() if line.startswith(f"| `{key}` |")]
    assert len(rows) == 1, f"README.md has no single settings row for {key}"
    return rows[0]


# Labels of the README's policy_options row and the policies they describe.
README_OPTION_LABELS = {
    "SnapKV, PyramidKV and MomentKV": ["snapkv", "pyramidkv", "momentkv"],
    "MomentKV": ["momentkv"],
    "KeyDiff": ["keydiff"],
    "Expected Attention": ["expected_attention"],
    "CriticalKV": ["criticalkv"],
    "DefensiveKV": ["defensivekv", "layer_defensivekv"],
    "random": ["random"],
    "learned": ["learned"],
    "KVzip": ["kvzip"],
}


def _readme_option_defaults() -> dict[str, dict[str, str | None]]:
    """policy -> option -> the default the README's policy_options row writes
    (its first choice where it lists several; None where it gives none)."""
    import re

    cell = _readme_setting_row("policy_options").split(" | ")[2]
    cell = cell.split(". `kvevict policies`")[0]
    segments, depth, start = [], 0, 0
    for i, char in enumerate(cell):  # "; " between policies, not inside parentheses
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0 and cell.startswith("; ", i):
            segments.append(cell[start:i])
            start = i + 2
    segments.append(cell[start:])
    documented: dict[str, dict[str, str | None]] = {}
    for segment in segments:
        label, _, items = segment.partition(": ")
        assert label in README_OPTION_LABELS, f"README policy_options: unknown label {label!r}"
        for name, default in re.findall(r"`(\w+)`(?: \(([^,)]+))?", items):
            written = default.split("/")[0].strip()
            literal = re.fullmatch(r"`[^`]+`|-?[0-9.e-]+|true|false", written)
            for policy in README_OPTION_LABELS[label]:
                documented.setdefault(policy, {})[name] = written.strip("`") if literal else None
    return documented


def test_readme_policy_option_defaults_are_the_policies_defaults():
    """Every `option` (default) in the README's policy_options row is the
    policy's own default; every policy option is in the row."""
    from vllm_kvevict.policies import policy_options

    documented = _readme_option_defaults()
    for policy, options in documented.items():
        for name, written in options.items():
            if written is None:
                continue  # no default given, or a description
            value = policy_options(policy)[name]
            assert _readme_says(written, value), (
                f"README says {policy} {name} defaults to {written}, the policy to {value!r}"
            )
    for policy in {p for names in README_OPTION_LABELS.values() for p in names}:
        assert set(documented[policy]) >= set(policy_options(policy)), policy


def _readme_default(key: str, policy: str | None) -> str | None:
    """The README settings table's default of ``key`` for ``policy``, written
    as ``general; value for `a`, `b`; ...`` (None: no literal default)."""
    import re

    cell = _readme_setting_row(key).split(" | ")[1]
    general, *segments = cell.split("; ")
    for segment in segments:
        value, _, names = segment.partition(" for ")
        if policy in re.findall(r"`(\w+)`", names):
            general = value
    written = general.strip().strip("`")
    return written if re.fullmatch(r"[\w.{}-]+", written) and written != "—" else None


def _readme_says(written: str, value: object) -> bool:
    if str(value).lower() == written.lower() or (written == "{}" and value == {}):
        return True
    try:
        return float(written) == float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False


# Settings whose README default is not one literal: the policy (required),
# prefill_interval (vLLM's --max-num-batched-tokens), storage (from other settings).
README_NON_LITERAL = {"policy", "prefill_interval", "storage"}


def test_readme_setting_defaults_are_the_policies_defaults():
    """Every row of the README's settings table gives, per policy, the value
    that `--kv-eviction NAME` without a config gets."""
    fields = [f for f in EvictionConfig.model_fields if f not in README_NON_LITERAL]
    for name in POLICIES:
        config = build_config({"policy": name})
        for key in fields:
            written = _readme_default(key, name)
            assert written is not None, f"README.md has no literal default for {key}"
            assert _readme_says(written, getattr(config, key)), (
                f"README says {key} defaults to {written} for {name}; the config gives {getattr(config, key)!r}"
            )


@pytest.mark.skipif(not YAML_FILES, reason="no configs/*.yaml in this checkout")
@pytest.mark.parametrize("path", [p for p in YAML_FILES if p.stem in POLICIES or p.stem == "default"],
                         ids=lambda p: p.name)
def test_a_shipped_config_agrees_with_the_readme(path):
    """configs/NAME.yaml (and the policy-neutral default.yaml) sets every
    setting, and every policy option, to the default the README's settings
    table gives for that policy: a config and the table cannot disagree."""
    data = parse_config_source(str(path))
    policy = data.get("policy")
    for key, value in data.items():
        if key in ("policy", "policy_options"):
            continue
        written = _readme_default(key, policy)
        assert written is not None and _readme_says(written, value), (
            f"{path.name} sets {key}: {value!r}; README.md's settings table says {written}"
        )
    readme_options = _readme_option_defaults()
    documented = readme_options.get(policy, {})
    options = dict(data.get("policy_options") or {})
    base = options.pop("base", None)
    for name, value in options.items():
        if name == "base_options":
            for base_name, base_value in value.items():
                written = readme_options[base][base_name]
                assert written is None or _readme_says(written, base_value), (
                    f"{path.name} sets base_options.{base_name}: {base_value!r}; README.md says {written}"
                )
            continue
        assert name in documented, f"{path.name}: option {name} is not in README.md's policy_options row"
        written = documented[name]
        assert written is None or _readme_says(written, value), (
            f"{path.name} sets {name}: {value!r}; README.md's policy_options row says {written}"
        )
    if base is not None:
        assert _readme_says(documented["base"], base), path.name


def test_criticalkv_reads_its_bases_observation_window():
    """A CriticalKV config without observation_window reads as many queries as
    its base would on its own (Expected Attention's statistics: 128); a set
    window wins."""
    for base in ("snapkv", "expected_attention"):
        config = build_config({"policy": "criticalkv", "policy_options": {"base": base}})
        assert config.observation_window == build_config({"policy": base}).observation_window
    assert build_config({"policy": "criticalkv", "policy_options": {"base": "expected_attention"}}
                        ).observation_window == 128
    assert build_config({"policy": "criticalkv", "observation_window": 48,
                         "policy_options": {"base": "expected_attention"}}).observation_window == 48
    with pytest.raises(KVEvictionConfigError, match="base"):
        build_config({"policy": "criticalkv", "policy_options": {"base": "h2o"}})
