"""Render the Grafana dashboard's panels from a real `vllm serve` run, without Grafana.

Starts `vllm serve --kv-eviction snapkv` of the default model with a small KV
pool (the `kvevict soak` server), a real Prometheus on loopback scraping its
`/metrics` every second, drives the soak load (mixed short and long prompts,
streaming, chat, client aborts) for --load-seconds, leaves the server idle for
--idle-seconds, then runs every target of every panel of
`vllm-kvevict-dashboard.json` through Prometheus's `/api/v1/query_range` and
draws the panels with matplotlib at their gridPos:

    PYTHONSAFEPATH=1 python deploy/grafana/render_panels.py --out docs/dashboard.png --load-seconds 150

Needs `pip install -e .[docs]` (matplotlib) and a `prometheus` binary next to
the Python interpreter or on PATH (`scripts/install_deploy_tools.sh`). The
query results are saved beside the server log (`query_range.json`);
`--replay FILE` draws the figure again from such a file without a new run.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import re
import shlex
import sys
import tempfile
import textwrap
import time
from pathlib import Path

# The Prometheus launcher is the tests' (tests/prometheus_server.py).
sys.path.append(str(Path(__file__).resolve().parents[2] / "tests"))
from prometheus_server import PrometheusServer, prometheus_binary  # noqa: E402

DASHBOARD = Path(__file__).resolve().with_name("vllm-kvevict-dashboard.json")
GRID_COLUMNS = 24




# --------------------------------------------------------------------------- Grafana templating


def duration(seconds: float) -> str:
    """Prometheus duration string, as Grafana writes interval variables."""
    if seconds >= 60 and seconds % 60 == 0:
        return f"{int(seconds // 60)}m"
    if seconds >= 1 and float(seconds).is_integer():
        return f"{int(seconds)}s"
    return f"{int(round(seconds * 1000))}ms"


def regex_value(values: list[str]) -> str:
    """Grafana's regex formatting of a multi-value variable."""
    escaped = [re.sub(r"([\\.^$*+?()\[\]{}|/])", r"\\\1", v) for v in values]
    return escaped[0] if len(escaped) == 1 else "(" + "|".join(escaped) + ")"


def substitute(expr: str, variables: dict[str, str]) -> str:
    """Replace $name, ${name}, ${name:fmt} and [[name]] (longest names first)."""

    def one(match: re.Match) -> str:
        name = match.group("braced") or match.group("plain") or match.group("old")
        return variables.get(name, match.group(0))

    return re.sub(
        r"\$\{(?P<braced>\w+)(?::\w+)?\}|\[\[(?P<old>\w+)\]\]|\$(?P<plain>\w+)", one, expr
    )


def resolve_variables(prom: PrometheusServer, dashboard: dict, start: float, end: float,
                      step: float, scrape: float) -> dict[str, str]:
    """Grafana's built-in interval variables, and the dashboard's query variables.

    Query variables (``label_values(selector, label)``) are evaluated against
    the stored series; with every value selected (the dashboard's ``includeAll``)
    the panels see the regex of those values.
    """
    variables = {
        "__interval": duration(step),
        "__interval_ms": str(int(step * 1000)),
        # Grafana: max($__interval + scrape interval, 4 * scrape interval).
        "__rate_interval": duration(max(step + scrape, 4 * scrape)),
        "__range": duration(round(end - start)),
        "__range_s": str(int(round(end - start))),
        "__range_ms": str(int(round((end - start) * 1000))),
    }
    for var in dashboard.get("templating", {}).get("list", []):
        if var.get("type") != "query":
            continue
        query = var.get("query")
        query = query.get("query") if isinstance(query, dict) else query or var.get("definition", "")
        match = re.fullmatch(r"\s*label_values\((.*),\s*(\w+)\s*\)\s*", substitute(query, variables))
        values: list[str] = []
        if match:
            series = prom.api("series", **{"match[]": match.group(1), "start": start, "end": end})
            values = sorted({s[match.group(2)] for s in series if match.group(2) in s})
        variables[var["name"]] = regex_value(values) if values else var.get("allValue") or ".*"
    return variables


def legend(template: str | None, labels: dict[str, str]) -> str:
    if not template or template == "__auto":
        name = labels.get("__name__", "")
        inner = ", ".join(f'{k}="{v}"' for k, v in sorted(labels.items()) if k != "__name__")
        return f"{name}{{{inner}}}" if inner or not name else name
    return re.sub(r"\{\{\s*(\w+)\s*\}\}", lambda m: labels.get(m.group(1), ""), template)


def bare_legend(template: str | None) -> str:
    """A legend template without its label placeholders (for a query that returned nothing)."""
    return re.sub(r"\s*-?\s*\w?\{\{\s*\w+\s*\}\}", "", template or "").strip() or "(series)"


def query_panels(prom: PrometheusServer, dashboard: dict, start: float, end: float, step: float,
                 variables: dict[str, str]) -> list[dict]:
    """Every non-row panel with each target's query_range result."""
    panels = []
    for panel in dashboard["panels"]:
        if panel.get("type") == "row":
            panels.append({"type": "row", "title": panel.get("title", ""), "gridPos": panel["gridPos"]})
            continue
        targets = []
        for target in panel.get("targets", []):
            if target.get("hide") or not target.get("expr"):
                continue
            expr = substitute(target["expr"], variables)
            result = prom.api("query_range", query=expr, start=start, end=end, step=step)["result"]
            targets.append({
                "refId": target.get("refId"), "expr": expr, "format": target.get("format"),
                "legendFormat": target.get("legendFormat"),
                "series": [
                    {"labels": r["metric"], "legend": legend(target.get("legendFormat"), r["metric"]),
                     "t": [float(t) for t, _ in r["values"]],
                     "v": [float(v) for _, v in r["values"]]}
                    for r in result
                ],
            })
        defaults = panel.get("fieldConfig", {}).get("defaults", {})
        options = panel.get("options", {})
        panels.append({
            "type": panel["type"], "title": panel.get("title", ""), "gridPos": panel["gridPos"],
            "unit": defaults.get("unit") or options.get("yAxis", {}).get("unit") or "short",
            "axisLabel": options.get("yAxis", {}).get("axisLabel") or defaults.get("custom", {}).get("axisLabel"),
            "calcs": options.get("legend", {}).get("calcs", []),
            "color": options.get("color", {}),
            "targets": targets,
        })
    return panels


# --------------------------------------------------------------------------- units


def _scaled(value: float, steps: list[tuple[float, str]], fmt: str = "{:.3g}") -> str:
    for factor, suffix in steps:
        if abs(value) >= factor:
            return fmt.format(value / factor) + suffix
    return fmt.format(value / steps[-1][0]) + steps[-1][1]


def format_value(value: float, unit: str) -> str:
    """A value as Grafana's simple units show it (bytes are IEC, as Grafana's `bytes`)."""
    if value is None or math.isnan(value):
        return "NaN"
    if unit == "bytes":
        return _scaled(value, [(2**40, " TiB"), (2**30, " GiB"), (2**20, " MiB"), (2**10, " KiB"), (1, " B")])
    if unit == "s":
        if value == 0:
            return "0 s"
        return _scaled(value, [(3600, " h"), (60, " min"), (1, " s"), (1e-3, " ms"), (1e-6, " µs"), (1e-9, " ns")])
    if unit == "percentunit":
        return f"{value * 100:.3g}%"
    if unit == "percent":
        return f"{value:.3g}%"
    if unit in ("reqps", "ops", "rps"):
        return format_value(value, "short") + {"reqps": " req/s", "ops": " ops/s", "rps": " rd/s"}[unit]
    if value == 0:
        return "0"
    return _scaled(value, [(1e12, " T"), (1e9, " B"), (1e6, " M"), (1e3, " K"), (1, "")])


def series_stats(values: list[float]) -> dict[str, float]:
    finite = [v for v in values if not math.isnan(v)]
    if not finite:
        return {}
    return {"lastNotNull": finite[-1], "last": values[-1], "max": max(finite), "min": min(finite),
            "mean": sum(finite) / len(finite)}


# --------------------------------------------------------------------------- drawing


def bucket_counts(series: list[dict]) -> tuple[list[str], list[list[float]], list[float]]:
    """Cumulative `le` series -> per-bucket counts (what Grafana's format=heatmap does)."""
    def bound(s: dict) -> float:
        return float(s["labels"].get("le", "inf").replace("+Inf", "inf"))

    ordered = sorted(series, key=bound)
    times = sorted({t for s in ordered for t in s["t"]})
    index = {t: i for i, t in enumerate(times)}
    cumulative = []
    for s in ordered:
        row = [math.nan] * len(times)
        for t, v in zip(s["t"], s["v"]):
            row[index[t]] = v
        cumulative.append(row)
    counts = []
    for i, row in enumerate(cumulative):
        below = cumulative[i - 1] if i else [0.0] * len(times)
        counts.append([max(0.0, a - b) if not (math.isnan(a) or math.isnan(b)) else math.nan
                       for a, b in zip(row, below)])
    labels = []
    for s in ordered:
        le = s["labels"].get("le", "+Inf")
        labels.append("+Inf" if le in ("+Inf", "inf") else f"≤{float(le):g}")
    return labels, counts, times


def draw(data: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib import colors as mcolors
    from matplotlib.ticker import FuncFormatter, Locator, MaxNLocator

    class ScaledLocator(Locator):
        """MaxNLocator ticks in the unit's display scale (1, 2, 5 MiB rather than 4.77 MiB)."""

        def __init__(self, unit: str) -> None:
            self.unit = unit
            self.inner = MaxNLocator(nbins=5, steps=[1, 2, 2.5, 5, 10])

        def __call__(self):
            vmin, vmax = self.axis.get_view_interval()
            return self.tick_values(vmin, vmax)

        def tick_values(self, vmin, vmax):
            factor = _unit_factor(self.unit, max(abs(vmin), abs(vmax)))
            return self.inner.tick_values(vmin / factor, vmax / factor) * factor

    panels = data["panels"]
    meta = data["meta"]
    t0 = meta["load_start"]
    bottom_units = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    width_in, unit_in = 22.0, 0.40  # 2200 px at 100 dpi; one grid unit is 40 px tall
    header_in, footer_in = 1.45, 0.75
    height_in = header_in + bottom_units * unit_in + footer_in
    fig = plt.figure(figsize=(width_in, height_in), dpi=100, facecolor="white")

    def rect(grid: dict) -> tuple[float, float, float, float]:
        """Figure-fraction rectangle of a gridPos cell."""
        x = grid["x"] / GRID_COLUMNS
        w = grid["w"] / GRID_COLUMNS
        top = header_in + grid["y"] * unit_in
        return x, 1 - (top + grid["h"] * unit_in) / height_in, w, grid["h"] * unit_in / height_in

    fig.text(0.01, 1 - 0.22 / height_in, meta["title"], fontsize=17, weight="bold", va="top")
    fig.text(0.01, 1 - 0.6 / height_in, meta["subtitle"], fontsize=10.5, va="top", color="#333",
             linespacing=1.45)
    footer = "\n".join(textwrap.fill(line, 250, subsequent_indent=" " * 13, break_on_hyphens=False)
                        for line in meta["footer"].splitlines())
    fig.text(0.01, 0.08 / height_in, footer, fontsize=8.5, va="bottom", color="#444",
             family="monospace")

    load_end = meta["load_end"] - t0
    drained = meta["drained"] - t0
    px = 1 / (width_in * 100)  # one pixel as a figure-width fraction
    py = 1 / (height_in * 100)
    for panel in panels:
        x, y, w, h = rect(panel["gridPos"])
        if panel["type"] == "row":
            fig.text(x + 8 * px, y + h / 2, panel["title"], fontsize=13, weight="bold", va="center")
            fig.add_artist(plt.Line2D([x + 8 * px, x + w - 8 * px], [y + 2 * py, y + 2 * py],
                                      color="#999", lw=0.8, transform=fig.transFigure))
            continue
        # The cell: a light frame like Grafana's panel, the title on top.
        fig.add_artist(plt.Rectangle((x + 4 * px, y + 4 * py), w - 8 * px, h - 8 * py,
                                     transform=fig.transFigure, fill=True, fc="#fafafa",
                                     ec="#cccccc", lw=0.8, zorder=-10))
        fig.text(x + 12 * px, y + h - 12 * py, panel["title"], fontsize=11.5, weight="bold", va="top")
        all_series = [s for t in panel["targets"] for s in t["series"]]
        empty_targets = [t for t in panel["targets"] if not t["series"]]
        heatmap = panel["type"] == "heatmap"
        n_legend = 0 if heatmap else len(all_series) + len(empty_targets)
        collapse = n_legend > 6 and all(s["v"] == all_series[0]["v"] for s in all_series)
        if collapse:
            n_legend = 1 + len(empty_targets)
        many = n_legend > 6
        legend_rows = 0 if heatmap else (math.ceil(n_legend / 6) if many else n_legend)
        legend_h = (legend_rows * 17 + 6) * py if legend_rows else 0
        left, right = 70 * px, (95 if heatmap else 16) * px
        top, bottom = 38 * py, 40 * py + legend_h
        ax = fig.add_axes((x + left, y + bottom, w - left - right, h - top - bottom))
        ax.set_facecolor("white")
        ax.tick_params(labelsize=8.5)
        ax.grid(True, color="#e4e4e4", lw=0.6)
        ax.set_axisbelow(True)
        ax.set_xlim(meta["range_start"] - t0, meta["range_end"] - t0)
        ax.axvspan(0, load_end, color="#4c9be8", alpha=0.06, lw=0)
        for at, style in ((load_end, "--"), (drained, ":")):
            ax.axvline(at, color="#777", lw=0.8, ls=style)
        ax.set_xlabel("seconds since the load started", fontsize=8.5, labelpad=1)
        if not all_series:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", va="center",
                    fontsize=16, color="#999")
            ax.set_yticks([])
            ax.text(0.5, 0.32, "\n".join(t["expr"] for t in panel["targets"])[:400],
                    transform=ax.transAxes, ha="center", va="top", fontsize=7, color="#999", wrap=True)
            continue
        if heatmap:
            labels, counts, times = bucket_counts(all_series)
            grid = np.ma.masked_invalid(np.array(counts, dtype=float))
            grid = np.ma.masked_less_equal(grid, 1e-9)  # the panel's filterValues: le 1e-9
            rel = np.array(times) - t0
            step = meta["step"]
            edges = np.concatenate([rel - step / 2, [rel[-1] + step / 2]])
            cmap = plt.get_cmap(panel["color"].get("scheme", "Oranges"))
            exponent = panel["color"].get("exponent", 0.5)
            mesh = ax.pcolormesh(edges, np.arange(len(labels) + 1), grid, cmap=cmap,
                                 norm=mcolors.PowerNorm(gamma=exponent, vmin=0), shading="flat")
            ax.set_yticks(np.arange(len(labels)) + 0.5, labels, fontsize=7.5)
            ax.set_ylim(0, len(labels))
            ax.grid(False)
            if panel.get("axisLabel"):
                ax.set_ylabel(panel["axisLabel"], fontsize=8.5)
            cax = fig.add_axes((x + w - right + 12 * px, y + bottom, 12 * px, h - top - bottom))
            bar = fig.colorbar(mesh, cax=cax)
            bar.ax.tick_params(labelsize=7.5)
            bar.set_label("observations per bucket, increase[1m]", fontsize=8)
            continue
        unit = panel["unit"]
        colors = plt.get_cmap("viridis")(np.linspace(0, 0.92, len(all_series))) if many else \
            plt.get_cmap("tab10").colors
        handles, names = [], []
        index = 0
        for target in panel["targets"]:
            for s in sorted(target["series"], key=lambda s: _natural(s["legend"])):
                rel = [t - t0 for t in s["t"]]
                (line,) = ax.plot(rel, s["v"], lw=1.3 if not many else 0.9,
                                  color=colors[index % len(colors)])
                index += 1
                stats = series_stats(s["v"])
                name = s["legend"]
                if not many:
                    name += "".join(
                        f"   {calc.replace('lastNotNull', 'last')}: {format_value(stats.get(calc, math.nan), unit)}"
                        for calc in panel["calcs"])
                handles.append(line)
                names.append(name)
            if not target["series"]:
                handles.append(plt.Line2D([], [], color="none"))
                names.append(f"{bare_legend(target['legendFormat'])}: no data"
                             f" (query {target['refId']} returned nothing)")
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos, unit=unit: format_value(v, unit)))
        ax.yaxis.set_major_locator(ScaledLocator(unit))
        finite = [v for s in all_series for v in s["v"] if not math.isnan(v)]
        if finite and max(finite) == min(finite) == 0:
            ax.set_ylim(0, 1)
        elif unit in ("bytes", "short", "reqps", "percentunit", "s") and \
                all(min((v for v in s["v"] if not math.isnan(v)), default=0) >= 0 for s in all_series):
            ax.set_ylim(bottom=0)
        if collapse:
            # One legend line instead of a wall of entries over a single visible line.
            stats = series_stats(all_series[0]["v"])
            first, last = (sorted((s["legend"] for s in all_series), key=_natural)[i] for i in (0, -1))
            names = [f"{first} .. {last}: all {len(all_series)} series equal (lines overlap)"
                     + "".join(f"   {calc.replace('lastNotNull', 'last')}: "
                               f"{format_value(stats.get(calc, math.nan), unit)}" for calc in panel["calcs"])]
            handles = handles[-1:]
        ax.legend(handles, names, loc="upper left", bbox_to_anchor=(0, -32 / ((h - top - bottom) / py)),
                  ncol=6 if many else 1, fontsize=8 if not many else 7, frameon=False,
                  handlelength=1.6, borderaxespad=0, columnspacing=1.0, labelspacing=0.25)
    fig.savefig(out, dpi=100, facecolor="white")
    plt.close(fig)


def _unit_factor(unit: str, vmax: float) -> float:
    if unit == "bytes":
        return next((f for f in (2**40, 2**30, 2**20, 2**10) if vmax >= f), 1)
    return 1


def _natural(text: str) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


# --------------------------------------------------------------------------- table


def _span(values: list[float], unit: str) -> str:
    low, high = min(values), max(values)
    return format_value(low, unit) if low == high else f"{format_value(low, unit)} .. {format_value(high, unit)}"


def table(data: dict) -> str:
    rows = []
    for panel in data["panels"]:
        if panel["type"] == "row":
            continue
        unit = panel["unit"]
        if panel["type"] == "heatmap":
            series = [s for t in panel["targets"] for s in t["series"]]
            if not series:
                rows.append((panel["title"], "-", "no data", ""))
                continue
            labels, counts, _times = bucket_counts(series)
            totals = [sum(c[i] for c in counts if not math.isnan(c[i])) for i in range(len(counts[0]))]
            per_bucket = [sum(v for v in c if not math.isnan(v)) for c in counts]
            mode = labels[per_bucket.index(max(per_bucket))]
            rows.append((panel["title"], f"{len(labels)} buckets, all observations / 1m",
                         format_value(totals[-1], "short"),
                         f"{format_value(max(totals), 'short')} (busiest bucket {mode})"))
            continue
        for target in panel["targets"]:
            if not target["series"]:
                rows.append((panel["title"], f"{target['refId']}: {bare_legend(target['legendFormat'])}",
                             "no data", ""))
            if len(target["series"]) > 6:
                ordered = sorted(target["series"], key=lambda s: _natural(s["legend"]))
                stats = [series_stats(s["v"]) for s in ordered]
                lasts = [st.get("lastNotNull", math.nan) for st in stats]
                maxes = [st.get("max", math.nan) for st in stats]
                same = all(s["v"] == ordered[0]["v"] for s in ordered)
                rows.append((panel["title"],
                             f"{len(ordered)} series, {ordered[0]['legend']} .. {ordered[-1]['legend']}"
                             + (" (all equal)" if same else ""),
                             _span(lasts, unit), _span(maxes, unit)))
                continue
            for s in sorted(target["series"], key=lambda s: _natural(s["legend"])):
                stats = series_stats(s["v"])
                rows.append((panel["title"], s["legend"],
                             format_value(stats.get("lastNotNull", math.nan), unit),
                             format_value(stats.get("max", math.nan), unit)))
    head = ("panel", "series", "last", "max")
    widths = [max(len(r[i]) for r in [head, *rows]) for i in range(4)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(head, widths)) + " |",
             "|" + "|".join("-" * (w + 2) for w in widths) + "|"]
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    return "\n".join(lines)


# --------------------------------------------------------------------------- the run


def record(args: argparse.Namespace, command: str) -> dict:
    """Serve, scrape, load, idle; return the panels' query_range data and the run's facts."""
    from transformers import AutoTokenizer

    from vllm_kvevict.default_model import DEFAULT_MODEL_BLOCK_BYTES, fetch_default_model
    from vllm_kvevict.evaluation.soak import run_soak, soak_server

    binary = prometheus_binary()
    if binary is None:
        raise SystemExit("prometheus not found: run scripts/install_deploy_tools.sh")
    model = args.model or str(fetch_default_model())
    tokenizer = AutoTokenizer.from_pretrained(model)
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="kvevict-render-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"work directory: {workdir}", flush=True)
    from vllm_kvevict.config import parse_config_source

    eviction = {**parse_config_source(args.config), "policy": args.policy}
    server = soak_server(model, eviction, args.pool_blocks, workdir)
    prom = None
    try:
        server.wait_ready(timeout=900)
        print(f"vllm serve ready at {server.url}", flush=True)
        prom = PrometheusServer(binary, server.url.removeprefix("http://"), workdir / "prometheus",
                          args.scrape_interval)
        prom.wait_ready()
        prom.wait_for('vllm:num_requests_running{job="vllm"}')
        range_start = time.time()
        time.sleep(args.before_seconds)  # a flat idle baseline before the load
        load_start = time.time()
        print(f"load: {args.clients} clients for {args.load_seconds:g} s", flush=True)
        report = run_soak(server, tokenizer, args.load_seconds, clients=args.clients, warmup_s=0,
                          seed=args.seed, idle_timeout_s=300)
        drained = time.time()
        print(f"drained {drained - load_start - args.load_seconds:.0f} s after the load ended; "
              f"idle for {args.idle_seconds:g} s", flush=True)
        time.sleep(args.idle_seconds)
        range_end = time.time()
        time.sleep(2 * args.scrape_interval + 1)  # the last scrape is stored
        stats = server.stats()
        dashboard = json.loads(Path(args.dashboard).read_text())
        step = args.scrape_interval
        variables = resolve_variables(prom, dashboard, range_start, range_end, step, args.scrape_interval)
        panels = query_panels(prom, dashboard, range_start, range_end, step, variables)
        serve_args = server.process.args
    finally:
        if prom is not None:
            prom.stop()
        server.stop()

    sent = sum(report.sent.values())
    pool_mib = stats["num_blocks"] * DEFAULT_MODEL_BLOCK_BYTES / 2**20 if args.model is None else None
    when = dt.datetime.fromtimestamp(load_start, dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    model_name = Path(model).name
    meta = {
        "title": (f"vllm-kvevict Grafana dashboard, every panel drawn from Prometheus query_range "
                  f"data of a real vllm serve run ({when})"),
        "subtitle": (
            f"vllm serve {model_name} --kv-eviction {args.policy} --kv-eviction-config "
            f"'{args.config}'   KV pool {stats['num_blocks']} blocks of 32 tokens"
            + (f" ({pool_mib:.0f} MiB)" if pool_mib else "")
            + f"   load: {args.load_seconds:g} s, {args.clients} clients (kvevict soak mix: short/long,"
            f" streaming, chat, client aborts), {sent} requests, {report.aborted} aborted,"
            f" {len(report.failed)} failed; then {args.idle_seconds:g} s idle.\n"
            f"Prometheus {args.scrape_interval:g} s scrape, query_range step {step:g} s; variables "
            + ", ".join(f"${k} = {v}" for k, v in variables.items() if not k.startswith("__"))
            + ", $__rate_interval = " + variables["__rate_interval"]
            + ".   Time axis: seconds since the load started; shaded: load;"
            " dashed line: load deadline; dotted: last request done.\n"
            "Lines and legends (last, max) as the dashboard's queries return them; the heatmap panel is"
            " drawn as a heatmap of per-bucket increase[1m] (the cumulative le buckets de-accumulated,"
            " as Grafana's format=heatmap does), empty cells hidden."
        ),
        "footer": "rendered by: " + command + "\nserver:      " + shlex.join(serve_args),
        "range_start": range_start, "range_end": range_end, "load_start": load_start,
        "load_end": load_start + args.load_seconds, "drained": drained, "step": step,
        "server": shlex.join(serve_args), "report": report.table(),
    }
    data = {"meta": meta, "variables": variables, "panels": panels}
    (workdir / "query_range.json").write_text(json.dumps(data))
    print(report.table())
    return data


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="docs/dashboard.png")
    parser.add_argument("--load-seconds", type=float, default=150)
    parser.add_argument("--idle-seconds", type=float, default=20, help="idle after the load")
    parser.add_argument("--before-seconds", type=float, default=8, help="idle before the load")
    parser.add_argument("--clients", type=int, default=12)
    parser.add_argument("--policy", default="snapkv")
    parser.add_argument("--config", default='{"budget": 512}', help="--kv-eviction-config")
    parser.add_argument("--pool-blocks", type=int, default=160, help="KV pool size in blocks")
    parser.add_argument("--model", default=None, help="model dir (default: the embedded SmolLM2)")
    parser.add_argument("--scrape-interval", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dashboard", default=str(DASHBOARD))
    parser.add_argument("--workdir", default=None, help="server and Prometheus files (default: a temp dir)")
    parser.add_argument("--replay", default=None, help="draw from a saved query_range.json")
    args = parser.parse_args(argv)

    command = shlex.join(["python", *sys.argv]) if argv is None else shlex.join(["python", __file__, *argv])
    started = time.monotonic()
    if args.replay:
        data = json.loads(Path(args.replay).read_text())
    else:
        data = record(args, command)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    draw(data, out)
    print()
    print(table(data))
    print()
    print(f"wrote {out} ({time.monotonic() - started:.0f} s)")
    print("command: " + data["meta"]["footer"].splitlines()[0].removeprefix("rendered by: "))
    print("server:  " + data["meta"]["server"])
    if args.replay:
        print("drawn again from the saved query results by: " + command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
