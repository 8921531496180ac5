"""Counters published to a JSON file for tests and tools (``KVEVICT_STATS_PATH``).

The scheduler's manager writes ``PATH``, each worker ``PATH.workerN``. A write
replaces the file atomically, at most every 50 ms unless forced.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

STATS_PATH_ENV = "KVEVICT_STATS_PATH"
logger = logging.getLogger(__name__)


class SnapshotWriter:
    def __init__(self, path: str | None, interval: float = 0.05) -> None:
        self.path = path
        self.interval = interval
        self._last_write = 0.0
        self._lock = threading.Lock()
        self._failed = False

    def write(self, snapshot: Callable[[], dict[str, Any]], force: bool = False) -> None:
        """Write ``snapshot()`` (called only when a write is due)."""
        if not self.path:
            return
        now = time.monotonic()
        if not force and now - self._last_write < self.interval:
            return
        self._last_write = now
        data = {**snapshot(), "pid": os.getpid()}
        directory = os.path.dirname(os.path.abspath(self.path))
        with self._lock:
            try:
                fd, tmp = tempfile.mkstemp(dir=directory, prefix=".kvevict-stats")
                with os.fdopen(fd, "w") as handle:
                    json.dump(data, handle)
                os.replace(tmp, self.path)
            except OSError as exc:
                # The stats file is for tools; losing it must not end the engine.
                if not self._failed:
                    logger.warning("kvevict stats: cannot write %s (%s); continuing without it",
                                   self.path, exc)
                self._failed = True
            else:
                self._failed = False
