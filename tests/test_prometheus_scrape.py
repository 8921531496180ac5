"""A real Prometheus server scrapes the shared `vllm serve --kv-eviction snapkv`.

Prometheus (Debian's build, unpacked by scripts/install_deploy_tools.sh) runs on
loopback with a one-second scrape interval; after a few requests the plugin's
series are read back through Prometheus's HTTP query API and must equal what
the server's /metrics says, beside vLLM's own series.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from helpers import free_port, needle_prompt

pytestmark = pytest.mark.e2e


def _prometheus_binary() -> str | None:
    local = Path(sys.executable).with_name("prometheus")
    return str(local) if local.exists() else shutil.which("prometheus")


@pytest.fixture(scope="module")
def prometheus(snapkv_server, tmp_path_factory):
    binary = _prometheus_binary()
    if binary is None:
        if os.environ.get("KVEVICT_REQUIRE_DEPLOY_TOOLS"):
            pytest.fail("prometheus not found: run scripts/install_deploy_tools.sh")
        pytest.skip("prometheus not installed (scripts/install_deploy_tools.sh)")
    work = tmp_path_factory.mktemp("prometheus")
    target = snapkv_server.url.removeprefix("http://")
    (work / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: vllm\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['{target}']\n"
    )
    port = free_port()
    log = open(work / "prometheus.log", "w")
    process = subprocess.Popen(
        [binary, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
         f"--web.listen-address=127.0.0.1:{port}"],
        stdout=log, stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                if requests.get(url + "/-/ready", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            time.sleep(0.5)
        else:
            pytest.fail("prometheus did not become ready:\n" + (work / "prometheus.log").read_text())
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def query(url: str, expr: str) -> list[dict]:
    response = requests.get(url + "/api/v1/query", params={"query": expr}, timeout=10).json()
    assert response["status"] == "success", response
    return response["data"]["result"]


def served_value(server_url: str, name: str) -> float:
    for line in requests.get(server_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


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
    expected = served_value(server.url, "kvevict_blocks_freed_total")
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
