"""Test helpers: the evaluation tools, and the shared server's settings."""

from vllm_kvevict.evaluation.server import VllmServer, free_port, vllm_executable  # noqa: F401
from vllm_kvevict.evaluation.tasks import needle_prompt  # noqa: F401

# The shared test server's eviction settings (see configs/snapkv.yaml for why
# kernel 15 on the default model).
SNAPKV_SERVER_CONFIG = {"policy": "snapkv", "budget": 512, "policy_options": {"kernel_size": 15}}
