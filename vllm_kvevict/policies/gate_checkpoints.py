"""Retention-gate checkpoints on disk: ours, the authors', and the shipped ones.

Two formats, both a folder with a ``config.json``:

* ours (``kvevict train-gates``): ``gates.pt``, the state dict of
  :class:`RetentionGates` in fp16, and ``config.json["gate"]`` its
  :class:`RetentionGateConfig`;
* the authors' (DBTrimKV / TrimKV on Hugging Face):
  ``trimkv_weights.pth``, six tensors per layer under
  ``...layers.{l}.self_attn.retention_gate.*`` (two hidden linears with biases,
  the readout ``W3`` and its bias), and the base model's ``config.json`` with
  the gate fields (``retention_gate_intermediate_size``,
  ``tie_retention_gate_layers``, ``hidden_act``).

The authors' file names are not all documented, so the six tensors of a layer
are told apart by shape, which is unambiguous: ``W1 [w, d]``, ``b1 [w]``,
``W2 [w, w]``, ``b2 [w]``, ``W3 [H, w]``, ``b [H]`` (``w != H``).
"""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from vllm_kvevict.policies.retention_gate import RetentionGateConfig, RetentionGates

CHECKPOINT_FILE = "gates.pt"
TRIMKV_FILE = "trimkv_weights.pth"
CONFIG_FILE = "config.json"
SHIPPED_DIR = Path(__file__).resolve().parent.parent / "gates"

_TRIMKV_KEY = re.compile(r"layers\.(\d+)\.self_attn\.retention_gate\.(.+)$")


class GateCheckpointError(ValueError):
    """A gate folder that cannot serve this model, with the fix."""


def save_gates(out: Path, gates: RetentionGates, extra: dict[str, Any]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    torch.save({k: v.to(torch.float16) for k, v in gates.state_dict().items()}, out / CHECKPOINT_FILE)
    (out / CONFIG_FILE).write_text(json.dumps({"gate": asdict(gates.config), **extra}, indent=1))


def load_gates(folder: str | Path) -> RetentionGates:
    """Gates from a folder in either format (fp32 in memory)."""
    folder = Path(folder)
    if (folder / CHECKPOINT_FILE).is_file():
        config = json.loads((folder / CONFIG_FILE).read_text())["gate"]
        gates = RetentionGates(RetentionGateConfig(**config))
        state = torch.load(folder / CHECKPOINT_FILE, map_location="cpu", weights_only=True)
        gates.load_state_dict({k: v.float() for k, v in state.items()})
        return gates
    if (folder / TRIMKV_FILE).is_file():
        return load_trimkv_gates(folder)
    raise GateCheckpointError(
        f"{str(folder)!r} holds neither {CHECKPOINT_FILE} (kvevict train-gates) nor "
        f"{TRIMKV_FILE} (the authors' checkpoints); point gates at one of those folders"
    )


def load_trimkv_gates(folder: str | Path) -> RetentionGates:
    """The authors' gate-only checkpoint (``config.json`` + ``trimkv_weights.pth``).

    With ``tie_retention_gate_layers`` (their default) the readout is one
    module shared by every layer, and their loader (``load_state_dict`` with
    ``strict=False`` on the tied model) keeps the copy of the *last* layer in
    the file; so do we, and warn when the copies differ.
    """
    folder = Path(folder)
    config = json.loads((folder / CONFIG_FILE).read_text())
    state = torch.load(folder / TRIMKV_FILE, map_location="cpu", weights_only=True)
    layers: dict[int, list[tuple[str, torch.Tensor]]] = {}
    for key, tensor in state.items():
        match = _TRIMKV_KEY.search(key)
        if match:
            layers.setdefault(int(match.group(1)), []).append((key, tensor.float()))
    if not layers:
        sample = ", ".join(list(state)[:3])
        raise GateCheckpointError(
            f"{TRIMKV_FILE} in {str(folder)!r} has no '...layers.N.self_attn.retention_gate.*' "
            f"tensors (first keys: {sample}); it is not a TrimKV/DBTrimKV gate checkpoint"
        )
    num_layers = max(layers) + 1
    missing = sorted(set(range(num_layers)) - set(layers))
    if missing:
        raise GateCheckpointError(f"{TRIMKV_FILE} lacks the gates of layers {missing}")
    parts = [_split_layer(layer, layers[layer]) for layer in range(num_layers)]
    width, hidden_size = parts[0]["w1"].shape
    num_kv_heads = parts[0]["w3"].shape[0]
    tie = bool(config.get("tie_retention_gate_layers", True))
    gate_config = RetentionGateConfig(
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        width=width,
        bias_init=float(config.get("retention_gate_bias_init", 18.0)),
        activation=config.get("hidden_act", "silu"),
        tie_readout=tie,
    )
    expected = (config.get("hidden_size"), config.get("num_hidden_layers"),
                config.get("num_key_value_heads"), config.get("retention_gate_intermediate_size"))
    found = (hidden_size, num_layers, num_kv_heads, width)
    for name, want, got in zip(("hidden_size", "num_hidden_layers", "num_key_value_heads",
                                "retention_gate_intermediate_size"), expected, found):
        if want is not None and int(want) != got:
            raise GateCheckpointError(
                f"{str(folder)!r}: config.json says {name}={want}, the weights have {got}"
            )
    gates = RetentionGates(gate_config)
    with torch.no_grad():
        for layer, part in enumerate(parts):
            gates.linear1[layer].weight.copy_(part["w1"])
            gates.linear1[layer].bias.copy_(part["b1"])
            gates.linear2[layer].weight.copy_(part["w2"])
            gates.linear2[layer].bias.copy_(part["b2"])
        if tie:
            last = parts[-1]
            if any(not (torch.equal(p["w3"], last["w3"]) and torch.equal(p["b"], last["b"]))
                   for p in parts):
                warnings.warn(
                    f"{TRIMKV_FILE} holds distinct readouts per layer although "
                    "tie_retention_gate_layers is set; using the last layer's, as the "
                    "authors' loader does", stacklevel=2,
                )
            gates.linear3[0].weight.copy_(last["w3"])
            gates.bias[0].copy_(last["b"])
        else:
            for layer, part in enumerate(parts):
                gates.linear3[layer].weight.copy_(part["w3"])
                gates.bias[layer].copy_(part["b"])
    return gates


def _split_layer(layer: int, tensors: list[tuple[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One layer's six gate tensors, told apart by shape."""
    if len(tensors) != 6:
        names = ", ".join(key for key, _ in tensors)
        raise GateCheckpointError(f"layer {layer} has {len(tensors)} gate tensors, not 6: {names}")
    matrices = [t for _, t in tensors if t.dim() == 2]
    vectors = [t for _, t in tensors if t.dim() == 1]
    square = [m for m in matrices if m.shape[0] == m.shape[1]]
    if len(matrices) != 3 or len(vectors) != 3 or len(square) != 1:
        shapes = {key: tuple(t.shape) for key, t in tensors}
        raise GateCheckpointError(f"layer {layer}'s gate tensors are not rg10's shapes: {shapes}")
    width = square[0].shape[0]
    w1 = next(m for m in matrices if m.shape[0] == width and m is not square[0])
    w3 = next(m for m in matrices if m.shape[1] == width and m.shape[0] != width)
    biases = [v for v in vectors if v.shape[0] == width]
    readout_bias = [v for v in vectors if v.shape[0] == w3.shape[0]]
    if len(biases) != 2 or len(readout_bias) != 1:
        raise GateCheckpointError(f"layer {layer}'s gate biases are not rg10's shapes")
    # Which width-sized bias is b1 and which b2 only their names say.
    names = {id(t): key for key, t in tensors}
    first, second = sorted(biases, key=lambda t: _linear_number(names[id(t)]))
    return {"w1": w1, "b1": first, "w2": square[0], "b2": second, "w3": w3, "b": readout_bias[0]}


def _linear_number(key: str) -> int:
    numbers = re.findall(r"(\d+)", key.rsplit("retention_gate.", 1)[-1])
    return int(numbers[0]) if numbers else 0


def shipped_gates(hidden_size: int, num_layers: int, num_kv_heads: int) -> Path | None:
    """The folder of gates shipped in the package for a model of these shapes."""
    if not SHIPPED_DIR.is_dir():
        return None
    for folder in sorted(SHIPPED_DIR.iterdir()):
        config_path = folder / CONFIG_FILE
        if not config_path.is_file():
            continue
        gate = json.loads(config_path.read_text()).get("gate", {})
        if (gate.get("hidden_size"), gate.get("num_layers"), gate.get("num_kv_heads")) == (
            hidden_size, num_layers, num_kv_heads,
        ):
            return folder
    return None


def gates_for_model(
    gates: str | None, hidden_size: int, num_layers: int, num_kv_heads: int, model: str = ""
) -> RetentionGates:
    """The gates to serve a model with: ``gates`` if given, else the shipped ones."""
    folder = Path(gates) if gates else shipped_gates(hidden_size, num_layers, num_kv_heads)
    if folder is None:
        raise GateCheckpointError(
            f"policy 'learned' has no shipped gates for {model or 'this model'} (hidden size "
            f"{hidden_size}, {num_layers} layers, {num_kv_heads} KV heads); train some with "
            "'kvevict train-gates --model DIR --out GATES' and pass "
            "--kv-eviction-config '{\"policy_options\": {\"gates\": \"GATES\"}}'"
        )
    loaded = load_gates(folder)
    shape = (loaded.config.hidden_size, loaded.config.num_layers, loaded.config.num_kv_heads)
    if shape != (hidden_size, num_layers, num_kv_heads):
        raise GateCheckpointError(
            f"gates in {str(folder)!r} are for hidden size {shape[0]}, {shape[1]} layers, "
            f"{shape[2]} KV heads; {model or 'the model'} has {hidden_size}, {num_layers}, "
            f"{num_kv_heads}; train gates for it with kvevict train-gates"
        )
    return loaded
