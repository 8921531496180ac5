"""A real Prometheus server on loopback, for tests and the dashboard renderer.

The binary is Debian's, unpacked next to the Python interpreter by
``scripts/install_deploy_tools.sh`` (or any ``prometheus`` on PATH).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import requests

from vllm_kvevict.evaluation.server import free_port


def prometheus_binary() -> str | None:
    local = Path(sys.executable).with_name("prometheus")
    return str(local) if local.exists() else shutil.which("prometheus")


class PrometheusServer:
    """A Prometheus server on loopback scraping one target (`job="vllm"`)."""

    def __init__(self, binary: str, target: str, workdir: Path, scrape_interval: float) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        interval = f"{scrape_interval:g}s"
        (workdir / "prometheus.yml").write_text(
            f"global:\n  scrape_interval: {interval}\n  evaluation_interval: {interval}\n"
            "scrape_configs:\n  - job_name: vllm\n    metrics_path: /metrics\n"
            f"    static_configs:\n      - targets: ['{target}']\n"
        )
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log_path = workdir / "prometheus.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(
            [binary, f"--config.file={workdir / 'prometheus.yml'}",
             f"--storage.tsdb.path={workdir / 'data'}",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self._log, stderr=subprocess.STDOUT,
        )

    def wait_ready(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                break
            try:
                if requests.get(self.url + "/-/ready", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise RuntimeError("prometheus did not become ready:\n" + self.log_path.read_text())

    def api(self, path: str, **params) -> dict | list:
        response = requests.get(self.url + "/api/v1/" + path, params=params, timeout=60)
        body = response.json()
        if body.get("status") != "success":
            raise RuntimeError(f"{path} {params}: {body}")
        return body["data"]

    def wait_for(self, expr: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not self.api("query", query=expr)["result"]:
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus has no {expr} after {timeout}s")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
