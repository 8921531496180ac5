"""What some policies need from the model besides the attention layer: its
output projection (criticalkv's ‖v W_O‖) and its rotary embedding
(expected_attention's future-position average).

vLLM's attention layer sees neither, so we find them beside it in the model
vLLM loaded: a decoder's attention module holds ``attn`` (vLLM's
``Attention``), ``o_proj`` and ``rotary_emb`` (Llama, Mistral, Qwen2/3 and
most others). They are looked up once, right after the worker loads the
model (:func:`resolve_model_parts`), so a model laid out otherwise, with
partial rotary, an RoPE scaling we do not model or an output projection we
cannot read fails start-up with an error naming the policy, rather than
passing ``/health`` and failing its first long request.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from typing import Any

from vllm_kvevict.config import KVEvictionConfigError, config_from_additional
from vllm_kvevict.policies import RotaryFrequencies


@dataclass
class LayerNeighbours:
    output_projection: torch.nn.Module | None
    rotary_embedding: torch.nn.Module | None


def find_layer_neighbours(model: torch.nn.Module) -> dict[str, LayerNeighbours]:
    """Each attention layer's (by vLLM layer name) output projection and rotary
    embedding, from the module that holds it."""
    from vllm.model_executor.layers.attention.attention import Attention

    found: dict[str, LayerNeighbours] = {}
    for module in model.modules():
        attention = getattr(module, "attn", None)
        if isinstance(attention, Attention):
            found[attention.layer_name] = LayerNeighbours(
                getattr(module, "o_proj", None), getattr(module, "rotary_emb", None)
            )
    return found


def output_projection_slices(
    neighbours: LayerNeighbours | None, layer_name: str, num_q_heads: int, head_dim: int
) -> torch.Tensor:
    """``[Hq, D, d_model]``: each local query head's rows of ``W_O = o_proj.weight.T``.

    The output projection is row-parallel, so under tensor parallelism a
    rank's shard holds exactly its own heads' rows. A view of the weight in
    its own dtype, not a copy: the value norms multiply 16-bit operands
    exactly (``vllm_kvevict.policies.criticalkv.projected_value_norms``).
    """
    module = neighbours.output_projection if neighbours else None
    columns = num_q_heads * head_dim
    weight = getattr(module, "weight", None)
    projection = None
    if isinstance(weight, torch.Tensor) and weight.dim() == 2 and weight.shape[1] == columns:
        projection = weight.detach().t()
    elif module is not None and hasattr(module, "quant_method"):
        # vLLM's CPU platform repacks linear weights for oneDNN and drops
        # .weight; the rows of W_O are what the layer's own matmul makes of
        # the identity (exact: one non-zero term per output).
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), torch.float32)
        with torch.no_grad():
            identity = torch.eye(columns, dtype=dtype)
            projection = module.quant_method.apply(module, identity, None)
    if projection is None or projection.dim() != 2 or projection.shape[0] != columns:
        raise KVEvictionConfigError(
            f"criticalkv scores with the attention output projection, and layer "
            f"{layer_name} has no o_proj of {num_q_heads} x {head_dim} input columns beside "
            f"it (found {type(module).__name__ if module is not None else 'none'}); choose "
            "another policy for this model"
        )
    return projection.reshape(num_q_heads, head_dim, projection.shape[1])


def rotary_frequencies(
    neighbours: LayerNeighbours | None, layer_name: str, head_dim: int
) -> RotaryFrequencies:
    """The layer's RoPE as :class:`RotaryFrequencies`, checked against the
    cos/sin table vLLM rotates with, so a scaling we do not model fails here."""
    rope = neighbours.rotary_embedding if neighbours else None
    problem = None
    if rope is None or not hasattr(rope, "cos_sin_cache") or not hasattr(rope, "base"):
        problem = f"no rotary embedding beside it (found {type(rope).__name__})"
    elif getattr(rope, "rotary_dim", None) != head_dim:
        problem = f"partial rotary ({rope.rotary_dim} of {head_dim} dimensions)"
    else:
        try:
            inv_freq = rope._compute_inv_freq(rope.base).double().cpu()
        except TypeError:  # scalings whose frequencies take other arguments
            inv_freq = None
        cache = rope.cos_sin_cache.double().cpu()
        scaling = float(cache[0, 0])  # cos(0) times the rotary's attention scaling
        if inv_freq is None or inv_freq.numel() != head_dim // 2:
            problem = f"a rotary embedding of kind {type(rope).__name__}"
        else:
            probe = torch.tensor([1, cache.shape[0] // 2, cache.shape[0] - 1]).double()
            expected = scaling * torch.cos(probe[:, None] * inv_freq)
            if not torch.allclose(cache[probe.long(), : head_dim // 2], expected, atol=1e-3):
                problem = f"a rotary embedding of kind {type(rope).__name__}"
    if problem is not None:
        raise KVEvictionConfigError(
            f"expected_attention models future queries through the model's RoPE, and "
            f"layer {layer_name} has {problem}, which it does not support yet; choose "
            "another policy for this model"
        )
    return RotaryFrequencies(inv_freq, bool(rope.is_neox_style), scaling)


@dataclass(frozen=True)
class ModelParts:
    """What the serving policy reads from the model beside one attention layer."""

    rotary: RotaryFrequencies | None = None
    output_projection: torch.Tensor | None = None  # [Hq_local, D, d_model] fp32


# Per worker process: found in the one model it loaded, by attention layer name.
_model_parts: dict[str, ModelParts] = {}


def resolve_model_parts(model: torch.nn.Module, vllm_config: Any) -> None:
    """After the worker loads the model: every attention layer's rotary
    frequencies and output projection, where the eviction policy reads them.
    Raises :class:`KVEvictionConfigError` for a model the policy cannot read."""
    config = config_from_additional(vllm_config.additional_config)
    if config is None:
        return
    policy = config.build_policy()
    if not (policy.needs_rotary or policy.needs_output_projection):
        return
    model_config = vllm_config.model_config
    head_size = model_config.get_head_size()
    num_q_heads = model_config.get_num_attention_heads(vllm_config.parallel_config)
    rotaries: list[RotaryFrequencies] = []  # one object per distinct RoPE: the layers sharing it score together
    for name, neighbours in find_layer_neighbours(model).items():
        rotary = rotary_frequencies(neighbours, name, head_size) if policy.needs_rotary else None
        if rotary is not None:
            rotary = next((same for same in rotaries if _same_rotary(same, rotary)), rotary)
            if rotary not in rotaries:
                rotaries.append(rotary)
        _model_parts[name] = ModelParts(
            rotary,
            output_projection_slices(neighbours, name, num_q_heads, head_size)
            if policy.needs_output_projection else None,
        )


def _same_rotary(a: RotaryFrequencies, b: RotaryFrequencies) -> bool:
    return (
        a.neox == b.neox and a.attention_scaling == b.attention_scaling
        and a.inv_freq.shape == b.inv_freq.shape and bool(torch.equal(a.inv_freq, b.inv_freq.to(a.inv_freq.device)))
    )


def model_parts(layer_name: str) -> ModelParts:
    """The parts :func:`resolve_model_parts` found beside ``layer_name``."""
    parts = _model_parts.get(layer_name)
    if parts is None:
        raise RuntimeError(
            f"vllm-kvevict: the model parts of attention layer {layer_name} were not looked up "
            "when the model was loaded; this vLLM build loads models in a way vllm-kvevict "
            "does not support"
        )
    return parts
