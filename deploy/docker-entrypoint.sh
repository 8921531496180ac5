#!/bin/sh
# Entry point of the vllm-kvevict images (Dockerfile, Dockerfile.cpu):
#   vllm serve [$MODEL] --kv-eviction "$KV_EVICTION" --kv-eviction-config "$KV_EVICTION_CONFIG" \
#     --host 0.0.0.0 --port 8000 $EXTRA_ARGS "$@"
# and `exec`s it, so vllm is the container's main process and gets SIGTERM.
#
#   MODEL               model to serve; unset: the first argument names it (as
#                       with vLLM's own image), or vLLM's --model / default
#   KV_EVICTION         policy (streamingllm, snapkv, tova, keydiff, knorm, momentkv); "none" or empty: plain
#                       vLLM without eviction
#   KV_EVICTION_CONFIG  inline JSON or a .json/.yaml file; unset:
#                       $KVEVICT_CONFIG_DIR/$KV_EVICTION.yaml when that file
#                       exists; empty: the plugin's defaults
#   KVEVICT_CONFIG_DIR  default /opt/vllm-kvevict/configs (the repo's configs/)
#   EXTRA_ARGS          more `vllm serve` arguments, split on spaces; arguments
#                       given to the container come after them and win
set -eu

KV_EVICTION=${KV_EVICTION-snapkv}
CONFIG_DIR=${KVEVICT_CONFIG_DIR:-/opt/vllm-kvevict/configs}

# No MODEL: a first argument that is not an option is the model.
if [ -z "${MODEL:-}" ] && [ $# -gt 0 ]; then
  case "$1" in
    -*) ;;
    *) MODEL=$1; shift ;;
  esac
fi

# Build the argument list back to front on top of the container's arguments.
if [ -n "${EXTRA_ARGS:-}" ]; then
  set -f  # no globbing while splitting EXTRA_ARGS
  # shellcheck disable=SC2086  # word splitting is the point
  set -- $EXTRA_ARGS "$@"
  set +f
fi
set -- --host 0.0.0.0 --port 8000 "$@"

case "$KV_EVICTION" in
  "" | none | off) ;;
  *)
    if [ -z "${KV_EVICTION_CONFIG+set}" ] && [ -f "$CONFIG_DIR/$KV_EVICTION.yaml" ]; then
      KV_EVICTION_CONFIG=$CONFIG_DIR/$KV_EVICTION.yaml
    fi
    if [ -n "${KV_EVICTION_CONFIG:-}" ]; then
      set -- --kv-eviction-config "$KV_EVICTION_CONFIG" "$@"
    fi
    set -- --kv-eviction "$KV_EVICTION" "$@"
    ;;
esac

if [ -n "${MODEL:-}" ]; then
  set -- "$MODEL" "$@"
fi

exec vllm serve "$@"
