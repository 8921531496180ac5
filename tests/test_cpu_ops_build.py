"""Building and loading the C++ CPU kernel (``vllm_kvevict.cpu_ops.load_cpu_ops``):
the on-disk cache, builds killed half-way, a hung builder, another process
publishing first, a failed build, and a cache directory other users can write.

One real build (the module fixture, into a temporary cache); the other tests
load that build, or stand a copy of it in for the compiler's output. Loads
run in a thread joined with a generous timeout, so a load that waits forever
fails the test instead of hanging the run.
"""

from __future__ import annotations

import fcntl
import importlib.machinery
import importlib.util
import os
import shutil
import threading
import time
from pathlib import Path
from types import ModuleType

import pytest
import torch

from test_cpu_head_paged_kernel import check, make_case
from vllm_kvevict import cpu_ops

LOAD_TIMEOUT_S = 120  # a load without a compile that is not done by then hangs
BUILD_TIMEOUT_S = 900  # one real compile (~40 s alone; slower on a busy machine)
CACHE_ENV = "KVEVICT_CACHE_DIR"  # what vllm_kvevict.paths.cache_dir() honours


def reset_loader(monkeypatch: pytest.MonkeyPatch) -> None:
    """``load_cpu_ops()`` as in a fresh process (a fresh lock too: a load a
    failing test left hanging must not block the next one)."""
    monkeypatch.setattr(cpu_ops, "_lock", threading.Lock())
    monkeypatch.setattr(cpu_ops, "_loaded", False)
    monkeypatch.setattr(cpu_ops, "_module", None)
    monkeypatch.setattr(cpu_ops, "_status_reason", "the C++ kernel has not been loaded", raising=False)


def load_in_thread(timeout: float) -> ModuleType | None:
    """``load_cpu_ops()``, failing the test when it takes over ``timeout`` s."""
    result: dict[str, object] = {}

    def target() -> None:
        try:
            result["module"] = cpu_ops.load_cpu_ops()
        except BaseException as exc:  # reported below
            result["error"] = exc

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(timeout)
    assert not thread.is_alive(), f"load_cpu_ops() still waiting after {timeout} s"
    if "error" in result:
        raise result["error"]  # type: ignore[misc]
    return result["module"]  # type: ignore[return-value]


def import_so(path: Path) -> ModuleType:
    """Import a built extension's shared object (named after its module)."""
    loader = importlib.machinery.ExtensionFileLoader(path.stem, str(path))
    spec = importlib.util.spec_from_file_location(path.stem, str(path), loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


def stand_in_compiler(built_so: Path, calls: list[Path], before=None):
    """A ``cpp_extension.load`` that "compiles" by copying ``built_so`` (the
    real build) into the build directory and importing it; records each
    build directory in ``calls`` and runs ``before()`` first."""

    def load(*, build_directory: str, **kwargs) -> ModuleType:
        calls.append(Path(build_directory))
        if before is not None:
            before()
        target = Path(build_directory) / built_so.name
        shutil.copy2(built_so, target)
        return import_so(target)

    return load


def assert_serves_like_torch(module: ModuleType | None) -> None:
    """``module`` is what ``head_paged_attention`` dispatches to, and it
    answers like the torch path and the reference on a small random batch."""
    assert module is not None and cpu_ops.load_cpu_ops() is module
    case = make_case(
        11, queries=[1, 3], seq_lens=[40, 20], region_starts=[32, 0],
        head_lens=[[5, 20], [0, 16]], group=2, head_dim=64, page_size=16, summary="random",
    )
    out, lse = cpu_ops.head_paged_attention(*case.kernel_args(), native=True)
    ref_out, ref_lse = cpu_ops.head_paged_attention_torch(*case.kernel_args())
    torch.testing.assert_close(out, ref_out, atol=3e-5, rtol=3e-4)
    torch.testing.assert_close(lse, ref_lse, atol=3e-5, rtol=3e-5)
    check(case, out, lse)


def extensions_dir(cache: Path) -> Path:
    return cache / "torch_extensions"


def final_dir(monkeypatch: pytest.MonkeyPatch, cache: Path) -> Path:
    """The finished-build directory of the installed source under ``cache``."""
    monkeypatch.setenv(CACHE_ENV, str(cache))
    return cpu_ops._build_directory(cpu_ops._source_path())


def build_dirs(cache: Path) -> list[Path]:
    """Private build directories (finished or not) left in ``cache``."""
    return sorted(extensions_dir(cache).glob("*.build-*"))


@pytest.fixture(scope="module")
def first_build(tmp_path_factory: pytest.TempPathFactory):
    """The one real build, into an empty cache holding what killed builds
    leave behind: torch's lock file (and a half-written object) in the
    directory older versions built in, and private build directories of a
    killed build (an hour old, its own ``lock`` inside) and of a build still
    running (just started)."""
    cache = tmp_path_factory.mktemp("kernel_cache") / "cache"
    extensions = extensions_dir(cache)
    legacy = extensions / f"kvevict_cpu_ops-{cpu_ops._cpu_fingerprint()}"
    killed = extensions / "kvevict_cpu_ops-000000000000-000000000000.build-killed"
    running = extensions / "kvevict_cpu_ops-000000000000-000000000000.build-running"
    for directory in (legacy, killed, running):
        directory.mkdir(parents=True, mode=0o700)
        (directory / "lock").touch()
        (directory / "head_paged_attention.o").write_bytes(b"\0" * 64)
    hour_ago = time.time() - 3600
    os.utime(killed, (hour_ago, hour_ago))
    with pytest.MonkeyPatch.context() as monkeypatch:
        monkeypatch.setenv(CACHE_ENV, str(cache))
        reset_loader(monkeypatch)
        module = load_in_thread(BUILD_TIMEOUT_S)
        status = cpu_ops.kernel_status()
        yield dict(
            cache=cache, module=module, status=status, killed=killed, running=running,
            built_so=next(cache.rglob("kvevict_cpu_ops*.so"), None),
        )


@pytest.fixture
def fresh(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    reset_loader(monkeypatch)
    return monkeypatch


def test_a_killed_build_does_not_block_the_next_build(first_build, monkeypatch):
    assert first_build["module"] is not None, first_build["status"]
    kernel, reason = first_build["status"]
    assert kernel == "cpp" and reason.startswith("built into ")
    cache = first_build["cache"]
    final = final_dir(monkeypatch, cache)
    assert first_build["built_so"] is not None and first_build["built_so"].parent == final
    assert sorted(p.name for p in final.iterdir()) == [first_build["built_so"].name]
    assert not first_build["killed"].exists(), "a killed build's directory is removed"
    assert first_build["running"].exists(), "a running build's directory is left alone"
    assert build_dirs(cache) == [first_build["running"]]
    monkeypatch.setattr(cpu_ops, "_loaded", True)
    monkeypatch.setattr(cpu_ops, "_module", first_build["module"])
    assert_serves_like_torch(first_build["module"])


def test_a_finished_build_loads_without_a_lock_or_a_compiler(first_build, fresh, caplog):
    """With a finished build in the cache, a start imports it: no compiler
    runs, and neither a torch lock file in the directory nor another process
    holding the build lock makes it wait."""
    from torch.utils import cpp_extension

    def no_compiler(**kwargs):
        raise AssertionError("a finished build must not be rebuilt")

    fresh.setattr(cpp_extension, "load", no_compiler)
    final = final_dir(fresh, first_build["cache"])
    stale_lock = final / "lock"  # torch's FileBaton, as a killed older build leaves it
    stale_lock.touch()
    fd = os.open(f"{final}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # a process building right now
        with caplog.at_level("WARNING", logger="vllm_kvevict.cpu_ops"):
            module = load_in_thread(LOAD_TIMEOUT_S)
    finally:
        os.close(fd)
        stale_lock.unlink()
    assert not [r for r in caplog.records if r.name == "vllm_kvevict.cpu_ops"]
    assert cpu_ops.kernel_status() == ("cpp", f"loaded from {first_build['built_so']}")
    assert cpu_ops.serving_kernel() == "cpp"
    assert_serves_like_torch(module)


def test_a_hung_builder_is_waited_for_a_bounded_time(first_build, fresh, tmp_path):
    """Another process holds the build lock and never finishes: after
    ``BUILD_TIMEOUT_S`` this one builds itself."""
    from torch.utils import cpp_extension

    cache = tmp_path / "cache"
    calls: list[Path] = []
    fresh.setattr(cpp_extension, "load", stand_in_compiler(first_build["built_so"], calls))
    fresh.setattr(cpu_ops, "BUILD_TIMEOUT_S", 1.0)
    final = final_dir(fresh, cache)
    extensions_dir(cache).mkdir(parents=True, mode=0o700)
    fd = os.open(f"{final}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        module = load_in_thread(LOAD_TIMEOUT_S)
    finally:
        os.close(fd)
    assert len(calls) == 1 and calls[0].parent == final.parent
    assert cpu_ops.kernel_status().kernel == "cpp"
    assert cpu_ops._find_extension(final) is not None and build_dirs(cache) == []
    assert_serves_like_torch(module)


def test_another_process_publishing_first_wins(first_build, fresh, tmp_path):
    """Two processes build at once and the other one publishes first: this
    one keeps the other's build in the cache, serves, and cleans up."""
    from torch.utils import cpp_extension

    cache = tmp_path / "cache"
    final = final_dir(fresh, cache)
    built_so = first_build["built_so"]

    def other_process_publishes() -> None:
        final.mkdir(mode=0o700)
        shutil.copy2(built_so, final / built_so.name)

    calls: list[Path] = []
    fresh.setattr(cpp_extension, "load", stand_in_compiler(built_so, calls, other_process_publishes))
    module = load_in_thread(LOAD_TIMEOUT_S)
    assert len(calls) == 1
    theirs = final / built_so.name
    inode = theirs.stat().st_ino
    assert sorted(p.name for p in final.iterdir()) == [built_so.name]
    assert build_dirs(cache) == []
    assert cpu_ops.kernel_status() == ("cpp", f"built into {theirs}")
    assert_serves_like_torch(module)
    # The next start loads the published build.
    reset_loader(fresh)
    fresh.setattr(cpp_extension, "load", None)
    assert load_in_thread(LOAD_TIMEOUT_S) is not None
    assert cpu_ops.kernel_status() == ("cpp", f"loaded from {theirs}") and theirs.stat().st_ino == inode


def test_a_changed_source_is_rebuilt(first_build, fresh, tmp_path):
    """The cache is keyed on the source's content: an edited kernel is built
    again instead of loading the build of the old source."""
    from torch.utils import cpp_extension

    cache = first_build["cache"]
    original = final_dir(fresh, cache)
    edited = tmp_path / "bindings.cpp"
    edited.write_text(cpu_ops._source_path().read_text())
    attention = tmp_path / "head_paged_attention.cpp"
    attention.write_text((cpu_ops._source_path().parent / attention.name).read_text())
    other = tmp_path / "compact_head_pages.cpp"
    other.write_text((cpu_ops._source_path().parent / other.name).read_text() + "\n// edited\n")
    selection = tmp_path / "select_top.cpp"
    selection.write_text((cpu_ops._source_path().parent / selection.name).read_text())
    calls: list[Path] = []

    def compiler(**kwargs):
        calls.append(Path(kwargs["build_directory"]))
        assert kwargs["sources"] == [str(edited), str(attention), str(other), str(selection)]
        raise RuntimeError("compile stopped by the test")

    fresh.setattr(cpu_ops, "_source_path", lambda: edited)
    fresh.setattr(cpp_extension, "load", compiler)
    assert cpu_ops._build_directory(edited) != original
    assert cpu_ops._build_directory(edited).name.startswith(original.name[: -len("0123456789ab")])
    assert load_in_thread(LOAD_TIMEOUT_S) is None
    assert len(calls) == 1 and calls[0].parent == original.parent
    assert cpu_ops.serving_kernel() == "torch"
    assert not cpu_ops._build_directory(edited).exists()
    assert build_dirs(cache) == [first_build["running"]]


def test_before_loading_torch_serves(fresh):
    assert cpu_ops.serving_kernel() == "torch"
    assert cpu_ops.kernel_status() == ("torch", "the C++ kernel has not been loaded")


def test_a_failed_build_serves_torch_and_says_how_to_retry(fresh, tmp_path, caplog):
    """A failed build: one warning with the compiler's error and what to do,
    the reason kept for :func:`kernel_status`, the torch path serving, and no
    half build left in the cache (the next start tries again)."""
    from torch.utils import cpp_extension

    def broken(**kwargs):
        raise RuntimeError("Error building extension\nfoo.cpp:1:1: error: no compiler today\nbuild stopped")

    cache = tmp_path / "cache"
    final = final_dir(fresh, cache)
    fresh.setattr(cpp_extension, "load", broken)
    with caplog.at_level("WARNING", logger="vllm_kvevict.cpu_ops"):
        assert load_in_thread(LOAD_TIMEOUT_S) is None
        assert load_in_thread(LOAD_TIMEOUT_S) is None
    warnings = [r.getMessage() for r in caplog.records if r.name == "vllm_kvevict.cpu_ops"]
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert "no compiler today" in warnings[0] and "restart" in warnings[0]
    kernel, reason = cpu_ops.kernel_status()
    assert kernel == "torch" == cpu_ops.serving_kernel()
    assert reason == "RuntimeError: foo.cpp:1:1: error: no compiler today"
    assert not final.exists() and build_dirs(cache) == []


WEAKNESSES = {
    # what is weak -> how to make it so, given the cache and the finished build
    "cache world-writable": lambda cache, final: cache.chmod(0o777),
    "torch_extensions group-writable": lambda cache, final: extensions_dir(cache).chmod(0o770),
    "build directory world-writable": lambda cache, final: final.chmod(0o707),
    "shared object group-writable": lambda cache, final: next(final.glob("*.so")).chmod(0o775),
    "cache owned by another user": lambda cache, final: os.chown(cache, 65534, -1),
}
WEAK_PATH = {
    "cache world-writable": lambda cache, final: cache,
    "torch_extensions group-writable": lambda cache, final: extensions_dir(cache),
    "build directory world-writable": lambda cache, final: final,
    "shared object group-writable": lambda cache, final: next(final.glob("*.so")),
    "cache owned by another user": lambda cache, final: cache,
}


def tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under ``root`` with its size and modification time."""
    return {
        str(p.relative_to(root)): (p.lstat().st_size, p.lstat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize("weakness", list(WEAKNESSES))
def test_an_unsafe_cache_is_neither_loaded_from_nor_written(weakness, first_build, fresh, tmp_path, caplog):
    """A cache directory (or anything in it down to the shared object) that
    another user owns or can write: the kernel is not loaded from there but
    built in a private temporary directory, removed afterwards; one warning
    names the directory and the fix."""
    from torch.utils import cpp_extension

    if weakness == "cache owned by another user" and os.geteuid() != 0:
        pytest.skip("only root can hand a directory to another user")
    cache = tmp_path / "cache"
    shutil.copytree(first_build["cache"] / "torch_extensions", extensions_dir(cache), symlinks=True)
    final = final_dir(fresh, cache)
    WEAKNESSES[weakness](cache, final)
    weak = WEAK_PATH[weakness](cache, final)
    before = tree(cache)
    calls: list[Path] = []
    fresh.setattr(cpp_extension, "load", stand_in_compiler(first_build["built_so"], calls))
    with caplog.at_level("WARNING", logger="vllm_kvevict.cpu_ops"):
        module = load_in_thread(LOAD_TIMEOUT_S)
    assert len(calls) == 1, "built (privately) instead of loading from the cache"
    private = calls[0]
    assert cache not in private.parents and not private.exists()
    warnings = [r.getMessage() for r in caplog.records if r.name == "vllm_kvevict.cpu_ops"]
    assert len(warnings) == 1 and str(weak) in warnings[0]
    assert "chmod" in warnings[0] and CACHE_ENV in warnings[0]
    kernel, reason = cpu_ops.kernel_status()
    assert kernel == "cpp" and "private temporary directory" in reason and str(weak) in reason
    assert tree(cache) == before
    assert_serves_like_torch(module)


def test_new_cache_directories_are_private(first_build, fresh, tmp_path):
    """Directories the loader creates are the user's alone (mode 0o700)."""
    from torch.utils import cpp_extension

    cache = tmp_path / "new" / "cache"
    final = final_dir(fresh, cache)
    fresh.setattr(cpp_extension, "load", stand_in_compiler(first_build["built_so"], []))
    assert load_in_thread(LOAD_TIMEOUT_S) is not None
    for directory in (cache, extensions_dir(cache), final):
        info = directory.stat()
        assert info.st_uid == os.geteuid() and info.st_mode & 0o777 == 0o700, directory
    assert next(final.glob("*.so")).stat().st_mode & 0o022 == 0


def test_a_cache_that_cannot_be_created_still_gets_the_kernel(first_build, fresh, tmp_path, caplog):
    """A cache path that cannot be created (here: below a regular file, as a
    read-only filesystem would refuse it too): the kernel is built privately."""
    from torch.utils import cpp_extension

    (tmp_path / "file").write_text("")
    fresh.setenv(CACHE_ENV, str(tmp_path / "file" / "cache"))
    calls: list[Path] = []
    fresh.setattr(cpp_extension, "load", stand_in_compiler(first_build["built_so"], calls))
    with caplog.at_level("WARNING", logger="vllm_kvevict.cpu_ops"):
        module = load_in_thread(LOAD_TIMEOUT_S)
    warnings = [r.getMessage() for r in caplog.records if r.name == "vllm_kvevict.cpu_ops"]
    assert len(warnings) == 1 and "cannot be created" in warnings[0] and CACHE_ENV in warnings[0]
    assert len(calls) == 1 and not calls[0].exists()
    assert cpu_ops.kernel_status().kernel == "cpp"
    assert_serves_like_torch(module)
