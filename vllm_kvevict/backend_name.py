"""The name of the plugin's CUDA attention backend: the ``AttentionBackendEnum``
member :func:`vllm_kvevict.register` adds, selected with ``--attention-backend
KVEVICT_TRITON`` (the CLI does so when eviction is on), and what the backend's
``get_name()`` returns. Apart from the package, so the backend and the CLI
read it without importing the module that registers them."""

GPU_BACKEND_NAME = "KVEVICT_TRITON"
