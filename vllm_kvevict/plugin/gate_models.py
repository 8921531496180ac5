"""The models whose retention gates (policy ``learned``) the plugin can read:
checked by the front end at start-up and by the workers at model load."""

from __future__ import annotations

# Decoder layers whose attention module is called as
# ``self_attn(positions=..., hidden_states=input_layernorm(x))``, the gate's input.
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)


def unsupported_architecture(architectures: str) -> str:
    """Why policy ``learned`` cannot serve a model of ``architectures``."""
    return (
        f"policy 'learned' reads each layer's hidden state inside the model, which "
        f"vllm-kvevict does for {', '.join(SUPPORTED_ARCHITECTURES)}, not for "
        f"{architectures}; serve it with another policy (e.g. --kv-eviction snapkv)"
    )
