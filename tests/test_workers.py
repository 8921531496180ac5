"""What lets the suite run on two pytest-xdist workers: ports no two servers
share, a core of its own for each worker's engines, engines that do not spin
on a second core, models built once when two processes ask for them together.

The engines' binding itself is checked on a real server in
``test_e2e_serve.py`` (``test_engine_runs_on_the_workers_core``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from helpers import (
    PORT_RANGE_ENV,
    PORTS_PER_WORKER,
    bind_to_engine_core,
    free_port,
    ranks_binding,
    worker_environment,
)

PRINT_PORTS = "from vllm_kvevict.evaluation.server import free_port\nprint(*(free_port() for _ in range({n})))"


@pytest.fixture
def private_counter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """free_port's counter files in ``tmp_path`` (for this process and children)."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    return tmp_path


def test_ports_come_from_the_range_in_turn(private_counter, monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "31000-31003")
    assert [free_port() for _ in range(6)] == [31000, 31001, 31002, 31003, 31000, 31001]


def test_a_port_in_use_is_skipped(private_counter, monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, "31010-31012")
    with socket.socket() as held:
        held.bind(("127.0.0.1", 31011))
        held.listen()
        assert [free_port() for _ in range(3)] == [31010, 31012, 31010]
        with socket.socket() as second, socket.socket() as third:
            second.bind(("127.0.0.1", 31010))
            third.bind(("127.0.0.1", 31012))
            with pytest.raises(RuntimeError, match="every port of the range is in use"):
                free_port()


def test_processes_sharing_a_range_never_get_the_same_port(private_counter, monkeypatch):
    """Four processes asking together: every port handed out once."""
    monkeypatch.setenv(PORT_RANGE_ENV, "31100-31199")
    env = dict(os.environ, PYTHONSAFEPATH="1")
    procs = [subprocess.Popen([sys.executable, "-c", PRINT_PORTS.format(n=20)], env=env,
                              stdout=subprocess.PIPE, text=True) for _ in range(4)]
    ports = [int(port) for proc in procs for port in proc.communicate(timeout=120)[0].split()]
    assert all(proc.returncode == 0 for proc in procs)
    assert len(ports) == len(set(ports)) == 80
    assert all(31100 <= port <= 31199 for port in ports)


def test_without_a_range_the_kernel_chooses(monkeypatch):
    monkeypatch.delenv(PORT_RANGE_ENV, raising=False)
    assert 0 < free_port() < 65536


@pytest.mark.parametrize("spec", ["31000", "31005-31000", "0-10", "a-b", "1-70000", "1-2-3"])
def test_a_malformed_range_is_refused(spec, monkeypatch):
    monkeypatch.setenv(PORT_RANGE_ENV, spec)
    with pytest.raises(ValueError, match=PORT_RANGE_ENV):
        free_port()


def test_each_worker_has_its_own_core_and_ports():
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    settings = [worker_environment(f"gw{i}", [0, 1]) for i in range(4)]
    assert [s["VLLM_CPU_OMP_THREADS_BIND"] for s in settings] == ["0", "1", "0", "1"]
    assert all(s["OMP_NUM_THREADS"] == "1" for s in settings)
    ranges = [tuple(map(int, s[PORT_RANGE_ENV].split("-"))) for s in settings]
    assert all(high - low + 1 == PORTS_PER_WORKER for low, high in ranges)
    assert all(ranges[i][1] < ranges[i + 1][0] for i in range(3))  # disjoint
    assert ranges[-1][1] < ephemeral_low  # none of them the kernel's to give out
    assert worker_environment("gw1", [4, 6])["VLLM_CPU_OMP_THREADS_BIND"] == "6"
    assert worker_environment("", [0, 1]) == {}  # one process: nothing set


def test_this_worker_has_its_settings():
    """conftest.py applied worker_environment to this process (under xdist)."""
    expected = worker_environment(os.environ.get("PYTEST_XDIST_WORKER", ""), sorted(os.sched_getaffinity(0)))
    assert {name: os.environ.get(name) for name in expected} == expected


def _child_cores() -> list[int]:
    out = subprocess.run([sys.executable, "-c", "import os; print(*sorted(os.sched_getaffinity(0)))"],
                         capture_output=True, text=True, check=True, preexec_fn=bind_to_engine_core)
    return [int(core) for core in out.stdout.split()]


def test_in_process_engines_bind_to_the_workers_core(monkeypatch):
    allowed = sorted(os.sched_getaffinity(0))
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", str(allowed[-1]))
    assert _child_cores() == [allowed[-1]]
    for unbound in ("auto", "nobind", "0|1"):  # nothing for one core of this worker's
        monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", unbound)
        assert _child_cores() == allowed
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")
    assert _child_cores() == allowed


def test_tensor_parallel_ranks_stay_on_the_workers_core(monkeypatch):
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    assert ranks_binding(2) == "1|1"
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND")  # the machine to itself: a core each
    assert ranks_binding(2) == "0|1"


QUEUE_WAIT_CPU = """
import time, zmq
from vllm.distributed.device_communicators import shm_broadcast
reader = shm_broadcast.SpinCondition(is_reader=True, context=zmq.Context(), notify_address="inproc://queue")
reader.record_read()  # as after a message: vLLM's readers then poll for busy_loop_s
wall, cpu, turns = time.monotonic(), time.process_time(), 0
while time.monotonic() - wall < 0.5:
    reader.wait(timeout_ms=50)  # one turn of acquire_read's loop: nothing is written
    turns += 1
print(shm_broadcast.sched_yield.__module__, turns, time.process_time() - cpu)
"""


def test_engines_poll_their_queues_without_spinning():
    """A process the tests start (conftest.py's PYTHONPATH) polls vLLM's
    queues with sleeps: half a second of polling costs little CPU, where
    vLLM's sched_yield loop costs all of it, and the queue is still polled
    (hundreds of turns: a step's message is seen within a millisecond)."""
    out = subprocess.run([sys.executable, "-c", QUEUE_WAIT_CPU], capture_output=True, text=True, check=True)
    module, turns, cpu_seconds = out.stdout.split()
    assert module == "sitecustomize"
    assert int(turns) > 500
    assert float(cpu_seconds) < 0.25, f"polling 0.5 s took {float(cpu_seconds):.2f} s of CPU"


NO_POLLING = """
import sys, sitecustomize  # the engines' start-up module, imported at start-up
module = type(sys)("shm_broadcast")
module.SpinCondition = object
sitecustomize.poll_with_sleeps(module)
"""


def test_a_vllm_that_polls_otherwise_is_named():
    out = subprocess.run([sys.executable, "-c", NO_POLLING], capture_output=True, text=True)
    assert out.returncode != 0
    assert "no longer polls with sched_yield; update this file" in out.stderr.splitlines()[-1]


BUILD_TINY = """
import sys, time
from pathlib import Path
from tiny_model import build_tiny_llama
out, ready, go = map(Path, sys.argv[1:])
ready.touch()
while not go.exists():
    time.sleep(0.001)
print(build_tiny_llama(out, seed=3, num_hidden_layers=1, hidden_size=64, intermediate_size=64))
"""


def test_two_processes_asking_for_the_tiny_model_together_both_get_it(tmp_path):
    """Two processes start building at the same moment: both get the whole
    model (without the lock both wrote, renamed and removed the same staging
    folder)."""
    out, go = tmp_path / "tiny", tmp_path / "go"
    tests = str(Path(__file__).parent)  # where tiny_model.py is
    env = dict(os.environ, PYTHONSAFEPATH="1",
               PYTHONPATH=os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")])))
    ready = [tmp_path / f"ready{i}" for i in range(2)]
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_TINY, str(out), str(flag), str(go)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for flag in ready]
    deadline = time.monotonic() + 300
    while not all(flag.exists() for flag in ready) and time.monotonic() < deadline:
        time.sleep(0.01)
    go.touch()
    results = [proc.communicate(timeout=300) for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0], [err[-2000:] for _, err in results]
    assert [stdout.strip() for stdout, _ in results] == [str(out)] * 2
    assert (out / "model.safetensors").is_file() and (out / "kvevict_tiny.json").is_file()
    assert not (tmp_path / "tiny.partial").exists()


def test_a_launched_server_takes_a_core_no_worker_holds():
    """Outside the suite's binding, a server started by kvevict eval, bench or
    soak is bound to the first allowed core that no running vLLM CPU worker
    holds; a binding already given is kept; no binding when all are taken."""
    from vllm_kvevict.evaluation.server import engine_binding

    assert engine_binding({}, {0, 1, 2}, set()) == {"VLLM_CPU_OMP_THREADS_BIND": "0"}
    assert engine_binding({}, {0, 1, 2}, {0}) == {"VLLM_CPU_OMP_THREADS_BIND": "1"}
    assert engine_binding({}, {2, 3}, {0, 1, 2}) == {"VLLM_CPU_OMP_THREADS_BIND": "3"}
    assert engine_binding({}, {0, 1}, {0, 1}) == {}
    assert engine_binding({"VLLM_CPU_OMP_THREADS_BIND": "5"}, {0, 1}, set()) == {}


def test_busy_engine_cores_reads_the_running_workers_affinity():
    """Processes named as the workers are (a name of this test's own, so the
    suite's engines do not count), bound to one allowed core: that core is
    busy while one runs and free once none does; a process of another name
    is not counted."""
    from vllm_kvevict.evaluation.server import busy_engine_cores

    name = f"KVT{os.getpid() % 100000}"
    core = sorted(os.sched_getaffinity(0))[-1]
    code = (
        "import ctypes, os, sys, time\n"
        "ctypes.CDLL(None).prctl(15, sys.argv[1].encode(), 0, 0, 0)\n"  # PR_SET_NAME
        f"os.sched_setaffinity(0, {{{core}}})\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    assert busy_engine_cores(name) == set()
    procs = [subprocess.Popen([sys.executable, "-c", code, n], stdout=subprocess.PIPE, text=True)
             for n in (name + "w", "Other" + name)]
    try:
        for proc in procs:
            assert proc.stdout.readline().strip() == "ready"
        assert busy_engine_cores(name) == {core}
        procs[0].kill()
        procs[0].wait()
        assert busy_engine_cores(name) == set()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
