# syntax=docker/dockerfile:1
# vLLM's official OpenAI-compatible server image (CUDA) with vllm-kvevict.
#   docker build -t vllm-kvevict:0.1.0 .
#   docker run --gpus all -p 8000:8000 --ipc=host \
#     -e MODEL=HuggingFaceTB/SmolLM2-1.7B-Instruct vllm-kvevict:0.1.0
# Environment (deploy/docker-entrypoint.sh): MODEL, KV_EVICTION (default none:
# plain vLLM; snapkv, streamingllm, ... turn eviction on), KV_EVICTION_CONFIG
# (default: configs/$KV_EVICTION.yaml in the image), EXTRA_ARGS; arguments
# after the image name go to `vllm serve` too. The CPU variant is Dockerfile.cpu.
# Not yet run on a GPU, and eviction on CUDA has not been served on a GPU yet
# (README, Status), so eviction is off by default. tests/test_images.py builds
# this file's instructions on a CPU stand-in for the base image
# (scripts/build_images.sh gpu-check, BASE_IMAGE): the plugin installs with the
# base's packages held and registers with vLLM; the CUDA base itself is not
# built there.
ARG BASE_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${BASE_IMAGE}

LABEL org.opencontainers.image.title="vllm-kvevict" \
      org.opencontainers.image.description="vLLM 0.32 OpenAI server with KV-cache eviction (--kv-eviction)" \
      org.opencontainers.image.licenses="Apache-2.0"

# pip settings for a mirror (--build-arg); unset, pip uses the base image's.
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_FIND_LINKS
ARG PIP_CERT

WORKDIR /opt/vllm-kvevict
COPY pyproject.toml README.md LICENSE ./
COPY vllm_kvevict ./vllm_kvevict
COPY triton_kernels ./triton_kernels
COPY csrc ./csrc
COPY configs ./configs
COPY --chmod=0755 deploy/docker-entrypoint.sh /usr/local/bin/kvevict-entrypoint

# Not the [gpu] extra: the base image already has vLLM 0.32.0 with its torch
# and Triton. Every distribution of the base image is held at its version (a
# constraints file from `pip list`), so installing the plugin cannot move
# torch or vLLM; its other dependencies are vLLM's own. The sources are
# removed once installed: from this directory, `python3 -c` would import them.
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN python3 -m pip list --format=freeze --disable-pip-version-check > /tmp/base-image.txt \
    && PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir \
        --disable-pip-version-check -c /tmp/base-image.txt /opt/vllm-kvevict \
    && rm /tmp/base-image.txt /opt/vllm-kvevict/pyproject.toml \
    && rm -rf /opt/vllm-kvevict/vllm_kvevict /opt/vllm-kvevict/triton_kernels /opt/vllm-kvevict/csrc \
    && python3 -c "from importlib.metadata import entry_points; assert any(e.name == 'kvevict' for e in entry_points(group='vllm.general_plugins'))"

# Eviction off (plain vLLM) until it has been served on a GPU; to turn it on:
#   docker run ... -e KV_EVICTION=snapkv vllm-kvevict:0.1.0
ENV KV_EVICTION=none \
    KVEVICT_CONFIG_DIR=/opt/vllm-kvevict/configs
EXPOSE 8000
# The entry point's port; a server started with another --port needs its own
# health check. Model download and start-up take minutes.
HEALTHCHECK --interval=30s --timeout=5s --start-period=900s --retries=3 \
    CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["/usr/local/bin/kvevict-entrypoint"]
CMD []
