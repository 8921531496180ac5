"""A bounded soak test against a real `vllm serve --kv-eviction` on loopback.

Clients in threads send, until the time is up, a random mix of short and long
prompts, streaming and not, completions and chat, some of them dropped at a
random point (client disconnect), with more clients than the server runs
requests at once and a KV pool smaller than their prompts. Then the server
must go back to idle: every block back in vLLM's pool, every side-buffer row
free. The resident memory of the server's processes is sampled every two
seconds throughout; the report gives its least-squares slope after warm-up
(MiB/s), and the start (after warm-up) and the end.

    kvevict soak --duration 600 --clients 12          # snapkv@512, its own server
    kvevict soak --duration 600 --setting full        # the same load without eviction
    kvevict soak --setting momentkv@1024 --kv-eviction-config '{"decode_interval": 16}'
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import openai
import psutil

from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES
from vllm_kvevict.evaluation.client import openai_client
from vllm_kvevict.evaluation.server import VllmServer
from vllm_kvevict.evaluation.tasks import needle_prompt

KINDS = ("short", "long", "stream", "chat", "abort")


@dataclass
class SoakReport:
    duration_s: float
    clients: int
    sent: Counter = field(default_factory=Counter)  # per kind
    failed: list[str] = field(default_factory=list)  # one line per failed request
    aborted: int = 0
    completion_tokens: int = 0
    done: int = 0  # requests finished (answered, failed or dropped by the client)
    rss_mib: list[tuple[float, float]] = field(default_factory=list)  # (t, MiB)
    # (t, {process name: MiB}): which process of the tree grows, if one does
    rss_by_process: list[tuple[float, dict[str, float]]] = field(default_factory=list)
    warmup_s: float = 0.0
    idle_stats: dict = field(default_factory=dict)
    idle_workers: list[dict] = field(default_factory=list)
    leak: str | None = None  # why the server did not get back to idle

    @property
    def rss_after_warmup(self) -> tuple[float, float]:
        """Median RSS of the first and the last quarter of the samples after warm-up."""
        samples = [mib for t, mib in self.rss_mib if t >= self.warmup_s]
        if len(samples) < 4:
            return (samples[0], samples[-1]) if samples else (0.0, 0.0)
        quarter = max(1, len(samples) // 4)
        return statistics.median(samples[:quarter]), statistics.median(samples[-quarter:])

    @property
    def rss_slope_mib_per_s(self) -> float:
        """Least-squares slope (MiB/s) of the server's RSS over the samples after warm-up."""
        return _slope([(t, mib) for t, mib in self.rss_mib if t >= self.warmup_s])

    def slope_by_process(self) -> dict[str, float]:
        """The same slope for each process of the server's tree."""
        series: dict[str, list[tuple[float, float]]] = {}
        for t, usage in self.rss_by_process:
            if t >= self.warmup_s:
                for name, mib in usage.items():
                    series.setdefault(name, []).append((t, mib))
        return {name: _slope(points) for name, points in series.items()}

    def growth_by_process(self) -> dict[str, float]:
        """MiB each process gained between the first sample after warm-up and the last."""
        samples = [usage for t, usage in self.rss_by_process if t >= self.warmup_s]
        if len(samples) < 2:
            return {}
        first, last = samples[0], samples[-1]
        return {name: last[name] - first[name] for name in last if name in first}

    def table(self) -> str:
        start, end = self.rss_after_warmup
        rows = [
            ("duration (s)", f"{self.duration_s:.0f}"),
            ("clients", str(self.clients)),
            ("requests sent", str(sum(self.sent.values()))),
            ("  by kind", ", ".join(f"{k} {self.sent[k]}" for k in KINDS)),
            ("aborted by the client", str(self.aborted)),
            ("failed (not aborted)", str(len(self.failed))),
            ("completion tokens", str(self.completion_tokens)),
            ("blocks freed by eviction", str(self.idle_stats.get("blocks_freed_by_eviction"))),
            ("leaked blocks at the end",
             str(self.idle_stats.get("num_blocks", 1) - 1 - self.idle_stats.get("free_blocks", 0))),
            ("side-buffer rows in use at the end",
             str(sum(w.get("rows_in_use", 0) for w in self.idle_workers))),
            ("NaN attention outputs", str(sum(w.get("nan_outputs", 0) for w in self.idle_workers))),
            ("server RSS after warm-up (MiB)", f"{start:.0f}"),
            ("server RSS at the end (MiB)", f"{end:.0f}"),
            ("server RSS slope after warm-up (MiB/s)", f"{self.rss_slope_mib_per_s:.3f}"),
            ("  by process (MiB/s)", ", ".join(
                f"{name} {slope:+.3f}" for name, slope in sorted(self.slope_by_process().items())
            )),
            ("RSS growth per process (MiB)", ", ".join(
                f"{name} {mib:+.0f}" for name, mib in sorted(self.growth_by_process().items())
            )),
        ]
        width = max(len(name) for name, _ in rows)
        lines = [f"| {'measure'.ljust(width)} | value |", f"|{'-' * (width + 2)}|-------|"]
        lines += [f"| {name.ljust(width)} | {value} |" for name, value in rows]
        if self.leak:
            lines.append(f"LEAK: {self.leak}")
        lines += [f"FAILED: {line}" for line in self.failed[:20]]
        return "\n".join(lines)


def _slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``(x, y)`` points; 0 for fewer than three."""
    if len(points) < 3:
        return 0.0
    xs, ys = zip(*points)
    if max(xs) == min(xs):
        return 0.0
    return statistics.linear_regression(xs, ys).slope


def process_tree_rss_mib(pid: int) -> dict[str, float]:
    """Resident memory (MiB) of a process and each descendant (API server, engine, workers)."""
    try:
        root = psutil.Process(pid)
        processes = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return {}
    usage: dict[str, float] = {}
    for process in processes:
        try:
            name = f"{process.name()}[{process.pid}]"
            usage[name] = process.memory_info().rss / 2**20
        except psutil.NoSuchProcess:
            pass
    return usage


class SoakClient:
    def __init__(self, server: VllmServer, tokenizer, report: SoakReport, seed: int) -> None:
        self.server = server
        self.api = openai_client(server.url, timeout=900)
        self.tokenizer = tokenizer
        self.report = report
        self.rng = random.Random(seed)
        self.lock = threading.Lock()

    def _prompt(self, tokens: int) -> tuple[str, str]:
        key = str(self.rng.randint(10000, 99999))
        return needle_prompt(self.tokenizer, int(key), tokens, self.rng.random()), key

    def _fail(self, kind: str, why: str) -> None:
        with self.lock:
            self.report.failed.append(f"{kind}: {why}"[:300])

    def one_request(self) -> None:
        kind = self.rng.choice(KINDS)
        with self.lock:
            self.report.sent[kind] += 1
        long = kind == "long" or (kind in ("stream", "abort") and self.rng.random() < 0.5)
        prompt, _ = self._prompt(self.rng.randint(1500, 3000) if long else self.rng.randint(80, 600))
        max_tokens = self.rng.randint(1, 96)
        try:
            if kind == "chat":
                response = self.api.chat.completions.create(
                    model="smollm2", max_tokens=max_tokens, temperature=0,
                    messages=[{"role": "user", "content": prompt}],
                )
                usage = response.usage.completion_tokens
            elif kind in ("short", "long"):
                response = self.api.completions.create(
                    model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0,
                    extra_body={"ignore_eos": True},
                )
                usage = response.usage.completion_tokens
                if usage != max_tokens:
                    return self._fail(kind, f"{usage} tokens, asked {max_tokens}")
            else:
                usage = self._stream(kind, prompt, max_tokens)
                if usage is None:
                    return
            with self.lock:
                self.report.completion_tokens += usage
        except openai.APIStatusError as exc:
            self._fail(kind, f"HTTP {exc.status_code} {exc.response.text}")
        except openai.APIError as exc:  # no answer (connection, timeout), or an error event in a stream
            self._fail(kind, repr(exc))

    def _stream(self, kind: str, prompt: str, max_tokens: int) -> int | None:
        """A streamed completion, dropped after a random number of chunks for
        ``abort``; the tokens it returned, from the usage its last chunk
        carries (a chunk may hold several tokens: vLLM merges the outputs a
        slow reader has not taken yet)."""
        drop_after = self.rng.randint(0, max_tokens) if kind == "abort" else None
        chunks, finished, tokens = 0, False, None
        with self.api.completions.create(
            model="smollm2", prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        ) as stream:
            for chunk in stream:
                if chunk.usage is not None:
                    tokens = chunk.usage.completion_tokens
                if not chunk.choices:
                    continue
                chunks += 1
                finished = finished or any(choice.finish_reason for choice in chunk.choices)
                if drop_after is not None and chunks >= drop_after:
                    with self.lock:
                        self.report.aborted += 1
                    return None  # closing the stream drops the connection
        if not finished or tokens != max_tokens:
            self._fail(kind, f"stream ended after {tokens} of {max_tokens} tokens in {chunks} chunks"
                             f"{'' if finished else ', no finish_reason'}")
            return None
        return tokens


def run_soak(
    server: VllmServer,
    tokenizer,
    duration_s: float,
    clients: int = 12,
    warmup_s: float = 30.0,
    seed: int | None = None,
    idle_timeout_s: float = 60.0,
    check_idle: bool = True,
    progress: bool = False,
) -> SoakReport:
    """Drive ``server`` for ``duration_s`` seconds, then check it is back to idle
    (``check_idle``: a server without eviction has no counters to check).
    ``progress``: a line on stderr with the time, requests done, failures and RSS."""
    seed = random.randrange(2**32) if seed is None else seed
    report = SoakReport(duration_s=duration_s, clients=clients, warmup_s=warmup_s)
    start = time.monotonic()
    deadline = start + duration_s
    stop_sampling = threading.Event()
    done_lock = threading.Lock()

    def sample_rss() -> None:
        while not stop_sampling.wait(2.0):
            usage = process_tree_rss_mib(server.process.pid)
            now = time.monotonic() - start
            report.rss_mib.append((now, sum(usage.values())))
            report.rss_by_process.append((now, usage))
            if progress:
                show_progress(report, now, duration_s)

    def client_loop(index: int) -> None:
        client = SoakClient(server, tokenizer, report, seed + index)
        while time.monotonic() < deadline:
            client.one_request()
            with done_lock:
                report.done += 1
        client.api.close()

    sampler = threading.Thread(target=sample_rss, daemon=True)
    sampler.start()
    threads = [threading.Thread(target=client_loop, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stop_sampling.set()
    sampler.join()
    if progress:
        show_progress(report, time.monotonic() - start, duration_s, final=True)
    if not check_idle:
        return report
    try:
        report.idle_stats, report.idle_workers = server.wait_idle(timeout=idle_timeout_s)
    except TimeoutError as exc:
        report.leak = str(exc)
        report.idle_stats = server.stats()
        report.idle_workers = [server.worker_stats()]
    return report


def show_progress(report: SoakReport, elapsed: float, duration: float, final: bool = False) -> None:
    """One status line on stderr: rewritten in place on a terminal, else every 30 s."""
    rss = f"{report.rss_mib[-1][1]:.0f} MiB" if report.rss_mib else "-"
    line = (f"soak {min(elapsed, duration):.0f}/{duration:.0f}s: {report.done} requests done, "
            f"{len(report.failed)} failed, {report.aborted} dropped by the client, server RSS {rss}")
    if sys.stderr.isatty():
        print(f"\r{line}", end="\n" if final else "", file=sys.stderr, flush=True)
    elif final or int(elapsed) // 30 != int(elapsed - 2.0) // 30:
        print(line, file=sys.stderr, flush=True)


SOAK_BLOCK_SIZE = 32
SOAK_MAX_MODEL_LEN = 4096


def build_parser() -> argparse.ArgumentParser:
    from vllm_kvevict.help_format import HelpFormatter
    from vllm_kvevict.evaluation.settings import add_kv_eviction_config_argument

    parser = argparse.ArgumentParser(prog="kvevict soak", description=__doc__.split("\n\n")[0],
                                     formatter_class=HelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--duration", type=float, default=600, help="seconds of load")
    parser.add_argument("--clients", type=int, default=12, help="client threads sending requests")
    parser.add_argument("--warmup", type=float, default=30,
                        help="seconds before the RSS slope counts")
    parser.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2)")
    parser.add_argument("--setting", default="snapkv@512", metavar="SPEC",
                        help="what the server runs: 'CONFIG@TOKENS' (a policy, a shipped config "
                        "or a .yaml/.json config path, with a budget in tokens per KV head, a "
                        f"multiple of {SOAK_BLOCK_SIZE}) or 'full' (no eviction: the baseline of "
                        "the server's memory)")
    add_kv_eviction_config_argument(parser, applies_to="the eviction setting",
                                    budget_from="--setting", example='{"decode_interval": 16}')
    parser.add_argument("--pool-blocks", type=int, default=160,
                        help=f"KV pool size in blocks of {SOAK_BLOCK_SIZE} tokens")
    parser.add_argument("--seed", type=int, default=None,
                        help="seed of the clients' choices (default: a random one)")
    parser.add_argument("--workdir", default="soak-run", help="server log, stats and report.json")
    parser.add_argument("--no-progress", action="store_true", help="no progress line")
    return parser


def main(argv: list[str] | None = None) -> int:
    from vllm_kvevict.evaluation.settings import eviction_config, parse_settings

    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.duration > 0:
        parser.error("--duration must be a positive number of seconds")
    if not 0 <= args.warmup < args.duration:
        parser.error("--warmup must be at least 0 and shorter than --duration")
    if args.clients < 1:
        parser.error("--clients must be at least 1")
    if args.pool_blocks < 2:
        parser.error("--pool-blocks must be at least 2 (vLLM keeps one block back)")
    (setting,) = parse_settings(parser, [args.setting], args.kv_eviction_config, SOAK_BLOCK_SIZE)
    if setting.url is not None:
        parser.error(f"--setting {args.setting}: soak starts its own server, to read its "
                     "processes' memory and its eviction counters; give 'full' or CONFIG@TOKENS")
    if setting.fraction is not None:
        parser.error(f"--setting {args.setting}: soak's prompts are 80 to 3,000 tokens, so a "
                     "fraction of the prompt means no fixed budget; give a budget in tokens, "
                     f"e.g. {setting.name.rsplit('@', 1)[0]}@512")
    eviction = None
    if setting.eviction is not None:
        try:
            eviction = eviction_config(setting, 0.0, SOAK_BLOCK_SIZE, context=f"--setting {args.setting}")
        except ValueError as exc:
            parser.error(str(exc))
        if eviction["budget"] > SOAK_MAX_MODEL_LEN:
            parser.error(f"--setting {args.setting}: budget {eviction['budget']} exceeds the "
                         f"server's --max-model-len {SOAK_MAX_MODEL_LEN}; give at most that")
    if args.model is not None and not Path(args.model).is_dir():
        parser.error(f"--model {args.model}: no such folder; give a local model folder "
                     "(`kvevict fetch-model` converts the default one)")

    from transformers import AutoTokenizer

    from vllm_kvevict.default_model import fetch_default_model

    model = args.model or str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    server = soak_server(model, eviction, args.pool_blocks, workdir)
    try:
        server.wait_ready()
        report = run_soak(server, tokenizer, args.duration, args.clients, args.warmup, seed=args.seed,
                          check_idle=eviction is not None, progress=not args.no_progress)
    finally:
        server.stop()
    print(report.table())
    (workdir / "report.json").write_text(json.dumps({
        "setting": setting.name, "eviction": eviction,
        "sent": report.sent, "failed": report.failed, "aborted": report.aborted,
        "rss_mib": report.rss_mib, "rss_by_process": report.rss_by_process,
        "rss_slope_mib_per_s": report.rss_slope_mib_per_s,
        "idle_stats": report.idle_stats,
        "idle_workers": report.idle_workers, "leak": report.leak,
    }, indent=1))
    return 0 if not report.failed and not report.leak else 1


def soak_server(
    model: str, eviction: dict | None, pool_blocks: int, workdir: Path
) -> VllmServer:
    """`vllm serve` of the default model with the eviction config ``eviction``
    (none if None) and a small KV pool."""
    flags = ["--kv-eviction", eviction["policy"], "--kv-eviction-config", json.dumps(eviction)] if eviction else []
    return VllmServer(
        model,
        [*flags,
         "--dtype", "float32", "--max-model-len", str(SOAK_MAX_MODEL_LEN),
         "--block-size", str(SOAK_BLOCK_SIZE),
         "--max-num-batched-tokens", "512", "--max-num-seqs", "8", "--enforce-eager",
         "--kv-cache-memory-bytes", str(pool_blocks * DEFAULT_MODEL_BLOCK_BYTES + 4096)],
        stats_path=workdir / "stats.json",
        log_path=workdir / "server.log",
    )
