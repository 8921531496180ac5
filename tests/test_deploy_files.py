"""Deployment files checked with the real tools: hadolint (Dockerfiles),
shellcheck (entry point), promtool (Prometheus config and every PromQL query of
the Grafana dashboard), kubernetes-validate (manifests, against the schemas of
a pinned Kubernetes release), kubectl's kustomize and helm (rendering).

`bash scripts/install_deploy_tools.sh VENV` puts the tools in VENV/bin. A
missing tool skips its test, unless KVEVICT_REQUIRE_DEPLOY_TOOLS is set (CI),
where it fails.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "vllm-kvevict-dashboard.json"
K8S = DEPLOY / "kubernetes"
ENTRYPOINT = DEPLOY / "docker-entrypoint.sh"
IMAGE_ENTRYPOINT = "/usr/local/bin/kvevict-entrypoint"
IMAGE_CONFIG_DIR = "/opt/vllm-kvevict/configs"
VLLM_BASE_IMAGE = "vllm/vllm-openai:v0.32.0"
KUBERNETES_VERSION = "1.32.0"  # schemas bundled with kubernetes-validate
VERSION = re.search(r'^version = "([^"]+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
REQUIRE_TOOLS = os.environ.get("KVEVICT_REQUIRE_DEPLOY_TOOLS", "") not in ("", "0")

# The plugin's series as scraped (counters with _total, histogram parts), used
# when vllm_kvevict.metrics does not provide METRIC_NAMES.
LOCAL_METRIC_NAMES = {
    "kvevict_logical_tokens", "kvevict_retained_tokens", "kvevict_compression_ratio",
    "kvevict_blocks_held", "kvevict_side_buffer_bytes", "kvevict_layer_retained_tokens",
    "kvevict_blocks_freed_total", "kvevict_eviction_events_total",
    "kvevict_requests_admitted_total", "kvevict_requests_admitted_beyond_memory_total",
    *(f"{h}_{part}" for h in ("kvevict_eviction_seconds", "kvevict_head_retained_tokens")
      for part in ("bucket", "sum", "count")),
}
# What the dashboard must show.
REQUIRED_DASHBOARD_METRICS = {
    "kvevict_retained_tokens", "kvevict_logical_tokens", "kvevict_compression_ratio",
    "kvevict_blocks_freed_total", "kvevict_eviction_seconds_bucket",
    "kvevict_eviction_events_total", "kvevict_side_buffer_bytes",
    "kvevict_layer_retained_tokens", "kvevict_head_retained_tokens_bucket",
    "kvevict_requests_admitted_beyond_memory_total", "vllm:kv_cache_usage_perc",
    "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:num_preemptions_total",
    "vllm:generation_tokens_total", "vllm:prompt_tokens_total",
}


def _missing(what: str) -> None:
    message = f"{what} is not installed: bash scripts/install_deploy_tools.sh {sys.prefix}"
    if REQUIRE_TOOLS:
        pytest.fail(message + " (KVEVICT_REQUIRE_DEPLOY_TOOLS is set)")
    pytest.skip(message)


def tool(name: str) -> str:
    """A validator binary: this interpreter's venv first, then PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        _missing(name)
    return found


def module(name: str):
    try:
        return __import__(name)
    except ImportError:
        _missing(f"Python module {name}")


def run(*args: str, cwd: Path = ROOT, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


def load_docs(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def dashboard_queries() -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and the selector of every
    label_values() template query."""
    data = dashboard()
    # Grafana replaces its range variables before the query reaches Prometheus.
    queries = [(f"panel {p['id']} target {t['refId']}",
                re.sub(r"\$(__rate_interval|__interval|__range)\b", "1m", t["expr"]))
               for p in data["panels"] for t in p.get("targets", [])]
    for var in data["templating"]["list"]:
        if var["type"] == "query":
            match = re.fullmatch(r"label_values\((.+),\s*\w+\)", var["definition"])
            assert match, f"variable {var['name']}: expected label_values(SELECTOR, LABEL)"
            queries.append((f"variable {var['name']}", match.group(1)))
    return queries


# --------------------------------------------------------------------------- Dockerfiles

def dockerfile_instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuations joined and comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for line in path.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        full = (pending + line).strip()
        pending = ""
        keyword, _, rest = full.partition(" ")
        out.append((keyword.upper(), rest.strip()))
    return out


def test_hadolint_passes_both_dockerfiles():
    hadolint = tool("hadolint")
    config = yaml.safe_load((ROOT / ".hadolint.yaml").read_text())
    assert config["failure-threshold"] == "style"  # every finding fails
    proc = run(hadolint, "--config", str(ROOT / ".hadolint.yaml"), "--no-color",
               "Dockerfile", "Dockerfile.cpu", check=False)
    assert proc.returncode == 0 and not proc.stdout.strip(), proc.stdout + proc.stderr
    # The harness sees findings: a shell-form CMD is one (DL3025).
    bad = subprocess.run(
        [hadolint, "--config", str(ROOT / ".hadolint.yaml"), "--no-color", "-"],
        input="FROM python:3.11-slim\nCMD vllm serve x\n", capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "DL3025" in bad.stdout


def test_shellcheck_passes_entrypoint_and_scripts():
    run(tool("shellcheck"), str(ENTRYPOINT), str(ROOT / "scripts" / "install_deploy_tools.sh"),
        str(ROOT / "scripts" / "build_images.sh"))


@pytest.mark.parametrize("name", ["Dockerfile", "Dockerfile.cpu"])
def test_dockerfile_runs_the_entrypoint_in_exec_form(name):
    instructions = dockerfile_instructions(ROOT / name)
    entrypoints = [args for kw, args in instructions if kw == "ENTRYPOINT"]
    assert [json.loads(e) for e in entrypoints] == [[IMAGE_ENTRYPOINT]]  # exec form
    cmds = [args for kw, args in instructions if kw == "CMD"]
    assert all(isinstance(json.loads(c), list) for c in cmds)
    copies = [args.split() for kw, args in instructions if kw == "COPY"]
    assert any(c[-2:] == ["deploy/docker-entrypoint.sh", IMAGE_ENTRYPOINT] for c in copies)
    assert any(c[-2:] == ["configs", "./configs"] for c in copies)
    for c in copies:  # every source is in the repository
        for src in [a for a in c[:-1] if not a.startswith("--")]:
            assert (ROOT / src).exists(), f"{name}: COPY {src}: no such path"
    # Everything pyproject.toml maps into the package, and the license.
    sources = {c[-2] for c in copies}
    assert {"vllm_kvevict", "triton_kernels", "csrc", "configs"} <= sources
    assert any({"pyproject.toml", "README.md", "LICENSE"} <= set(c[:-1]) for c in copies)
    workdirs = [args for kw, args in instructions if kw == "WORKDIR"]
    assert workdirs[-1] + "/configs" == IMAGE_CONFIG_DIR
    env = dockerfile_env(ROOT / name)
    assert env["KV_EVICTION"] == ("none" if name == "Dockerfile" else "snapkv")
    assert env["KVEVICT_CONFIG_DIR"] == IMAGE_CONFIG_DIR
    assert [args for kw, args in instructions if kw == "EXPOSE"] == ["8000"]
    (healthcheck,) = [args for kw, args in instructions if kw == "HEALTHCHECK"]
    command = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert command[0].startswith("python") and "http://127.0.0.1:8000/health" in command[-1]


def dockerfile_env(path: Path) -> dict[str, str]:
    """The ENV settings of a Dockerfile (KEY=VALUE pairs, quotes removed)."""
    env: dict[str, str] = {}
    for kw, args in dockerfile_instructions(path):
        if kw == "ENV":
            for match in re.finditer(r'(\w+)=("[^"]*"|\S*)', args):
                env[match.group(1)] = match.group(2).strip('"')
    return env


def test_gpu_dockerfile_extends_the_pinned_vllm_image():
    instructions = dockerfile_instructions(ROOT / "Dockerfile")
    # BASE_IMAGE defaults to vLLM's image; tests/test_images.py sets a stand-in.
    assert instructions[0] == ("ARG", f"BASE_IMAGE={VLLM_BASE_IMAGE}")
    assert [args for kw, args in instructions if kw == "FROM"] == ["${BASE_IMAGE}"]
    run_lines = " ".join(args for kw, args in instructions if kw == "RUN")
    assert "pip install" in run_lines and "/opt/vllm-kvevict" in run_lines
    assert "-c /tmp/base-image.txt" in run_lines  # vLLM and torch stay as shipped


def test_cpu_dockerfile_serves_the_embedded_model():
    from vllm_kvevict.default_model import DEFAULT_MODEL_NAME

    instructions = dockerfile_instructions(ROOT / "Dockerfile.cpu")
    # A base that scripts/build_images.sh makes locally with debootstrap.
    assert [args for kw, args in instructions if kw == "FROM"] == ["debian:bookworm-slim"]
    run_lines = " ".join(args for kw, args in instructions if kw == "RUN")
    assert '"/opt/vllm-kvevict[cpu,model]"' in run_lines and "test]" not in run_lines
    assert "kvevict setup-cpu" in run_lines and "kvevict fetch-model" in run_lines
    assert re.search(r"\bg\+\+", run_lines)  # the C++ kernel is built
    env = dockerfile_env(ROOT / "Dockerfile.cpu")
    assert env["MODEL"] == f"{env['KVEVICT_CACHE_DIR']}/models/{DEFAULT_MODEL_NAME}"
    # The model and kernel are made by the serving user, not root.
    users = [args for kw, args in instructions if kw == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    fetch = next(i for i, (kw, args) in enumerate(instructions) if "fetch-model" in args)
    assert [i for i, (kw, _) in enumerate(instructions) if kw == "USER"][-1] < fetch


# --------------------------------------------------------------------------- entry point

@pytest.fixture
def fake_vllm(tmp_path):
    """A `vllm` on PATH that records its PID and arguments."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    script = bin_dir / "vllm"
    script.write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'pid': os.getpid(), 'argv': sys.argv[1:]}}, open({str(record)!r}, 'w'))\n"
    )
    script.chmod(0o755)

    def launch(*args: str, **env: str) -> list[str]:
        environ = {"PATH": f"{bin_dir}:/usr/bin:/bin", "KVEVICT_CONFIG_DIR": str(ROOT / "configs")}
        environ.update(env)
        proc = subprocess.Popen(["/bin/sh", str(ENTRYPOINT), *args], env=environ)
        assert proc.wait(timeout=30) == 0
        result = json.loads(record.read_text())
        # exec: vllm replaced the shell, so it is the process docker signals.
        assert result["pid"] == proc.pid
        return result["argv"]

    return launch


def test_entrypoint_passes_policy_and_config_from_the_environment(fake_vllm):
    text = ENTRYPOINT.read_text()
    assert '--kv-eviction "$KV_EVICTION"' in text and 'exec vllm serve "$@"' in text
    argv = fake_vllm(MODEL="org/model", KV_EVICTION="snapkv")
    assert argv == ["serve", "org/model", "--kv-eviction", "snapkv", "--kv-eviction-config",
                    str(ROOT / "configs" / "snapkv.yaml"), "--host", "0.0.0.0", "--port", "8000"]
    # The default config follows the policy.
    argv = fake_vllm(MODEL="m", KV_EVICTION="streamingllm")
    assert argv[2:6] == ["--kv-eviction", "streamingllm", "--kv-eviction-config",
                         str(ROOT / "configs" / "streamingllm.yaml")]


def test_entrypoint_explicit_config_extra_args_and_container_args(fake_vllm):
    argv = fake_vllm("--max-model-len", "4096", MODEL="m", KV_EVICTION="snapkv",
                     KV_EVICTION_CONFIG='{"budget": 256}', EXTRA_ARGS="--dtype bfloat16  --port 9000")
    assert argv == ["serve", "m", "--kv-eviction", "snapkv", "--kv-eviction-config",
                    '{"budget": 256}', "--host", "0.0.0.0", "--port", "8000",
                    "--dtype", "bfloat16", "--port", "9000", "--max-model-len", "4096"]
    # Empty config: the plugin's defaults; a first argument that is not an
    # option names the model, as with vLLM's own image.
    argv = fake_vllm("org/model", "--enforce-eager", KV_EVICTION="snapkv", KV_EVICTION_CONFIG="")
    assert argv == ["serve", "org/model", "--kv-eviction", "snapkv", "--host", "0.0.0.0",
                    "--port", "8000", "--enforce-eager"]
    # EXTRA_ARGS is split on spaces but never globbed.
    assert fake_vllm(MODEL="m", KV_EVICTION="none", EXTRA_ARGS="--x *")[-2:] == ["--x", "*"]


def test_entrypoint_without_eviction(fake_vllm):
    assert fake_vllm(MODEL="m", KV_EVICTION="none") == [
        "serve", "m", "--host", "0.0.0.0", "--port", "8000"]


# --------------------------------------------------------------------------- Prometheus

def test_promtool_checks_the_scrape_config():
    proc = run(tool("promtool"), "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml"))
    assert "SUCCESS" in proc.stdout + proc.stderr
    config = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert [t.rsplit(":", 1)[1] for c in job["static_configs"] for t in c["targets"]] == ["8000"]


def test_alert_rules_fire_on_their_synthetic_series_and_only_there(tmp_path):
    """promtool's rule tests (deploy/prometheus/kvevict-alerts.test.yml): each
    alert fires on the series it is about, after its hold time, with its
    annotations as written, and not on the series beside it. The harness
    fails a rule that no longer fires: the fallback alert's threshold raised."""
    promtool = tool("promtool")
    rules_dir = DEPLOY / "prometheus"
    proc = run(promtool, "test", "rules", str(rules_dir / "kvevict-alerts.test.yml"), check=False)
    assert proc.returncode == 0 and "SUCCESS" in proc.stdout, proc.stdout + proc.stderr
    rules = yaml.safe_load((rules_dir / "kvevict-alerts.yml").read_text())
    names = [r.get("alert") for r in rules["groups"][0]["rules"] if "alert" in r]
    tested = {t["alertname"] for case in yaml.safe_load(
        (rules_dir / "kvevict-alerts.test.yml").read_text())["tests"] for t in case.get("alert_rule_test", [])}
    assert set(names) == tested, (names, tested)
    broken = (rules_dir / "kvevict-alerts.yml").read_text().replace(
        "(increase(kvevict_eviction_fallbacks_total[10m])) > 0", "(increase(kvevict_eviction_fallbacks_total[10m])) > 5")
    assert broken != (rules_dir / "kvevict-alerts.yml").read_text()
    (tmp_path / "kvevict-alerts.yml").write_text(broken)
    shutil.copy(rules_dir / "kvevict-alerts.test.yml", tmp_path / "kvevict-alerts.test.yml")
    assert run(promtool, "test", "rules", str(tmp_path / "kvevict-alerts.test.yml"), check=False).returncode != 0


def test_every_dashboard_query_parses_with_promtool(tmp_path):
    promtool = tool("promtool")
    queries = dashboard_queries()
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"dashboard:query_{i}", "expr": expr} for i, (_, expr) in enumerate(queries)]}]}
    rules_file = tmp_path / "rules.yml"
    rules_file.write_text(yaml.safe_dump(rules))
    proc = run(promtool, "check", "rules", str(rules_file), check=False)
    assert proc.returncode == 0, "\n".join(
        [proc.stdout, proc.stderr] + [f"query_{i}: {w}: {e}" for i, (w, e) in enumerate(queries)])
    assert f"SUCCESS: {len(queries)} rules found" in proc.stdout
    # The harness catches a broken query.
    rules["groups"][0]["rules"] = [{"record": "broken", "expr": "rate(vllm:x[1m]"}]
    rules_file.write_text(yaml.safe_dump(rules))
    assert run(promtool, "check", "rules", str(rules_file), check=False).returncode != 0


# --------------------------------------------------------------------------- Grafana

DS_REF = {"type": "object", "required": ["type", "uid"], "properties": {
    "type": {"const": "prometheus"}, "uid": {"const": "${DS_PROMETHEUS}"}}}
GRID_POS = {"type": "object", "required": ["h", "w", "x", "y"], "properties": {
    "h": {"type": "integer", "minimum": 1}, "w": {"type": "integer", "minimum": 1, "maximum": 24},
    "x": {"type": "integer", "minimum": 0, "maximum": 23}, "y": {"type": "integer", "minimum": 0}}}
DASHBOARD_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating", "time", "__inputs"],
    "properties": {
        "title": {"type": "string", "minLength": 1},
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 39},
        "__inputs": {"type": "array", "contains": {"type": "object", "required": ["name", "type", "pluginId"],
                     "properties": {"name": {"const": "DS_PROMETHEUS"}, "type": {"const": "datasource"},
                                    "pluginId": {"const": "prometheus"}}}},
        "time": {"type": "object", "required": ["from", "to"]},
        "templating": {"type": "object", "required": ["list"], "properties": {"list": {
            "type": "array",
            "items": {"type": "object", "required": ["name", "type"], "if": {
                "properties": {"type": {"const": "query"}}}, "then": {
                "required": ["datasource", "definition", "query"],
                "properties": {"datasource": DS_REF}}},
            "allOf": [{"contains": {"type": "object", "properties": {
                "name": {"const": name}, "type": {"const": kind}}, "required": ["name", "type"]}}
                for name, kind in (("DS_PROMETHEUS", "datasource"), ("model_name", "query"),
                                   ("engine", "query"))]}}},
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["id", "type", "title", "gridPos"],
            "properties": {"id": {"type": "integer", "minimum": 1}, "type": {"type": "string"},
                           "title": {"type": "string", "minLength": 1}, "gridPos": GRID_POS},
            "if": {"properties": {"type": {"const": "row"}}},
            "then": {"properties": {"panels": {"type": "array"}}},
            "else": {"required": ["datasource", "targets", "fieldConfig", "options"], "properties": {
                "type": {"enum": ["timeseries", "heatmap", "stat", "gauge", "bargauge", "table"]},
                "datasource": DS_REF,
                "targets": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["refId", "expr", "datasource"],
                    "properties": {"refId": {"type": "string", "pattern": "^[A-Z]$"},
                                   "expr": {"type": "string", "minLength": 1},
                                   "datasource": DS_REF}}}}}}},
    },
}


def test_dashboard_matches_the_grafana_schema():
    jsonschema = module("jsonschema")
    data = dashboard()
    jsonschema.Draft202012Validator.check_schema(DASHBOARD_SCHEMA)
    errors = sorted(jsonschema.Draft202012Validator(DASHBOARD_SCHEMA).iter_errors(data), key=str)
    assert not errors, "\n".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)

    ids = [p["id"] for p in data["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    cells: dict[tuple[int, int], str] = {}
    for panel in data["panels"]:
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, f"{panel['title']} runs past the 24 grid columns"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{panel['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = panel["title"]
        for target in panel.get("targets", []):
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs))
            # Every query follows the model and engine selectors.
            assert 'model_name=~"$model_name"' in target["expr"], target["expr"]
            assert 'engine=~"$engine"' in target["expr"], target["expr"]
    heatmaps = [p for p in data["panels"] if p["type"] == "heatmap"]
    assert heatmaps and all(t.get("format") == "heatmap" for p in heatmaps for t in p["targets"])
    # Nothing names a concrete datasource: imports pick one through DS_PROMETHEUS.
    assert set(re.findall(r'"uid":\s*"([^"]*)"', DASHBOARD.read_text())) <= {
        "${DS_PROMETHEUS}", "-- Grafana --", "vllm-kvevict"}


PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and",
                "or", "unless", "offset", "inf", "nan", "atan2"}


def metric_names(expr: str) -> set[str]:
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # range selectors
    text = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text)
    names = set()
    for match in re.finditer(r"(?<![\w.:])[a-zA-Z_:][\w:]*", text):
        if text[match.end():].lstrip().startswith("("):  # a function or aggregation
            continue
        if match.group(0).lower() not in PROMQL_WORDS:
            names.add(match.group(0))
    return names


def test_metric_name_extraction():
    assert metric_names(
        'histogram_quantile(0.95, sum by (le, engine) (rate(a_bucket{x=~"$v", y="b c"}[1m]))) '
        "/ on (engine) group_left vllm:b_total offset 5m > bool 1e3"
    ) == {"a_bucket", "vllm:b_total"}


def test_dashboard_uses_only_exported_metrics():
    try:
        from vllm_kvevict.metrics import METRIC_NAMES as exported
    except ImportError:
        exported = LOCAL_METRIC_NAMES
    exported = set(exported)
    used = set().union(*(metric_names(expr) for _, expr in dashboard_queries()))
    unknown = {n for n in used if not n.startswith("vllm:") and n not in exported}
    assert not unknown, f"the dashboard reads series nobody exports: {sorted(unknown)}"
    assert REQUIRED_DASHBOARD_METRICS <= used, sorted(REQUIRED_DASHBOARD_METRICS - used)
    assert {n for n in REQUIRED_DASHBOARD_METRICS if n.startswith("kvevict_")} <= exported


# --------------------------------------------------------------------------- Kubernetes

SERVICEMONITOR_SCHEMA = {  # monitoring.coreos.com/v1, the fields this repository may use
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}}}},
        "spec": {"type": "object", "required": ["selector", "endpoints"], "additionalProperties": False,
                 "properties": {
            "selector": {"type": "object", "additionalProperties": False, "properties": {
                "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                "matchExpressions": {"type": "array"}}},
            "namespaceSelector": {"type": "object", "additionalProperties": False, "properties": {
                "any": {"type": "boolean"}, "matchNames": {"type": "array", "items": {"type": "string"}}}},
            "jobLabel": {"type": "string"}, "targetLabels": {"type": "array"},
            "podTargetLabels": {"type": "array"}, "sampleLimit": {"type": "integer"},
            "endpoints": {"type": "array", "minItems": 1, "items": {
                "type": "object", "additionalProperties": False, "properties": {
                    "port": {"type": "string"}, "targetPort": {"type": ["integer", "string"]},
                    "path": {"type": "string", "pattern": "^/"},
                    "scheme": {"enum": ["http", "https"]},
                    "interval": {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"},
                    "scrapeTimeout": {"type": "string", "pattern": r"^(0|([0-9]+(ms|s|m|h|d|w|y))+)$"},
                    "honorLabels": {"type": "boolean"}, "honorTimestamps": {"type": "boolean"},
                    "relabelings": {"type": "array"}, "metricRelabelings": {"type": "array"},
                    "params": {"type": "object"}, "tlsConfig": {"type": "object"},
                    "authorization": {"type": "object"}, "followRedirects": {"type": "boolean"},
                    "enableHttp2": {"type": "boolean"}, "filterRunning": {"type": "boolean"}}}}}},
    },
}


def validate_k8s(docs: list[dict], where: str) -> None:
    """Built-in kinds against Kubernetes' schemas (strict: unknown fields fail),
    ServiceMonitor against SERVICEMONITOR_SCHEMA; any other kind fails."""
    kubernetes_validate = module("kubernetes_validate")
    jsonschema = module("jsonschema")
    for doc in docs:
        name = f"{where}: {doc.get('kind')}/{doc.get('metadata', {}).get('name')}"
        if doc.get("kind") == "ServiceMonitor":
            errors = list(jsonschema.Draft202012Validator(SERVICEMONITOR_SCHEMA).iter_errors(doc))
            assert not errors, f"{name}: " + "; ".join(e.message for e in errors)
            continue
        try:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            pytest.fail(f"{name}: {error.message} at {list(error.path)}")


def manifests() -> dict[str, list[dict]]:
    return {p.name: load_docs(p.read_text()) for p in sorted(K8S.glob("*.yaml"))
            if p.name != "kustomization.yaml"}


def test_kubernetes_manifests_validate_against_the_schemas():
    files = manifests()
    for name, docs in files.items():
        validate_k8s(docs, name)
    # The harness rejects what the API server would: an unknown field.
    broken = json.loads(json.dumps(files["deployment.yaml"][0]))
    broken["spec"]["template"]["spec"]["containers"][0]["livenessProbes"] = {}
    with pytest.raises(pytest.fail.Exception):
        validate_k8s([broken], "broken")


def test_kustomize_builds_every_manifest():
    kubectl = tool("kubectl")
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert sorted(kustomization["resources"]) == sorted(manifests())
    rendered = load_docs(run(kubectl, "kustomize", str(K8S)).stdout)
    assert sorted(d["kind"] for d in rendered) == ["ConfigMap", "Deployment", "Service", "ServiceMonitor"]
    validate_k8s(rendered, "kubectl kustomize")


def test_configmap_holds_the_repository_configs():
    (configmap,) = manifests()["configmap.yaml"]
    assert configmap["data"]["snapkv.yaml"] == (ROOT / "configs" / "snapkv.yaml").read_text()
    assert configmap["data"]["streamingllm.yaml"] == (ROOT / "configs" / "streamingllm.yaml").read_text()


def test_deployment_service_and_monitor_fit_together():
    files = manifests()
    (deployment,) = files["deployment.yaml"]
    (service,) = files["service.yaml"]
    (monitor,) = files["servicemonitor.yaml"]
    (configmap,) = files["configmap.yaml"]
    pod = deployment["spec"]["template"]
    (container,) = pod["spec"]["containers"]

    assert container["image"] == f"vllm-kvevict:{VERSION}"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": 8000}
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
        assert ports.get(container[probe]["httpGet"]["port"]) == 8000
    annotations = pod["metadata"]["annotations"]
    assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": "8000",
                           "prometheus.io/path": "/metrics"}

    env = {e["name"]: e.get("value") for e in container["env"]}
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "kv-eviction-config"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "kv-eviction-config"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    assert env["KV_EVICTION_CONFIG"] == f"{mount['mountPath']}/$(KV_EVICTION).yaml"
    # Eviction is off on the GPU; the policies the comment offers have their
    # file in the ConfigMap.
    assert env["KV_EVICTION"] == "none"
    offered = commented_policies(K8S / "deployment.yaml")
    assert offered and all(f"{policy}.yaml" in configmap["data"] for policy in offered)
    assert env["MODEL"]

    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    (service_port,) = service["spec"]["ports"]
    assert service_port["port"] == 8000 and service_port["targetPort"] == "http"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert [e["port"] for e in monitor["spec"]["endpoints"]] == [service_port["name"]]
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def commented_policies(path: Path) -> list[str]:
    """The policies a manifest's comments offer for KV_EVICTION (`value: snapkv
    (or streamingllm)`)."""
    text = path.read_text()
    (line,) = re.findall(r"#\s+value: (\w+)(?:\s+\(or (\w+)\))?", text)
    return [p for p in line if p]


def rendered_container(docs: list[dict]) -> dict:
    (deployment,) = [d for d in docs if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def kubernetes_env(container: dict) -> dict[str, str]:
    """The container's environment as the kubelet sets it: $(VAR) refers to an
    earlier entry (Kubernetes' dependent environment variables)."""
    env: dict[str, str] = {}
    for entry in container.get("env", []):
        if "value" in entry:
            env[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env.get(m.group(1), m.group(0)),
                                        entry["value"])
    return env


def test_rendered_deployment_runs_plain_vllm_on_the_gpu(fake_vllm):
    """`kubectl kustomize` output, run through the image's entry point with the
    pod's environment (the image's ENV first, the manifest's over it): the
    exact command the pod runs."""
    kubectl = tool("kubectl")
    container = rendered_container(load_docs(run(kubectl, "kustomize", str(K8S)).stdout))
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1  # CUDA
    assert "command" not in container and "args" not in container  # the image's entry point
    env = {**dockerfile_env(ROOT / "Dockerfile"), **kubernetes_env(container)}
    argv = fake_vllm(**env)
    assert argv == ["serve", env["MODEL"], "--host", "0.0.0.0", "--port", "8000",
                    *env["EXTRA_ARGS"].split()]
    assert not [a for a in argv if a.startswith("--kv-eviction")]
    # The image alone (docker run IMAGE MODEL) serves without eviction as well.
    assert fake_vllm("org/model", **dockerfile_env(ROOT / "Dockerfile")) == [
        "serve", "org/model", "--host", "0.0.0.0", "--port", "8000"]
    # The commented setting turns eviction on with the ConfigMap's file.
    (policy, *_) = commented_policies(K8S / "deployment.yaml")
    argv = fake_vllm(**{**env, **kubernetes_env({"env": [
        {"name": e["name"], "value": policy if e["name"] == "KV_EVICTION" else e["value"]}
        for e in container["env"] if "value" in e]})})
    assert argv[2:6] == ["--kv-eviction", policy, "--kv-eviction-config", f"/etc/vllm-kvevict/{policy}.yaml"]


# --------------------------------------------------------------------------- Helm

PRODUCTION_STACK_SCHEMA = {  # vllm-stack chart values used here; typos in these blocks fail
    "type": "object",
    "required": ["servingEngineSpec"],
    "properties": {"servingEngineSpec": {"type": "object", "required": ["modelSpec"], "properties": {
        "imagePullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
        "modelSpec": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["name", "repository", "tag", "modelURL", "replicaCount", "vllmConfig"],
            "additionalProperties": False,
            "properties": {
                **{k: {"type": "string"} for k in (
                    "name", "repository", "tag", "modelURL", "requestMemory", "limitMemory",
                    "pvcStorage", "storageClass", "shmSize", "runtimeClassName", "chatTemplate",
                    "imagePullSecret", "serviceAccountName", "priorityClassName", "modelRevision")},
                **{k: {"type": "integer"} for k in ("replicaCount", "requestCPU")},
                "requestGPU": {"type": ["integer", "number", "string"]},
                **{k: {"type": "array"} for k in (
                    "env", "extraVolumes", "extraVolumeMounts", "tolerations", "nodeSelectorTerms")},
                **{k: {"type": "object"} for k in (
                    "annotations", "podAnnotations", "labels", "podLabels", "affinity",
                    "resources", "lmcacheConfig", "keda", "envFromSecret")},
                "hf_token": {"type": ["string", "object"]},
                "enableLoRA": {"type": "boolean"},
                "vllmConfig": {"type": "object", "additionalProperties": False, "properties": {
                    "enableChunkedPrefill": {"type": "boolean"},
                    "enablePrefixCaching": {"type": "boolean"},
                    "maxModelLen": {"type": "integer"}, "maxNumSeqs": {"type": "integer"},
                    "tensorParallelSize": {"type": "integer"}, "dtype": {"type": "string"},
                    "gpuMemoryUtilization": {"type": ["integer", "number", "string"]},
                    "extraArgs": {"type": "array", "items": {"type": "string"}}}}}}}}}},
}


def eviction_args(args: list[str]) -> tuple[str, str]:
    policy = args[args.index("--kv-eviction") + 1]
    config = args[args.index("--kv-eviction-config") + 1]
    return policy, config


def commented_list(path: Path, after: str) -> list[str]:
    """The YAML list items commented out right after the line `after` (how a
    values file shows the arguments that turn eviction on)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == after)
    items = []
    for line in lines[start + 1:]:
        match = re.fullmatch(r"\s*#\s+- (.+)", line)
        if not match:
            break
        items.append(match.group(1))
    return items


def check_image_config_path(path: str) -> None:
    assert path.startswith(IMAGE_CONFIG_DIR + "/"), path
    assert (ROOT / "configs" / path[len(IMAGE_CONFIG_DIR) + 1:]).is_file(), path


def test_production_stack_values_carry_eviction():
    jsonschema = module("jsonschema")
    values = yaml.safe_load((DEPLOY / "helm" / "production-stack-values.yaml").read_text())
    errors = list(jsonschema.Draft202012Validator(PRODUCTION_STACK_SCHEMA).iter_errors(values))
    assert not errors, "; ".join(f"{list(e.absolute_path)}: {e.message}" for e in errors)
    for spec in values["servingEngineSpec"]["modelSpec"]:
        assert (spec["repository"], spec["tag"]) == ("vllm-kvevict", VERSION)
        assert spec["vllmConfig"]["enablePrefixCaching"] is False
        # The chart's engine command is `vllm serve MODEL_URL ... EXTRA_ARGS`:
        # on the GPU without eviction.
        assert not [a for a in spec["vllmConfig"]["extraArgs"] if a.startswith("--kv-eviction")]
    # The commented arguments turn it on with a file in the image.
    offered = commented_list(DEPLOY / "helm" / "production-stack-values.yaml", "# extraArgs:")
    policy, config = eviction_args(offered)
    assert policy in ("snapkv", "streamingllm") and config.endswith(f"/{policy}.yaml")
    check_image_config_path(config)


def test_generic_values_render_with_a_standard_chart(tmp_path):
    helm = tool("helm")
    values_file = DEPLOY / "helm" / "generic-values.yaml"
    values = yaml.safe_load(values_file.read_text())
    assert values["command"] == ["vllm", "serve"]
    offered = commented_list(values_file, "# Eviction on (a config file baked into the image from configs/):")
    policy, config = eviction_args(offered)
    assert policy in ("snapkv", "streamingllm") and config.endswith(f"/{policy}.yaml")
    check_image_config_path(config)

    # `helm create`'s chart plus the two lines the values file asks for.
    run(helm, "create", "chart", cwd=tmp_path)
    template = tmp_path / "chart" / "templates" / "deployment.yaml"
    text = template.read_text()
    anchor = "          imagePullPolicy: {{ .Values.image.pullPolicy }}\n"
    assert anchor in text
    template.write_text(text.replace(anchor, anchor + (
        "          command: {{- toYaml .Values.command | nindent 12 }}\n"
        "          args: {{- toYaml .Values.args | nindent 12 }}\n")))
    rendered = load_docs(run(helm, "template", "kvevict", str(tmp_path / "chart"),
                             "-f", str(values_file)).stdout)
    validate_k8s(rendered, "helm template")
    (deployment,) = [d for d in rendered if d["kind"] == "Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"vllm-kvevict:{VERSION}"
    assert container["command"] + container["args"] == ["vllm", "serve", *values["args"]]
    # What the GPU pod runs: plain vLLM, no eviction flag.
    assert container["args"] == ["HuggingFaceTB/SmolLM2-1.7B-Instruct", "--host", "0.0.0.0",
                                 "--port", "8000", "--max-model-len", "8192"]
    assert container["ports"][0]["containerPort"] == 8000
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert container["livenessProbe"]["httpGet"]["path"] == "/health"
