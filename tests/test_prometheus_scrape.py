"""A real Prometheus server scrapes the shared `vllm serve --kv-eviction snapkv`.

Prometheus (Debian's build, unpacked by scripts/install_deploy_tools.sh) runs on
loopback with a one-second scrape interval; after a few requests the plugin's
series are read back through Prometheus's HTTP query API and must equal what
the server's /metrics says, beside vLLM's own series.
"""

from __future__ import annotations

import os
import time

import pytest
import requests

from helpers import needle_prompt
from prometheus_server import PrometheusServer, prometheus_binary

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def prometheus(snapkv_server, tmp_path_factory):
    binary = prometheus_binary()
    if binary is None:
        if os.environ.get("KVEVICT_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail("prometheus not found: run scripts/install_deploy_tools.sh")
        pytest.skip("prometheus not installed (scripts/install_deploy_tools.sh)")
    server = PrometheusServer(
        binary, snapkv_server.url.removeprefix("http://"),
        tmp_path_factory.mktemp("prometheus"), scrape_interval=1,
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


def query(prometheus: PrometheusServer, expr: str) -> list[dict]:
    return prometheus.api("query", query=expr)["result"]


def test_prometheus_reads_the_plugin_series(snapkv_server, prometheus, tokenizer):
    server = snapkv_server
    for key in (13579, 24680):
        requests.post(
            server.url + "/v1/completions",
            json={"model": "smollm2", "prompt": needle_prompt(tokenizer, key, 2500),
                  "max_tokens": 40, "temperature": 0, "ignore_eos": True},
            timeout=600,
        ).raise_for_status()
    server.wait_idle()
    time.sleep(1.0)
    expected = server.metric("kvevict_blocks_freed_total")
    assert expected > 0

    deadline = time.monotonic() + 30
    while True:
        result = query(prometheus, "kvevict_blocks_freed_total")
        if result and float(result[0]["value"][1]) == expected:
            break
        assert time.monotonic() < deadline, (result, expected)
        time.sleep(1)
    labels = result[0]["metric"]
    assert (labels["job"], labels["model_name"], labels["policy"]) == ("vllm", "smollm2", "snapkv")

    # The dashboard's queries work on the stored series, beside vLLM's own.
    for expr in (
        "kvevict_compression_ratio",
        "sum(kvevict_layer_retained_tokens)",
        "histogram_quantile(0.95, sum by (le) (rate(kvevict_eviction_seconds_bucket[1m])))",
        "increase(kvevict_eviction_events_total[5m])",
        "kvevict_side_buffer_bytes",
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
    ):
        assert query(prometheus, expr), expr
    assert float(query(prometheus, "increase(kvevict_eviction_events_total[5m])")[0]["value"][1]) > 0
