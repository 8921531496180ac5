"""A real `vllm serve` process on loopback, for tests and benchmarks."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

# LO-HI: the ports free_port() hands out (see there).
PORT_RANGE_ENV = "KVEVICT_PORT_RANGE"


def free_port() -> int:
    """A loopback port that no socket holds now, for a server about to bind it.

    By default the kernel picks it from its ephemeral range, where the port is
    free again once this returns: another process asking the kernel for a port
    before the server binds may be given the same one. With
    ``KVEVICT_PORT_RANGE=LO-HI`` the ports come from that range instead, in
    turn, through a counter file that every process using the range shares
    under a lock: two calls get the same port only after the whole range has
    been handed out. The test suite gives each pytest-xdist worker a range of
    its own below the kernel's ephemeral range, so no two servers of the run,
    and none of the ports vLLM asks the kernel for, can collide.
    """
    spec = os.environ.get(PORT_RANGE_ENV, "")
    if not spec:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]
    low, high = _port_range(spec)
    counter = Path(tempfile.gettempdir()) / f"kvevict-ports-{low}-{high}"
    with open(counter, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        text = handle.read().strip()
        last = int(text) if text.isdigit() else high
        size = high - low + 1
        for step in range(1, size + 1):
            port = low + (last - low + step) % size
            with socket.socket() as sock:
                try:
                    sock.bind(("127.0.0.1", port))
                except OSError:
                    continue
            handle.seek(0)
            handle.truncate()
            handle.write(str(port))
            return port
    raise RuntimeError(f"{PORT_RANGE_ENV}={spec}: every port of the range is in use")


def _port_range(spec: str) -> tuple[int, int]:
    try:
        low, high = (int(part) for part in spec.split("-"))
    except ValueError:
        low, high = 0, -1
    if not 0 < low <= high < 65536:
        raise ValueError(f"{PORT_RANGE_ENV} must be LO-HI (ports 1 to 65535), not {spec!r}")
    return low, high


def vllm_executable() -> str:
    candidate = Path(sys.executable).with_name("vllm")
    return str(candidate) if candidate.exists() else "vllm"


def parse_metrics(exposition: str) -> dict[str, float]:
    """Prometheus exposition text -> {sample name: value summed over its label sets}.

    Sample names, so counters read with ``_total`` and histograms as ``_sum`` and
    ``_count``; ``_created`` timestamps and ``_bucket`` series (whose sum over
    ``le`` means nothing) are left out. Summing adds up engines (data parallel)
    and ranks; with one engine a vLLM gauge has one label set.
    """
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            if sample.name.endswith(("_created", "_bucket")):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
    return values


def scrape(url: str, timeout: float = 10) -> str:
    """A server's /metrics exposition text."""
    reply = requests.get(url.rstrip("/") + "/metrics", timeout=timeout)
    reply.raise_for_status()
    return reply.text


def scrape_metrics(url: str, timeout: float = 10) -> dict[str, float]:
    """A server's /metrics, parsed (``parse_metrics``)."""
    return parse_metrics(scrape(url, timeout))


def served_model(url: str) -> tuple[str, str | None]:
    """(model id to request, the model's path or repo on the server) from /v1/models."""
    reply = requests.get(url.rstrip("/") + "/v1/models", timeout=30)
    reply.raise_for_status()
    model = reply.json()["data"][0]
    return model["id"], model.get("root")


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def busy_engine_cores(process_name: str = "VLLM::Worker") -> set[int]:
    """Cores the vLLM CPU workers running on this host are bound to (the
    affinity of each process whose name starts with ``process_name``, the
    name vLLM gives its workers)."""
    import psutil

    busy: set[int] = set()
    for process in psutil.process_iter(["name"]):
        try:
            if (process.info["name"] or "").startswith(process_name):
                busy.update(os.sched_getaffinity(process.pid))
        except (psutil.Error, OSError):
            continue
    return busy


def engine_binding(environ: dict[str, str], allowed: set[int], busy: set[int]) -> dict[str, str]:
    """``VLLM_CPU_OMP_THREADS_BIND`` for a server about to start on vLLM's CPU
    build: the first of the ``allowed`` cores that no running worker is bound
    to (``busy``). vLLM's CPU worker binds itself to the first core otherwise,
    so a second server on the host shares that core with the first. Nothing
    when the variable is set already, or when every core is taken."""
    if environ.get(CPU_BIND_ENV):
        return {}
    free = sorted(allowed - busy)
    return {CPU_BIND_ENV: str(free[0])} if free else {}


def _cpu_build() -> bool:
    from importlib.metadata import PackageNotFoundError, distribution

    try:
        distribution("vllm-cpu")
    except PackageNotFoundError:
        return False
    return True


class VllmServer:
    """A real `vllm serve` process on loopback, with the plugin loaded by vLLM."""

    def __init__(self, model: str, args: list[str], stats_path: Path, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.stats_path = stats_path
        self.log_path = log_path
        env = dict(os.environ, KVEVICT_STATS_PATH=str(stats_path), PYTHONSAFEPATH="1")
        if _cpu_build():  # its own core, not the first core another server computes on
            env.update(engine_binding(env, os.sched_getaffinity(0), busy_engine_cores()))
        self._log = open(log_path, "w")
        self.process = subprocess.Popen(
            [vllm_executable(), "serve", model, "--host", "127.0.0.1", "--port", str(self.port),
             "--served-model-name", "smollm2", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )

    def wait_ready(self, timeout: float = 300) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1)
        raise TimeoutError(f"vllm serve not ready after {timeout}s:\n{self.log_tail()}")

    def stats(self) -> dict:
        """The scheduler side's eviction counters (``EvictionManager``)."""
        return json.loads(self.stats_path.read_text())

    def worker_stats(self, rank: int = 0) -> dict:
        """One worker's side-buffer and isolation counters (``WorkerEvictionState``)."""
        return json.loads(Path(f"{self.stats_path}.worker{rank}").read_text())

    def wait_idle(self, timeout: float = 30, ranks: int = 1) -> tuple[dict, list[dict]]:
        """Poll until no request holds a block or a side-buffer row; return the counters.

        Raises TimeoutError with the last counters when they do not get there:
        a leaked block or row.
        """
        deadline = time.monotonic() + timeout
        while True:
            stats = self.stats()
            workers = [self.worker_stats(rank) for rank in range(ranks)]
            idle = (
                stats["live_requests"] == 0
                and stats["free_blocks"] == stats["num_blocks"] - 1
                and all(w["rows_in_use"] == 0 for w in workers)
            )
            if idle:
                return stats, workers
            if time.monotonic() > deadline:
                raise TimeoutError(f"not idle after {timeout}s: {stats} {workers}")
            time.sleep(0.2)

    def metric(self, name: str) -> float:
        return scrape_metrics(self.url)[name]

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self._log.close()
