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
# --kv-cache-memory-bytes is the one flag vLLM's CPU build needs: without it
# vLLM sizes the KV cache to most of the machine's memory (20.8 of 23.5 GiB
# measured) and the worker can be killed for memory before serving. The rest
# are choices: fp32 (the converted model's dtype; vLLM's CPU default is
# bfloat16), 32-token blocks (eviction frees whole blocks; the CPU default is
# 128) and no torch.compile warm-up at start-up (--enforce-eager).
exec .venv/bin/vllm serve "$MODEL" --served-model-name smollm2 \
  --kv-eviction "$POLICY" --kv-eviction-config "configs/$POLICY.yaml" \
  --host 127.0.0.1 --port "$PORT" --kv-cache-memory-bytes 2000000000 \
  --dtype float32 --block-size 32 --enforce-eager "$@"
