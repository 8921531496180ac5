from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from helpers import (
    HEAD_PAGES_SERVER_CONFIG,
    SNAPKV_SERVER_CONFIG,
    VllmServer,
    eviction_server_args,
    worker_environment,
)

# Under pytest-xdist (the README's test command runs two workers) each worker
# binds the engines it starts to a core of its own, keeps torch to one thread
# and takes ports from a range of its own (helpers.worker_environment). Set
# before any test module imports torch; every process a test starts inherits it.
for _name, _value in worker_environment(
    os.environ.get("PYTEST_XDIST_WORKER", ""), sorted(os.sched_getaffinity(0))
).items():
    os.environ.setdefault(_name, _value)

# Every Python process the tests start imports tests/engine_site/sitecustomize.py:
# vLLM's engines poll their message queues with short sleeps instead of
# spinning, so an engine takes one core, not two, and does not take the other
# worker's.
_ENGINE_SITE = str(Path(__file__).parent / "engine_site")
os.environ["PYTHONPATH"] = os.pathsep.join(
    [_ENGINE_SITE, *(p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != _ENGINE_SITE)]
)

# Every engine this session starts (servers and offline LLMs inherit the
# environment) runs in the isolation debug mode: blocks returned to vLLM's pool
# are filled with NaN and attention outputs are checked for it.
os.environ.setdefault("KVEVICT_POISON_FREED_BLOCKS", "1")

SERVER_POOL_BLOCKS = 160  # 5120 tokens: fewer than 6 concurrent ~3k-token requests need

# Files whose first test waits minutes on a build (the images; a virtualenv
# from the wheel).
BUILDS = ("test_images.py", "test_packaging.py")
ENGINES = "engines"


@functools.cache
def starts_engines(path: Path) -> bool:
    """Whether the test file at ``path`` has tests marked e2e (read from its
    text: pytest-xdist's scheduler sees node ids, not markers); the builds
    are counted apart."""
    return path.name not in BUILDS and "pytest.mark.e2e" in path.read_text()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The run's order: the files that start engines, then BUILDS, then the
    rest; a file's tests stay together in their order. Under ``--dist
    loadfile --no-loadscope-reorder`` (the README's test command) the
    scheduler below hands out work in this order."""

    def rank(item: pytest.Item) -> int:
        if starts_engines(item.path):
            return 0
        if item.path.name in BUILDS:
            return 1 + BUILDS.index(item.path.name)
        return 1 + len(BUILDS)

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: nothing without it
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """``--dist loadfile`` with every file that starts engines in one unit of
    work: one pytest-xdist worker runs them from the start, one after another,
    sharing the session's servers, while the other runs the builds, then the
    rest, beside it (two engines at a time ran the suite barely faster on
    two cores). Other distributions are xdist's own."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class EnginesTogether(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return ENGINES if starts_engines(config.rootpath / path) else path

    return EnginesTogether(config, log)


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vllm_kvevict.default_model import fetch_default_model

    return str(fetch_default_model())


@pytest.fixture(scope="session")
def tokenizer(model_dir: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def _shared_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory, name: str, config: dict):
    """A `vllm serve` of the default model with ``config`` and the shared pool,
    ready, until the session ends (its log printed with KVEVICT_SHOW_SERVER_LOG)."""
    work = tmp_path_factory.mktemp(name)
    server = VllmServer(
        model_dir,
        eviction_server_args(config, SERVER_POOL_BLOCKS),
        stats_path=work / "stats.json",
        log_path=work / "server.log",
    )
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()
        if os.environ.get("KVEVICT_SHOW_SERVER_LOG"):
            print(Path(server.log_path).read_text())


@pytest.fixture(scope="session")
def snapkv_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """`vllm serve --kv-eviction snapkv` with budget 512, shared by the e2e tests."""
    yield from _shared_server(model_dir, tmp_path_factory, "snapkv_server", SNAPKV_SERVER_CONFIG)


@pytest.fixture(scope="session")
def head_pages_server(model_dir: str, tmp_path_factory: pytest.TempPathFactory):
    """`vllm serve` with per-(layer, KV head) page tables (AdaKV + SnapKV, the
    MomentKV correction), budget 512, shared by the e2e tests."""
    yield from _shared_server(model_dir, tmp_path_factory, "head_pages_server", HEAD_PAGES_SERVER_CONFIG)
