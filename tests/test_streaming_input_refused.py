"""Streaming-input (resumable) requests are refused while eviction is on.

vLLM 0.32 lets a client append input chunks to a running request, which grows
its prompt mid-request; the eviction schedule is placed from the prompt
length, so such a request is refused with vLLM's validation error (a 400 on
the API server) and the engine goes on serving ordinary requests.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import bind_to_engine_core

pytestmark = pytest.mark.e2e

SCRIPT = """
import asyncio, sys
from vllm import SamplingParams
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.engine.protocol import StreamingInput
from vllm.inputs import TokensPrompt
from vllm.v1.engine.async_llm import AsyncLLM

async def chunks():
    for start in (0, 40):
        yield StreamingInput(prompt=TokensPrompt(prompt_token_ids=list(range(start + 5, start + 45))))

async def main():
    args = AsyncEngineArgs(sys.argv[1], dtype="float32", max_model_len=2048, block_size=32,
                           enforce_eager=True, kv_cache_memory_bytes=64 * 2**20,
                           additional_config={"kv_eviction": {"policy": "snapkv", "budget": 256}})
    llm = AsyncLLM.from_engine_args(args)
    greedy = SamplingParams(max_tokens=4, temperature=0)
    try:
        async for _ in llm.generate(chunks(), greedy, request_id="streamed"):
            pass
    except Exception as exc:
        print("REFUSED:", type(exc).__name__, exc)
    else:
        print("SERVED STREAMING INPUT")
    async for out in llm.generate(TokensPrompt(prompt_token_ids=list(range(5, 300))), greedy, request_id="plain"):
        final = out
    print("PLAIN TOKENS:", len(final.outputs[0].token_ids))
    llm.shutdown()

asyncio.run(main())
"""


def test_streaming_input_is_refused_and_the_engine_serves_on():
    from tiny_model import fetch_tiny_model

    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(fetch_tiny_model())], capture_output=True, text=True,
        timeout=600, env=dict(os.environ, PYTHONSAFEPATH="1", VLLM_ENABLE_V1_MULTIPROCESSING="0"),
        preexec_fn=bind_to_engine_core,
    )
    output = result.stdout + result.stderr
    assert result.returncode == 0, output[-3000:]
    assert "REFUSED: VLLMValidationError streaming-input requests grow their prompt" in result.stdout, output[-3000:]
    assert "PLAIN TOKENS: 4" in result.stdout, output[-3000:]
