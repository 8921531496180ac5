"""Where a serving engine's time goes: py-spy samples of vLLM's worker
process (the one that runs the model) while ``kvevict bench`` loads it,
summed by function.

    pip install py-spy
    PYTHONSAFEPATH=1 python benchmarks/serving_profile.py --setting adakv_snapkv@0.25 \\
        --seconds 90 --out results/profile_adakv -- --requests 8 --max-tokens 128

Everything after ``--`` goes to ``kvevict bench`` (one ``--setting``, this
one). Once the worker of that setting's server is up and the load has
started, py-spy records its worker (``--rate`` samples per second, ``--seconds``
long, native frames off: a C++ or OpenMP kernel counts to the Python
function that called it). Printed: for each function, the share of samples in
which it is on the stack (inclusive) and at the top (self), the engine's
busy samples only (its idle wait for work left out), and ``stacks.txt``
(py-spy's raw collapsed stacks) is kept in ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

# A sample is busy when the worker is inside a model step (not waiting for
# the engine core's next request).
BUSY = ("execute_model", "sample_tokens")


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, list[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    bench_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    own = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", required=True, help="the kvevict bench setting to serve and profile")
    parser.add_argument("--seconds", type=float, default=90.0, help="recording length (default: %(default)s)")
    parser.add_argument("--delay", type=float, default=20.0, help="seconds after the engine starts serving before recording (default: %(default)s)")
    parser.add_argument("--rate", type=int, default=50, help="samples per second (default: %(default)s)")
    parser.add_argument("--top", type=int, default=30, help="rows printed (default: %(default)s)")
    parser.add_argument("--out", required=True, help="folder for the bench results and stacks.txt")
    return parser.parse_args(own), bench_args


def worker_pids(parent: int) -> list[int]:
    """vLLM's worker processes (``VLLM::Worker``) below ``parent``."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            status = (proc / "status").read_text()
        except OSError:
            continue
        name = status.split("\n", 1)[0]
        if "VLLM::Worker" in name or "VLLM::Worker" in cmdline:
            if _descends(int(proc.name), parent):
                found.append(int(proc.name))
    return found


def _descends(pid: int, ancestor: int) -> bool:
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            return False
        pid = int(stat.rsplit(")", 1)[1].split()[1])
    return False


def summarize(stacks: Path, top: int) -> str:
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    busy = 0
    for line in stacks.read_text().splitlines():
        frames_text, _, count_text = line.rpartition(" ")
        if not frames_text or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(frame) for frame in frames_text.split(";")]
        if not any(frame.rsplit(".", 1)[-1] in BUSY for frame in frames):
            continue  # waiting for work
        busy += count
        for frame in set(frames):
            inclusive[frame] += count
        own[frames[-1]] += count
    lines = [f"busy samples: {busy}", "", "| function | inclusive | self |", "|---|---|---|"]
    for frame, count in inclusive.most_common(top):
        lines.append(f"| `{frame}` | {100 * count / max(busy, 1):.1f}% | {100 * own[frame] / max(busy, 1):.1f}% |")
    return "\n".join(lines)


def _short(frame: str) -> str:
    """``function (path/to/module.py:line)`` → ``module.function``."""
    function, _, where = frame.partition(" (")
    path = where.split(":")[0]
    for marker in ("site-packages/", "/work/main/"):
        if marker in path:
            path = path.split(marker, 1)[1]
    module = path.removesuffix(".py").replace("/", ".")
    return f"{module}.{function}" if module else function


def main(argv: list[str] | None = None) -> int:
    args, bench_args = parse_args(argv)
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).exists():
        print("serving_profile: py-spy not found; pip install py-spy", file=sys.stderr)
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kvevict = str(Path(sys.executable).with_name("kvevict"))
    bench = subprocess.Popen(
        [kvevict, "bench", "--setting", args.setting, "--out", str(out / "bench"), "--force", "--no-progress", *bench_args],
        stdout=open(out / "bench.log", "w"), stderr=subprocess.STDOUT,
    )
    try:
        pids: list[int] = []
        while bench.poll() is None:
            time.sleep(2)
            pids = worker_pids(bench.pid)
            if pids and _health(out):
                break
        if bench.poll() is not None or not pids:
            print("serving_profile: the bench ended before its worker was found", file=sys.stderr)
            return 1
        time.sleep(args.delay)
        stacks = out / "stacks.txt"
        subprocess.run(
            [py_spy, "record", "--pid", str(pids[0]), "--duration", str(int(args.seconds)),
             "--rate", str(args.rate), "--format", "raw", "--output", str(stacks), "--nonblocking"],
            check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        summary = summarize(stacks, args.top)
        (out / "profile.md").write_text(summary + "\n")
        print(summary)
    finally:
        bench.wait()
    return 0


def _health(out: Path) -> bool:
    """The setting's server answers (its log says so)."""
    logs = list((out / "bench" / "servers").glob("*/server.log"))
    return any("Application startup complete" in log.read_text(errors="replace") for log in logs)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONSAFEPATH", "1")
    sys.exit(main())
