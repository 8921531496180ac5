"""Worker side: the retention gates' input, captured inside vLLM's model.

The learned policy's gate reads each layer's normalised hidden state (the
input of the attention block's QKV projection), which an attention backend
never sees. When the model is loaded we put a forward pre-hook on every
decoder layer's attention module that passes its ``hidden_states`` through a
custom op, ``kvevict::retention_gate``: the op computes log β of the step's
tokens for every KV head and keeps it for the layer's attention backend,
which stores it beside the tokens' K/V. The op returns a copy of its input
(a custom op may not return an alias), which the QKV projection then reads:
the data dependency keeps ``torch.compile`` from dropping or moving it, and as
an opaque op its body runs at every step in eager and compiled mode alike.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_kvevict.config import KVEvictionConfigError, config_from_additional
from vllm_kvevict.policies.gate_checkpoints import GateCheckpointError, gates_for_model
from vllm_kvevict.policies.retention_gate import LearnedRetentionPolicy, RetentionGates
from vllm_kvevict.plugin.gate_models import SUPPORTED_ARCHITECTURES, unsupported_architecture
from vllm_kvevict.plugin.worker.layer_neighbours import resolve_model_parts



@dataclass
class GateCapture:
    """The worker's gates and the log β each layer computed this step."""

    gates: RetentionGates
    layer_of: dict[str, int]  # attention layer name -> gate (decoder layer) index
    pending: dict[str, torch.Tensor] = field(default_factory=dict)

    def take(self, layer_name: str, num_tokens: int) -> torch.Tensor:
        """log β ``[num_tokens, H_total]`` (fp32) of this step's tokens in ``layer_name``."""
        log_beta = self.pending.pop(layer_name, None)
        if log_beta is None or log_beta.shape[0] < num_tokens:
            raise RuntimeError(
                f"policy 'learned': no retention-gate input was captured for {layer_name} "
                "in this step; the model's decoder layers do not call their attention "
                "module the way vllm-kvevict expects"
            )
        return log_beta[:num_tokens]


# Per worker process: the one model it loaded has one set of gates, whose
# inputs the model's forward captures and the backends take.
_capture: GateCapture | None = None


def current_capture() -> GateCapture | None:
    return _capture


@torch.library.custom_op("kvevict::retention_gate", mutates_args=())
def retention_gate(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    capture = _capture
    if capture is not None:
        layer = capture.layer_of[layer_name]
        with torch.no_grad():
            capture.pending[layer_name] = capture.gates(layer, hidden_states)
    return hidden_states.clone()


@retention_gate.register_fake
def _(hidden_states: torch.Tensor, layer_name: str) -> torch.Tensor:
    return torch.empty_like(hidden_states)


def decoder_attention_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, str]]:
    """Each decoder layer's attention module and its vLLM attention layer name, in order."""
    architecture = type(model).__name__
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if architecture not in SUPPORTED_ARCHITECTURES or layers is None:
        raise KVEvictionConfigError(unsupported_architecture(architecture))
    found = []
    for layer in layers:
        attention = getattr(layer, "self_attn", None)
        name = getattr(getattr(attention, "attn", None), "layer_name", None)
        if attention is None or name is None:
            continue  # a pipeline-parallel placeholder holds no layer
        found.append((attention, name))
    return found


def install_gate_capture(model: torch.nn.Module, vllm_config: Any) -> GateCapture | None:
    """Load the gates and hook the model, when the eviction policy is learned."""
    global _capture
    config = config_from_additional(vllm_config.additional_config)
    policy = config.build_policy() if config is not None else None
    if not isinstance(policy, LearnedRetentionPolicy):
        return None
    if getattr(model, "_kvevict_gates_hooked", False):
        return _capture
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        raise KVEvictionConfigError(
            "policy 'learned' ranks every layer's tokens together, which pipeline "
            "parallelism splits across processes; use --pipeline-parallel-size 1"
        )
    model_config = vllm_config.model_config
    hf = model_config.hf_text_config
    modules = decoder_attention_modules(model)
    try:
        gates = gates_for_model(
            policy.gates, hf.hidden_size, hf.num_hidden_layers,
            model_config.get_total_num_kv_heads(), str(model_config.model),
        )
    except GateCheckpointError as exc:
        raise KVEvictionConfigError(str(exc)) from None
    device = next(model.parameters()).device
    gates = gates.to(device=device, dtype=model_config.dtype).eval()
    layer_of = {}
    for index, (attention, name) in enumerate(modules):
        layer_of[name] = index
        attention.register_forward_pre_hook(
            functools.partial(_pass_through_gate, layer_name=name), with_kwargs=True
        )
    model._kvevict_gates_hooked = True
    _capture = GateCapture(gates, layer_of)
    return _capture


def _pass_through_gate(
    module: torch.nn.Module, args: tuple, kwargs: dict[str, Any], *, layer_name: str
) -> tuple[tuple, dict[str, Any]]:
    if "hidden_states" in kwargs:
        kwargs["hidden_states"] = torch.ops.kvevict.retention_gate(kwargs["hidden_states"], layer_name)
    else:  # self_attn(positions, hidden_states)
        args = (args[0], torch.ops.kvevict.retention_gate(args[1], layer_name), *args[2:])
    return args, kwargs


_installed = False  # the model loader is wrapped once per process


def install_model_load_hook() -> None:
    """Right after the worker loads the model, before vLLM's profiling run
    compiles it: hook the gates in, and look up the model parts the policy
    reads (:func:`~vllm_kvevict.plugin.worker.layer_neighbours.resolve_model_parts`)."""
    global _installed
    if _installed:
        return
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    runners: list[type] = [GPUModelRunner]
    try:
        from vllm.v1.worker.cpu_model_runner import CPUModelRunner

        runners.append(CPUModelRunner)
    except ImportError:  # a GPU-only build
        pass
    for runner in runners:
        if "load_model" not in runner.__dict__:
            continue
        load_model = runner.__dict__["load_model"]

        @functools.wraps(load_model)
        def wrapped(self: Any, *args: Any, __load_model: Any = load_model, **kwargs: Any) -> Any:
            result = __load_model(self, *args, **kwargs)
            install_gate_capture(self.get_model(), self.vllm_config)
            resolve_model_parts(self.get_model(), self.vllm_config)
            return result

        runner.load_model = wrapped
    _installed = True
