"""Retrieval scores through a real `vllm serve`: start a server with an
eviction setting, send retrieval prompts through the OpenAI API, count hits.

A sample scores when the greedy answer contains the expected number.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from vllm_kvevict.evaluation.server import VllmServer
from vllm_kvevict.evaluation.tasks import RetrievalSample

# CPU, fp32, chunked prefill of 512 tokens; room for 4 ~8k-token requests.
SERVER_ARGS = [
    "--dtype", "float32", "--max-model-len", "8192", "--block-size", "32",
    "--max-num-batched-tokens", "512", "--max-num-seqs", "4", "--enforce-eager",
    "--kv-cache-memory-bytes", "1500000000",
]


def score(server: VllmServer, samples: list[RetrievalSample], concurrency: int = 4) -> int:
    """How many samples the served model answers (greedy, 12 tokens)."""
    from openai import OpenAI

    api = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=1200)

    def ask(sample: RetrievalSample) -> bool:
        reply = api.completions.create(
            model="smollm2", prompt=sample.prompt, max_tokens=12, temperature=0
        )
        return sample.answer in reply.choices[0].text

    with ThreadPoolExecutor(concurrency) as pool:
        return sum(pool.map(ask, samples))


def serve_and_score(
    model: str,
    eviction: dict | None,
    tasks: dict[str, list[RetrievalSample]],
    work: Path,
) -> dict[str, int]:
    """Hits per task of one `vllm serve` with ``eviction`` (None: full cache)."""
    args = list(SERVER_ARGS)
    if eviction is not None:
        args += ["--kv-eviction", eviction["policy"], "--kv-eviction-config", json.dumps(eviction)]
    server = VllmServer(model, args, stats_path=work / "stats.json", log_path=work / "server.log")
    try:
        server.wait_ready()
        return {name: score(server, samples) for name, samples in tasks.items()}
    finally:
        server.stop()
