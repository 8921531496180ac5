"""Bad input at start-up: one clear sentence naming the fix, no traceback,
no silent run without eviction. Each case starts a real `vllm serve`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import vllm_executable

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def sliding_window_model(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Mistral-style config with a sliding window (no weights needed: the
    check runs before vLLM loads them)."""
    path = tmp_path_factory.mktemp("sliding_model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, path / name)
    config = {
        "architectures": ["MistralForCausalLM"], "model_type": "mistral",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 49152, "max_position_embeddings": 4096, "sliding_window": 256,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "torch_dtype": "float32",
        "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def gemma_model(model_dir: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A Gemma config, an architecture the learned policy's gates do not hook."""
    path = tmp_path_factory.mktemp("gemma_model")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(model_dir) / name, path / name)
    config = {
        "architectures": ["GemmaForCausalLM"], "model_type": "gemma",
        "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 49152, "max_position_embeddings": 4096, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "torch_dtype": "float32", "hidden_activation": "gelu_pytorch_tanh",
        "bos_token_id": 1, "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def tiny_gates(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Retention gates for the tiny test model, not for the default one."""
    from tiny_model import build_tiny_gates, fetch_tiny_model

    return str(build_tiny_gates(fetch_tiny_model(), tmp_path_factory.mktemp("tiny") / "gates"))


def serve(model: str, args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(
        [vllm_executable(), "serve", model, "--dtype", "float32", "--max-model-len", "2048",
         "--block-size", "32", "--enforce-eager", "--kv-cache-memory-bytes", "200000000",
         "--host", "127.0.0.1", "--port", "1", *args],
        capture_output=True, text=True, timeout=240,
        env=dict(os.environ, PYTHONSAFEPATH="1"),
    )


def test_each_bad_input_fails_early_with_one_clear_sentence(
    model_dir, sliding_window_model, gemma_model, tiny_gates, tmp_path
):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("budget: [512\n")
    cases = [
        (model_dir, ["--kv-eviction", "bogus"], "invalid choice: 'bogus'"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config", "{budget: 512"],
         "--kv-eviction-config is not valid JSON"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config", str(tmp_path / "missing.yaml")],
         "neither inline JSON nor an existing file"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config", str(bad_yaml)],
         "fix the file's syntax"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config", '{"budget": 16}'],
         "cannot hold sink_tokens (4) + recent_window (32)"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config", '{"budgt": 512}'],
         "unknown setting 'budgt'"),
        (model_dir, ["--kv-eviction", "snapkv", "--enable-prefix-caching"],
         "drop --enable-prefix-caching"),
        (model_dir, ["--kv-eviction", "snapkv", "--speculative-config",
                     '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}'],
         "does not support speculative decoding"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-transfer-config",
                     '{"kv_connector": "ExampleConnector", "kv_role": "kv_both"}'],
         "cannot be combined with a KV connector"),
        (sliding_window_model, ["--kv-eviction", "streamingllm"],
         "does not support sliding-window models"),
        # Checked against the model's settings before any worker starts.
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config", '{"budget": 5000}'],
         "budget 5000 exceeds --max-model-len 2048"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config", '{"observation_window": 4096}'],
         "observation_window 4096 exceeds --max-model-len 2048"),
        (model_dir, ["--kv-eviction", "snapkv", "--kv-eviction-config",
                     '{"head_budget": "adaptive", "budget": 40}'],
         "budget 40 rounds down to 32"),
        (gemma_model, ["--kv-eviction", "learned"], "not for GemmaForCausalLM"),
        (model_dir, ["--kv-eviction", "learned", "--kv-eviction-config",
                     json.dumps({"policy_options": {"gates": tiny_gates}})],
         "are for hidden size 256, 4 layers, 4 KV heads"),
    ]
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda case: serve(case[0], case[1]), cases))
    for (_, args, expected), result in zip(cases, results):
        output = result.stdout + result.stderr
        assert result.returncode != 0, (args, output[-2000:])
        assert expected in output, (args, output[-2000:])
        assert "Traceback" not in output, (args, output[-4000:])


def test_offline_llm_rejects_bad_config_before_starting(model_dir):
    from vllm import LLM

    from vllm_kvevict.config import KVEvictionConfigError

    with pytest.raises(KVEvictionConfigError, match="unknown eviction policy 'nope'; choose one of"):
        LLM(model_dir, enforce_eager=True, additional_config={"kv_eviction": {"policy": "nope"}})
    with pytest.raises(KVEvictionConfigError, match="drop --enable-prefix-caching"):
        LLM(model_dir, enforce_eager=True, enable_prefix_caching=True,
            additional_config={"kv_eviction": {"policy": "snapkv"}})
