"""Where the Triton kernel tests run: compiled on a CUDA GPU, under Triton's
interpreter on CPU tensors otherwise (``TRITON_INTERPRET=1``, set here before
triton is imported).

Triton reads the variable when ``@triton.jit`` decorates a function: for our
kernels when their modules are imported, for triton's own library (``tl.sum``,
``tl.zeros``...) when ``triton`` is first imported. A kernel test module
imports this module first. When another module of the same pytest process
imported triton before (vLLM does), the library is decorated for compiled
mode and interpreted kernels fail: the module then skips its tests
(``skip_unless``) and one of them reruns the whole file in a new interpreter
(``run_in_fresh_process``).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = torch.device("cpu" if INTERPRET else "cuda")

triton = pytest.importorskip("triton")

from triton.runtime.jit import JITFunction  # noqa: E402

# Triton's library was decorated before TRITON_INTERPRET was set.
NEEDS_FRESH_PROCESS = INTERPRET and isinstance(triton.language.zeros, JITFunction)


def skip_unless(request: pytest.FixtureRequest, runner: str) -> None:
    """In a process that cannot interpret, skip every test but ``runner``."""
    if NEEDS_FRESH_PROCESS and request.node.name != runner:
        pytest.skip(f"triton was imported before TRITON_INTERPRET=1; run by {runner}")


def run_in_fresh_process(test_file: str, runner: str, allowed_skips: int = 0, timeout: float = 900) -> str:
    """``test_file`` but ``runner`` in a new interpreter with TRITON_INTERPRET=1;
    fails unless it passes with at most ``allowed_skips`` skipped. Returns
    pytest's summary line."""
    if not NEEDS_FRESH_PROCESS:
        pytest.skip("the kernel tests run in this process")
    path = Path(test_file).resolve()
    result = subprocess.run(
        [sys.executable, "-m", "pytest", str(path), "-q", "-p", "no:cacheprovider", "-k", f"not {runner}"],
        cwd=path.parents[1], env={**os.environ, "TRITON_INTERPRET": "1"},
        capture_output=True, text=True, timeout=timeout,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    summary = result.stdout.strip().splitlines()[-1]
    skipped = re.search(r"(\d+) skipped", summary)
    assert " passed" in summary and (int(skipped.group(1)) if skipped else 0) <= allowed_skips, result.stdout[-2000:]
    return summary
