"""Where vllm-kvevict keeps what it builds or converts on a machine."""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path


def cache_dir() -> Path:
    """``$KVEVICT_CACHE_DIR``, else ``$XDG_CACHE_HOME/vllm-kvevict`` (``~/.cache``):
    converted models, the built C++ kernel."""
    root = os.environ.get("KVEVICT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-kvevict"
    )
    return Path(root)


@contextlib.contextmanager
def build_lock(target: Path) -> Iterator[None]:
    """Hold an ``flock`` on ``<target>.lock`` while building ``target``: a second
    process building the same thing (two test workers, two servers starting)
    waits, then finds it built. The system releases the lock when its holder
    dies, so a killed build never blocks the next one."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{target}.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def configs_dir() -> Path | None:
    """The eviction configs shipped with the package (``vllm_kvevict/configs`` in a
    wheel, the repository's ``configs/`` in a checkout); None when neither exists."""
    import importlib.util

    # A folder without __init__.py: a namespace package, found by its spec.
    spec = importlib.util.find_spec("vllm_kvevict.configs")
    for location in (spec.submodule_search_locations or []) if spec else []:
        if Path(location).is_dir():
            return Path(location)
    # An editable install made before configs/ was packaged: the checkout's.
    root = Path(__file__).resolve().parent.parent
    if (root / "pyproject.toml").is_file() and (root / "configs").is_dir():
        return root / "configs"
    return None


def shipped_configs() -> dict[str, Path]:
    """Every shipped config by name: ``{"snapkv": .../configs/snapkv.yaml, ...}``."""
    folder = configs_dir()
    if folder is None:
        return {}
    return {path.stem: path for path in sorted(folder.glob("*.yaml")) if path.is_file()}


def shipped_config(name: str) -> Path | None:
    """The shipped config a name stands for: ``snapkv``, ``snapkv.yaml`` or
    ``configs/snapkv.yaml`` (the path the README uses, resolved outside a
    checkout); None when there is none."""
    text = name.strip().replace("\\", "/")
    text = text.removeprefix("./").removeprefix("configs/")
    if text.endswith((".yaml", ".yml")):
        text = text.rsplit(".", 1)[0]
    if not text or "/" in text:
        return None
    return shipped_configs().get(text)
