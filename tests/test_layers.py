"""The package's import layers, lowest first, and the two rules they keep: no
module imports one of a higher layer, and no modules import each other in a
circle.

Every ``.py`` file of the installed package is read with ``ast``; nothing is
imported. An import is any ``import`` or ``from ... import`` (at module level,
inside a function or under ``TYPE_CHECKING``; relative forms resolved), and
any string constant that names a module of the package (``importlib.
import_module`` targets and the tables that hold them, vLLM's qualified class
names). Only imports among the package's own modules count.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "vllm_kvevict"

# (name, what it is, its modules), lowest first. An entry "a.b" is that module
# alone; "a.b.*" is the package a.b and every module below it. A module
# belongs to the layer of its longest matching entry.
LAYERS: list[tuple[str, str, tuple[str, ...]]] = [
    ("foundation", "MomentKV's statistics of evicted tokens, and where files live: nothing of the package",
     ("vllm_kvevict.moments", "vllm_kvevict.paths")),
    ("kernels", "Triton kernels over the retained pages, each beside its torch twin, and the C++ sources",
     ("vllm_kvevict.triton_kernels.*", "vllm_kvevict.csrc.*")),
    ("cpu ops", "the C++ extension's build and its torch fallbacks, and top-k selection (torch or C++)",
     ("vllm_kvevict.cpu_ops", "vllm_kvevict.top_k")),
    ("policies", "scorers: each policy's score() is its paper's equation; tensors in, scores out",
     ("vllm_kvevict.policies.*",)),
    ("engine", "which tokens a request keeps (allocation, selection) and where they go, and when; no vLLM",
     ("vllm_kvevict.eviction.*", "vllm_kvevict.schedule")),
    ("config", "the validated eviction settings, a request's own settings and the Prometheus metrics",
     ("vllm_kvevict.config", "vllm_kvevict.request_settings", "vllm_kvevict.metrics")),
    ("plugin", "what plugs eviction into vLLM: registration, spec and manager, backends, hooks",
     ("vllm_kvevict", "vllm_kvevict.backend_name", "vllm_kvevict.plugin.*")),
    ("tools", "beside serving: the reference decoder, evaluation, gate training, the default model, CPU setup",
     ("vllm_kvevict.reference.*", "vllm_kvevict.evaluation.*", "vllm_kvevict.training.*",
      "vllm_kvevict.default_model", "vllm_kvevict.setup_cpu", "vllm_kvevict.help_format")),
    ("command", "the kvevict command, which runs the tools",
     ("vllm_kvevict.cli",)),
]

# Inside the plugin, one folder per vLLM process: a folder imports nothing
# from another process's folder (what two processes share lies beside the
# folders: compat, kv_spec, snapshot, gate_models, vllm_fixes). The attention
# backends run in the worker process, so they may use the worker's modules.
PROCESSES: dict[str, str] = {
    "frontend": "vllm_kvevict.plugin.frontend",
    "scheduler": "vllm_kvevict.plugin.scheduler",
    "worker": "vllm_kvevict.plugin.worker",
    "backends": "vllm_kvevict.plugin.backends",
}
SAME_PROCESS = {("backends", "worker")}

# Modules the walk must find: a layout it cannot read fails here instead of
# passing with nothing to check.
EXPECTED = ("vllm_kvevict.triton_kernels.batch", "vllm_kvevict.cpu_ops", "vllm_kvevict.policies.base",
            "vllm_kvevict.eviction.select", "vllm_kvevict.plugin.backends.step_plan", "vllm_kvevict.plugin.backends.evicting_impl", "vllm_kvevict.cli")


@dataclass(frozen=True)
class Import:
    source: str  # the importing module
    target: str  # the imported module
    path: str  # the importing file, from the package's parent folder
    line: int

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def package_modules(root: Path, package: str) -> dict[str, Path]:
    """Dotted name -> file of every module under the package folder ``root``."""
    modules: dict[str, Path] = {}
    for path in sorted(root.rglob("*.py")):
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        if all(part.isidentifier() for part in parts):
            modules[".".join(parts)] = path
    return modules


def _in_package(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _named_module(text: str, package: str, modules: dict[str, Path]) -> str | None:
    """The module a string names (``"a.b.c"``, ``"a.b:attr"``, ``"a.b.Class"``), or None."""
    name = text.split(":", 1)[0]
    if name == package:
        return package
    parts = name.split(".")
    # The package alone is named only as itself: "pkg.data" is a data folder,
    # not an attribute of the package.
    for end in range(len(parts), 1, -1):
        if ".".join(parts[:end]) in modules:
            return ".".join(parts[:end])
    return None


def imports_of(module: str, path: Path, package: str, modules: dict[str, Path], base: Path) -> tuple[list[Import], list[str]]:
    """The package modules ``module`` imports, and the imports of package
    modules that do not exist (``file:line: name``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    shown = path.relative_to(base).as_posix()
    here = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []
    missing: list[str] = []
    name_pattern = re.compile(rf"^{re.escape(package)}(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?$")

    def add(target: str, line: int) -> None:
        if target in modules:
            found.append(Import(module, target, shown, line))
        else:
            missing.append(f"{shown}:{line}: {target}")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _in_package(alias.name, package):
                    add(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                origin = ".".join(anchor + ([node.module] if node.module else []))
            else:
                origin = node.module or ""
            if not _in_package(origin, package):
                continue
            for alias in node.names:
                submodule = f"{origin}.{alias.name}"
                add(submodule if submodule in modules else origin, node.lineno)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and name_pattern.match(node.value):
            target = _named_module(node.value, package, modules)
            if target is not None:
                found.append(Import(module, target, shown, node.lineno))
    unique = dict.fromkeys(edge for edge in found if edge.target != module)  # one per line and target
    return list(unique), missing


def layer_of(module: str, layers: Sequence[tuple[str, str, tuple[str, ...]]]) -> int | None:
    """Index of the layer whose longest entry matches ``module``, or None."""
    best: tuple[int, int] | None = None  # (entry length, layer)
    for index, (_, _, entries) in enumerate(layers):
        for entry in entries:
            name = entry.removesuffix(".*")
            matches = module == name or (entry.endswith(".*") and module.startswith(name + "."))
            if matches and (best is None or len(name) > best[0]):
                best = (len(name), index)
    return None if best is None else best[1]


def circles(edges: Iterable[Import]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.source, set()).add(edge.target)
        graph.setdefault(edge.target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(found)


def layer_problems(root: Path, package: str, layers: Sequence[tuple[str, str, tuple[str, ...]]]) -> list[str]:
    """Every breach of the layer rules in the package folder ``root``, one line each."""
    modules = package_modules(root, package)
    problems: list[str] = []
    edges: list[Import] = []
    for module, path in modules.items():
        found, missing = imports_of(module, path, package, modules, root.parent)
        edges += found
        problems += [f"{text}: imports a module the package does not have" for text in missing]
    names = [name for name, _, _ in layers]
    placed = {module: layer_of(module, layers) for module in modules}
    problems += [f"{module}: in no layer; add it to LAYERS" for module, at in placed.items() if at is None]
    for index, (name, _, _) in enumerate(layers):
        if index not in placed.values():
            problems.append(f"layer {name!r} holds no module")
    for edge in sorted(edges, key=lambda e: (e.path, e.line)):
        source, target = placed[edge.source], placed[edge.target]
        if source is not None and target is not None and target > source:
            problems.append(
                f"{edge.where()}: {edge.source} ({names[source]}) imports {edge.target} "
                f"({names[target]}), a higher layer"
            )
    for component in circles(edges):
        inside = sorted((e for e in edges if e.source in component and e.target in component),
                        key=lambda e: (e.path, e.line))
        problems.append(
            "import circle among " + ", ".join(component) + ": "
            + "; ".join(f"{e.where()}: {e.source} -> {e.target}" for e in inside)
        )
    return problems


def process_problems(root: Path, package: str, processes: dict[str, str],
                     same_process: set[tuple[str, str]]) -> list[str]:
    """Every import from one process's folder into another's, one line each."""
    modules = package_modules(root, package)

    def process_of(module: str) -> str | None:
        return next((name for name, top in processes.items()
                     if module == top or module.startswith(top + ".")), None)

    problems = []
    for module, path in modules.items():
        source = process_of(module)
        if source is None:
            continue
        for edge in imports_of(module, path, package, modules, root.parent)[0]:
            target = process_of(edge.target)
            if target not in (None, source) and (source, target) not in same_process:
                problems.append(f"{edge.where()}: {edge.source} ({source}) imports {edge.target} "
                                f"({target}), another process's")
    return sorted(problems)


def installed_root() -> Path:
    spec = importlib.util.find_spec(PACKAGE)
    assert spec is not None and spec.submodule_search_locations, f"{PACKAGE} is not installed"
    return Path(list(spec.submodule_search_locations)[0])


def test_package_keeps_its_layers():
    root = installed_root()
    modules = package_modules(root, PACKAGE)
    assert set(EXPECTED) <= set(modules), f"not found under {root}: {sorted(set(EXPECTED) - set(modules))}"
    problems = layer_problems(root, PACKAGE, LAYERS)
    assert not problems, "\n".join(problems)


def test_plugin_keeps_each_process_apart():
    root = installed_root()
    modules = package_modules(root, PACKAGE)
    for top in PROCESSES.values():
        assert any(m.startswith(top + ".") for m in modules), f"{top}: no module found under {root}"
    problems = process_problems(root, PACKAGE, PROCESSES, SAME_PROCESS)
    assert not problems, "\n".join(problems)


def test_reports_imports_across_processes(tmp_path):
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "", "shared.py": "",
        "front/__init__.py": "", "front/a.py": "from pkg.shared import x\nfrom pkg.work import b\n",
        "work/__init__.py": "", "work/b.py": "import pkg.shared\n",
        "impl/__init__.py": "", "impl/c.py": "from pkg.work.b import y\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    processes = {"front": "pkg.front", "work": "pkg.work", "impl": "pkg.impl"}

    assert process_problems(root, "pkg", processes, {("impl", "work")}) == [
        "pkg/front/a.py:2: pkg.front.a (front) imports pkg.work.b (work), another process's",
    ]
    assert process_problems(root, "pkg", processes, set()) == [
        "pkg/front/a.py:2: pkg.front.a (front) imports pkg.work.b (work), another process's",
        "pkg/impl/c.py:1: pkg.impl.c (impl) imports pkg.work.b (work), another process's",
    ]


def test_reports_circles_and_upward_imports(tmp_path):
    root = tmp_path / "pkg"
    files = {
        "__init__.py": "",
        "low.py": "import os\n\n\ndef later():\n    from pkg.high import thing\n    return thing\n",
        "high.py": "from . import low\nthing = 1\n",
        "ring/__init__.py": "",
        "ring/a.py": "import importlib\n\nMODULE = importlib.import_module('pkg.ring.b')\n",
        "ring/b.py": "from .c import x\n",
        "ring/c.py": "from ..ring import a\nx = 1\n",
        "stale.py": "from pkg.gone import y\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    layers = [
        ("bottom", "low", ("pkg.low", "pkg.stale")),
        ("top", "high", ("pkg", "pkg.high", "pkg.ring.*")),
    ]

    problems = layer_problems(root, "pkg", layers)

    assert problems == [
        "pkg/stale.py:1: pkg.gone: imports a module the package does not have",
        "pkg/low.py:5: pkg.low (bottom) imports pkg.high (top), a higher layer",
        "import circle among pkg.high, pkg.low: "
        "pkg/high.py:1: pkg.high -> pkg.low; pkg/low.py:5: pkg.low -> pkg.high",
        "import circle among pkg.ring.a, pkg.ring.b, pkg.ring.c: "
        "pkg/ring/a.py:3: pkg.ring.a -> pkg.ring.b; pkg/ring/b.py:1: pkg.ring.b -> pkg.ring.c; "
        "pkg/ring/c.py:1: pkg.ring.c -> pkg.ring.a",
    ]


def test_layer_map_flags_modules_outside_it(tmp_path):
    root = tmp_path / "pkg"
    root.mkdir()
    (root / "__init__.py").write_text("")
    (root / "loose.py").write_text("")
    problems = layer_problems(root, "pkg", [("only", "the package", ("pkg",)), ("empty", "nothing", ("pkg.none",))])
    assert problems == ["pkg.loose: in no layer; add it to LAYERS", "layer 'empty' holds no module"]
