"""What a policy reads from the model is looked up when the model is loaded.

Expected Attention scores with the model's RoPE frequencies. On a model whose
rotary embedding covers only part of each head (partial rotary) it cannot
score, and that must stop start-up with the reason, not pass start-up and
fail the first request that reaches an eviction point.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from helpers import bind_to_engine_core

pytestmark = pytest.mark.e2e

SCRIPT = """
import sys
from vllm import LLM
try:
    LLM(sys.argv[1], dtype="float32", max_model_len=2048, block_size=32, enforce_eager=True,
        kv_cache_memory_bytes=64 * 2**20,
        additional_config={"kv_eviction": {"policy": "expected_attention", "budget": 256}})
except Exception as exc:
    print("START-UP FAILED:", type(exc).__name__, exc)
    sys.exit(3)
print("STARTED")
"""


@pytest.fixture(scope="module")
def partial_rotary_model(tmp_path_factory) -> str:
    from tiny_model import fetch_tiny_model

    tiny = fetch_tiny_model()
    path = tmp_path_factory.mktemp("partial_rotary")
    for item in tiny.iterdir():
        shutil.copy(item, path / item.name)
    config = json.loads((tiny / "config.json").read_text())
    config["partial_rotary_factor"] = 0.5
    config["rope_parameters"] = {**config["rope_parameters"], "partial_rotary_factor": 0.5}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_partial_rotary_model_fails_start_up_for_expected_attention(partial_rotary_model):
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, partial_rotary_model], capture_output=True, text=True,
        timeout=600, env=dict(os.environ, PYTHONSAFEPATH="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"),
        preexec_fn=bind_to_engine_core,
    )
    output = result.stdout + result.stderr
    assert "STARTED" not in result.stdout, output[-3000:]
    assert result.returncode == 3, output[-3000:]
    assert "START-UP FAILED: KVEvictionConfigError" in result.stdout, output[-3000:]
    assert "partial rotary (16 of 32 dimensions)" in result.stdout, output[-3000:]
