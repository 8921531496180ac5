"""Test helpers: the evaluation tools, and the shared server's settings."""

from vllm_kvevict.evaluation.server import VllmServer, free_port, vllm_executable  # noqa: F401
from vllm_kvevict.evaluation.tasks import needle_prompt  # noqa: F401

# The shared test server's eviction settings (see configs/snapkv.yaml for why
# kernel 15 on the default model).
SNAPKV_SERVER_CONFIG = {"policy": "snapkv", "budget": 512, "policy_options": {"kernel_size": 15}}
# The shared head_pages server's: AdaKV head budgets over SnapKV scores, with
# the MomentKV correction.
HEAD_PAGES_SERVER_CONFIG = {**SNAPKV_SERVER_CONFIG, "head_budget": "adaptive", "moment_correction": True}


def eviction_server_args(config: dict, pool_blocks: int) -> list[str]:
    """`vllm serve` arguments of the tests' servers: the default model in fp32,
    4k context, 512-token chunks, a KV pool of ``pool_blocks`` blocks of 32."""
    import json

    from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES

    return [
        "--kv-eviction", config["policy"],
        "--kv-eviction-config", json.dumps(config),
        "--dtype", "float32", "--max-model-len", "4096", "--block-size", "32",
        "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--enforce-eager",
        "--kv-cache-memory-bytes", str(pool_blocks * DEFAULT_MODEL_BLOCK_BYTES + 4096),
    ]


def kvevict_samples(exposition: str) -> dict[tuple[str, tuple], float]:
    """The plugin's samples in a Prometheus exposition, keyed by (name, sorted labels).

    Fails on a series exported twice: Prometheus rejects such a scrape.
    """
    from prometheus_client.parser import text_string_to_metric_families

    samples: dict[tuple[str, tuple], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.startswith("kvevict_"):
                key = (sample.name, tuple(sorted(sample.labels.items())))
                assert key not in samples, f"series exported twice: {key}"
                samples[key] = sample.value
    return samples
