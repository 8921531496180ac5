"""The CLI flags and start-up checks, in-process (no vLLM server)."""

from types import SimpleNamespace

import pytest
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_kvevict.config import EvictionConfig, KVEvictionConfigError, config_from_cli
from vllm_kvevict.plugin.frontend import cli
from vllm_kvevict.plugin import compat
from vllm_kvevict.plugin.compat import VLLMContractError


def _parser():
    parser = FlexibleArgumentParser(prog="vllm serve")
    cli.add_eviction_args(parser)
    cli.add_eviction_args(parser)  # idempotent: vLLM builds several parsers
    return parser


def test_flags_parse_and_are_idempotent():
    parser = _parser()
    flags = [a for a in parser._actions if "--kv-eviction" in a.option_strings]
    assert len(flags) == 1
    args = parser.parse_args(["--kv-eviction", "snapkv", "--kv-eviction-config", '{"budget": 256}'])
    assert args.kv_eviction == "snapkv"
    assert args.kv_eviction_config == '{"budget": 256}'
    config = config_from_cli(args.kv_eviction, args.kv_eviction_config)
    assert config.policy == "snapkv" and config.budget == 256
    # underscore spelling, as FlexibleArgumentParser allows for every flag
    args = parser.parse_args(["--kv_eviction", "streamingllm"])
    assert args.kv_eviction == "streamingllm" and args.kv_eviction_config is None
    defaults = parser.parse_args([])
    assert defaults.kv_eviction is None and defaults.kv_eviction_config is None


def test_help_lists_settings(monkeypatch, capsys):
    """`vllm serve --help=kv-eviction` shows both flags and every setting."""
    # parse_args stores the keyword on the class; let monkeypatch restore it.
    monkeypatch.setattr(FlexibleArgumentParser, "_search_keyword", None)
    with pytest.raises(SystemExit) as info:
        _parser().parse_args(["--help=kv-eviction"])
    assert info.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--kv-eviction-config" in text and "snapkv" in text
    for name in EvictionConfig.model_fields:
        assert name in text


def test_bogus_policy_exits_listing_choices(capsys):
    parser = _parser()
    with pytest.raises(SystemExit) as info:
        parser.parse_args(["--kv-eviction", "bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "bogus" in err and "snapkv" in err and "streamingllm" in err


def _clean_args(**changes):
    args = dict(
        enable_prefix_caching=None,
        speculative_config=None,
        kv_transfer_config=None,
        kv_cache_dtype="auto",
        pipeline_parallel_size=1,
        decode_context_parallel_size=1,
        prefill_context_parallel_size=1,
    )
    args.update(changes)
    return SimpleNamespace(**args)


def test_clean_engine_args_pass():
    cli._reject_incompatible_args(_clean_args())
    cli._reject_incompatible_args(_clean_args(enable_prefix_caching=False))
    # prefix_caching shared keeps vLLM's prefix caching on
    cli._reject_incompatible_args(_clean_args(enable_prefix_caching=True), "shared")
    cli._reject_incompatible_args(_clean_args(), "shared")
    with pytest.raises(KVEvictionConfigError, match="drop --no-enable-prefix-caching"):
        cli._reject_incompatible_args(_clean_args(enable_prefix_caching=False), "shared")
    # attributes vLLM may not have are treated as 1
    cli._reject_incompatible_args(
        SimpleNamespace(enable_prefix_caching=None, speculative_config=None, kv_transfer_config=None)
    )


@pytest.mark.parametrize(
    "changes,fix",
    [
        ({"enable_prefix_caching": True}, "--enable-prefix-caching"),
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "--speculative-config"),
        ({"kv_transfer_config": {"kv_connector": "X"}}, "--kv-transfer-config"),
        ({"kv_cache_dtype": "fp8"}, "drop --kv-cache-dtype"),
        ({"pipeline_parallel_size": 2}, "--pipeline-parallel-size 1"),
        ({"decode_context_parallel_size": 2}, "--decode-context-parallel-size 1"),
        ({"prefill_context_parallel_size": 4}, "--prefill-context-parallel-size 1"),
    ],
)
def test_incompatible_engine_args_rejected(changes, fix):
    with pytest.raises(KVEvictionConfigError) as info:
        cli._reject_incompatible_args(_clean_args(**changes))
    message = str(info.value)
    assert fix in message and "\n" not in message


def _vllm_config(use_mla=False, sliding_window=None, layer_types=None, is_hybrid=False,
                 is_encoder_decoder=False):
    model_config = SimpleNamespace(
        use_mla=use_mla,
        get_sliding_window=lambda: sliding_window,
        hf_text_config=SimpleNamespace(layer_types=layer_types),
        is_hybrid=is_hybrid,
        is_encoder_decoder=is_encoder_decoder,
    )
    return SimpleNamespace(model_config=model_config)


def test_plain_model_passes():
    from vllm.platforms import current_platform

    assert current_platform.is_cpu()
    cli._reject_incompatible_model(_vllm_config())
    cli._reject_incompatible_model(_vllm_config(layer_types=["full_attention"] * 4))
    # hf_text_config without layer_types at all
    config = _vllm_config()
    config.model_config.hf_text_config = SimpleNamespace()
    cli._reject_incompatible_model(config)


@pytest.mark.parametrize(
    "kwargs,words",
    [
        ({"use_mla": True}, "MLA"),
        ({"sliding_window": 4096}, "sliding-window"),
        ({"layer_types": ["full_attention", "sliding_attention"]}, "sliding-window"),
        ({"is_hybrid": True}, "decoder-only"),
        ({"is_encoder_decoder": True}, "decoder-only"),
    ],
)
def test_incompatible_models_rejected(kwargs, words):
    with pytest.raises(KVEvictionConfigError) as info:
        cli._reject_incompatible_model(_vllm_config(**kwargs))
    message = str(info.value)
    assert words in message and "without it" in message and "\n" not in message


def test_other_platforms_rejected_with_eviction():
    """ROCm, XPU, TPU...: one line naming the platforms eviction serves on (the
    platform rules themselves are in test_plugin_gate.py)."""
    for platform, shown in (("rocm", "ROCm"), ("xpu", "XPU"), ("tpu", "TPU")):
        with pytest.raises(KVEvictionConfigError) as info:
            cli.eviction_platform_rules(platform, SimpleNamespace(), SimpleNamespace(), {})
        message = str(info.value)
        assert f"found {shown}" in message and "CPU and CUDA" in message and "\n" not in message


def test_fail_exits_on_command_line(monkeypatch, capsys):
    """From the command line a mistake is one line on stderr and exit code 2."""
    with pytest.raises(SystemExit) as info, cli._exit_on_command_line(True):
        cli._reject_incompatible_args(_clean_args(pipeline_parallel_size=2))
    assert info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("vllm-kvevict: error:") and "\n" not in err


@pytest.mark.parametrize("version", ["0.31.2", "0.33.0", "0.30.0+cpu", "1.0.0", "0.9.2"])
def test_unsupported_vllm_versions(version):
    with pytest.raises(VLLMContractError) as info:
        compat.check_vllm_version(version)
    message = str(info.value)
    assert version in message and "0.32" in message


@pytest.mark.parametrize("version", ["0.32.0", "0.32.0+cpu", "0.32.3", "0.32.1.post1"])
def test_supported_vllm_versions(version):
    compat.check_vllm_version(version)


def test_installed_vllm_satisfies_contracts():
    compat.check_vllm_version()
    compat.check_core_contract()
    compat.check_cpu_backend_contract()


class _Dummy:
    def method(self, a, b=1):
        pass

    not_callable = 3


def test_require_reports_missing_members_and_parameters():
    compat._require(_Dummy, "method", ("self", "a", "b"))
    compat._require(_Dummy, "not_callable", ("x",))  # no signature: nothing to check
    with pytest.raises(VLLMContractError, match=r"_Dummy\.gone is gone"):
        compat._require(_Dummy, "gone", ())
    with pytest.raises(VLLMContractError) as info:
        compat._require(_Dummy, "method", ("self", "a", "c", "d"))
    message = str(info.value)
    assert "_Dummy.method" in message and "c, d" in message and "self, a, b" in message
