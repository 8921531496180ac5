"""Test helpers: the evaluation tools, and the shared server's settings."""

from vllm_kvevict.evaluation.server import VllmServer, free_port, vllm_executable  # noqa: F401
from vllm_kvevict.evaluation.tasks import needle_prompt  # noqa: F401

# The shared test server's eviction settings (see configs/snapkv.yaml for why
# kernel 15 on the default model).
SNAPKV_SERVER_CONFIG = {"policy": "snapkv", "budget": 512, "policy_options": {"kernel_size": 15}}


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
