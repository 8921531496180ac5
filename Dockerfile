# vLLM's CPU build with vllm-kvevict, serving the embedded default model.
#   docker build -t vllm-kvevict:cpu .
#   docker run -p 8000:8000 -e KV_EVICTION=snapkv vllm-kvevict:cpu
FROM python:3.11-slim
WORKDIR /opt/vllm-kvevict
COPY pyproject.toml README.md ./
COPY vllm_kvevict ./vllm_kvevict
COPY triton_kernels ./triton_kernels
COPY configs ./configs
COPY scripts ./scripts
RUN bash scripts/install_cpu.sh /opt/venv && /opt/venv/bin/kvevict fetch-model
ENV KV_EVICTION=snapkv \
    KV_EVICTION_CONFIG=/opt/vllm-kvevict/configs/snapkv.yaml \
    PATH=/opt/venv/bin:$PATH
EXPOSE 8000
# Shell form so the policy comes from the environment.
CMD vllm serve "$(kvevict fetch-model)" --served-model-name smollm2 \
    --kv-eviction "$KV_EVICTION" --kv-eviction-config "$KV_EVICTION_CONFIG" \
    --host 0.0.0.0 --port 8000 --dtype float32 --block-size 32 --enforce-eager \
    --kv-cache-memory-bytes 2000000000
