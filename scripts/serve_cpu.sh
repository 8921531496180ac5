#!/usr/bin/env bash
# Install everything, convert the embedded default model, and serve it with
# KV-cache eviction on 127.0.0.1.
#   bash scripts/serve_cpu.sh [POLICY] [extra vllm serve args...]
set -euo pipefail
cd "$(dirname "$0")/.."
POLICY=${1:-snapkv}
shift || true
PORT=${PORT:-8000}
bash scripts/install_cpu.sh .venv
MODEL=$(.venv/bin/kvevict fetch-model | tail -n 1)
cat <<MSG
Serving $MODEL with --kv-eviction $POLICY at http://127.0.0.1:$PORT/v1
Try:
  curl http://127.0.0.1:$PORT/v1/completions -H 'Content-Type: application/json' \\
    -d '{"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'
MSG
exec .venv/bin/vllm serve "$MODEL" --served-model-name smollm2 \
  --kv-eviction "$POLICY" --kv-eviction-config "configs/$POLICY.yaml" \
  --host 127.0.0.1 --port "$PORT" --dtype float32 --max-model-len 8192 \
  --block-size 32 --kv-cache-memory-bytes 2000000000 --enforce-eager "$@"
