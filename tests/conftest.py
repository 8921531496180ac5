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

SERVER_POOL_BLOCKS = 160  # 5120 tokens: fewer than 6 concurrent ~1.5k-token requests need

# The run's order. Under `-n 2 --dist loadfile --no-loadscope-reorder`
# (tests/README.md) each file is one unit of work, handed to whichever worker
# is free, in this order: the longest first, so that the last
# files, short ones, even out the two workers' ends. The builds, then the files
# that start engines, then files without engines, each group the slowest first
# (tests/README.md has their times); files not named follow their group's named
# ones in collection order.
# The builds: images with buildah, the wheel in a fresh virtualenv.
BUILDS = ("test_images.py", "test_packaging.py")
SLOWEST_FIRST = BUILDS + (
    # engines
    "test_preemption.py",
    "test_policies_e2e.py",
    "test_prefix_caching.py",
    "test_aborts_isolation.py",
    "test_request_inputs.py",
    "test_triton_path_e2e.py",
    "test_tensor_parallel.py",
    "test_eval_bench_e2e.py",
    "test_learned_e2e.py",
    "test_e2e_offline.py",
    "test_e2e_serve.py",
    "test_per_request.py",
    "test_head_pages.py",
    "test_soak.py",
    "test_metrics.py",
    # no engine
    "test_cpu_ops_build.py",
    "test_cpu_head_paged_kernel.py",
    "test_plugin_gate.py",
    "test_triton_kernels.py",
    "test_ruler_eval.py",
    "test_retention_training.py",
)


@functools.cache
def starts_engines(path: Path) -> bool:
    """Whether the test file at ``path`` has tests marked e2e (read from its
    text, before its tests are collected)."""
    return "pytest.mark.e2e" in path.read_text()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The run's order (SLOWEST_FIRST); a file's tests stay together, in
    their order."""

    def rank(item: pytest.Item) -> tuple[int, int]:
        name = item.path.name
        group = 0 if name in BUILDS else 1 if starts_engines(item.path) else 2
        named = SLOWEST_FIRST.index(name) if name in SLOWEST_FIRST else len(SLOWEST_FIRST)
        return group, named

    items.sort(key=rank)


@pytest.fixture(scope="session")
def model_dir() -> str:
    from vllm_kvevict.default_model import fetch_default_model

    return str(fetch_default_model())


@pytest.fixture(scope="session")
def tiny_model_dir() -> str:
    """The tiny random Llama (4 layers, 4 KV heads, head_dim 32, the default
    model's tokenizer): vLLM's paths of the default model at a fraction of
    its compute, for tests whose claims do not depend on what the model
    knows (preemption, aborts, isolation: outputs equal to the same request
    run alone)."""
    from tiny_model import fetch_tiny_model

    return str(fetch_tiny_model())


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
