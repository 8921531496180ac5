"""Where vllm-kvevict keeps what it builds or converts on a machine."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$KVEVICT_CACHE_DIR``, else ``$XDG_CACHE_HOME/vllm-kvevict`` (``~/.cache``):
    converted models, the built C++ kernel."""
    root = os.environ.get("KVEVICT_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "vllm-kvevict"
    )
    return Path(root)
