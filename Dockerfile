# syntax=docker/dockerfile:1
# vLLM's official OpenAI-compatible server image (CUDA) with vllm-kvevict.
#   docker build -t vllm-kvevict:0.1.0 .
#   docker run --gpus all -p 8000:8000 --ipc=host \
#     -e MODEL=HuggingFaceTB/SmolLM2-1.7B-Instruct -e KV_EVICTION=snapkv vllm-kvevict:0.1.0
# Environment (deploy/docker-entrypoint.sh): MODEL, KV_EVICTION (snapkv,
# streamingllm, none), KV_EVICTION_CONFIG (default: configs/$KV_EVICTION.yaml in
# the image), EXTRA_ARGS; arguments after the image name go to `vllm serve` too.
# The CPU variant is Dockerfile.cpu.
# Not yet run on a GPU: tests/test_deploy_files.py checks this file (hadolint,
# its instructions) but does not build the image, and eviction on CUDA has not
# been served on a GPU yet (README, Status; start-up logs a warning saying so).
FROM vllm/vllm-openai:v0.32.0

LABEL org.opencontainers.image.title="vllm-kvevict" \
      org.opencontainers.image.description="vLLM 0.32 OpenAI server with KV-cache eviction (--kv-eviction)" \
      org.opencontainers.image.licenses="Apache-2.0"

WORKDIR /opt/vllm-kvevict
COPY pyproject.toml README.md ./
COPY vllm_kvevict ./vllm_kvevict
COPY triton_kernels ./triton_kernels
COPY configs ./configs
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/kvevict-entrypoint

# Not the [gpu] extra: the base image already has vLLM 0.32.0 with its torch
# and Triton. Every distribution of the base image is held at its version (a
# constraints file from `pip list`), so installing the plugin cannot move
# torch or vLLM; its other dependencies are vLLM's own.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m pip list --format=freeze --disable-pip-version-check > /tmp/base-image.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
        --disable-pip-version-check -c /tmp/base-image.txt /opt/vllm-kvevict \
    && rm /tmp/base-image.txt \
    && python3 -c "from importlib.metadata import entry_points; assert any(e.name == 'kvevict' for e in entry_points(group='vllm.general_plugins'))"

ENV KV_EVICTION=snapkv \
    KVEVICT_CONFIG_DIR=/opt/vllm-kvevict/configs
EXPOSE 8000
ENTRYPOINT ["/usr/local/bin/kvevict-entrypoint"]
CMD []
