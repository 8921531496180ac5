"""A tiny, randomly initialised Llama for tests vLLM's CPU platform can shard.

The default model (SmolLM2-135M: 9 query heads, 3 KV heads) cannot be split in
two, so tensor-parallel tests use this one instead: ``LlamaForCausalLM`` with
head_dim 32 (the smallest vLLM's CPU kernels take), 8 query heads and 4 KV
heads (2 per rank at TP=2), and the SmolLM2 tokenizer (copied from the default
model's directory), saved as fp32 safetensors.

The weights are drawn from one seeded generator, parameter by parameter in
name order, so the same parameters give the same bytes whatever transformers'
own initialisation does. They are chosen to keep greedy decoding away from
ties:

* queries and keys are large enough (``qk_std``) that attention is peaked, so
  which tokens a policy keeps changes the output, yet no single score is so
  large that softmax saturates;
* the residual branches are scaled by ``1/sqrt(fan_in)``, the embeddings have
  unit variance, and the LM head's rows are given widely varying norms
  (log-normal, ``lm_head_row_sigma``) on top of ``lm_head_std``: the
  arg-max is then mostly decided by a few large-norm rows, which widens the
  top-1/top-2 logit gap relative to the logits' spread (a plain Gaussian head
  over 49k tokens puts the gap near 0 often).

``tests/test_tensor_parallel.py`` measures the margin it gets.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

from vllm_kvevict.default_model import fetch_default_model
from vllm_kvevict.paths import build_lock, cache_dir

TINY_MODEL_NAME = "tiny-llama-hd32"
BUILD_MARKER = "kvevict_tiny.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
# Bumped whenever the initialisation code changes, so caches are rebuilt.
INIT_VERSION = 1

DEFAULT_SHAPE: dict[str, Any] = {
    "num_hidden_layers": 4,
    "hidden_size": 256,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 32,
    "intermediate_size": 512,
    "max_position_embeddings": 8192,
}
DEFAULT_INIT: dict[str, float] = {
    "qk_std": 0.12,
    "lm_head_std": 8.0,
    "lm_head_row_sigma": 1.0,
}


def _build_params(seed: int, shape: dict[str, Any], init: dict[str, float],
                  tokenizer_dir: Path) -> dict[str, Any]:
    return {
        "init_version": INIT_VERSION,
        "seed": seed,
        "shape": shape,
        "init": init,
        "tokenizer": str(tokenizer_dir),
    }


def _is_built(out_dir: Path, params: dict[str, Any]) -> bool:
    marker = out_dir / BUILD_MARKER
    if not (marker.is_file() and (out_dir / "config.json").is_file()
            and (out_dir / "model.safetensors").is_file()):
        return False
    try:
        return json.loads(marker.read_text()) == json.loads(json.dumps(params))
    except ValueError:
        return False


def _initialise(model: Any, seed: int, init: dict[str, float]) -> None:
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("embed_tokens.weight"):
                param.normal_(0.0, 1.0, generator=generator)
            elif name.endswith(("q_proj.weight", "k_proj.weight")):
                param.normal_(0.0, init["qk_std"], generator=generator)
            elif name == "lm_head.weight":
                fan_in = param.shape[1]
                param.normal_(0.0, init["lm_head_std"] / math.sqrt(fan_in), generator=generator)
                row_scale = torch.empty(param.shape[0], 1).normal_(
                    0.0, init["lm_head_row_sigma"], generator=generator
                ).exp_()
                param.mul_(row_scale)
            elif name.endswith(".weight") and param.dim() == 2:
                param.normal_(0.0, 1.0 / math.sqrt(param.shape[1]), generator=generator)
            else:
                raise ValueError(f"tiny model: no initialisation rule for {name}")


def build_tiny_llama(
    out_dir: str | Path,
    seed: int = 0,
    *,
    tokenizer_dir: str | Path | None = None,
    force: bool = False,
    **overrides: Any,
) -> Path:
    """Build (once) a seeded random ``LlamaForCausalLM`` in ``out_dir``; return it.

    ``overrides`` replace entries of :data:`DEFAULT_SHAPE` or
    :data:`DEFAULT_INIT`. The directory is reused when it was built with the same
    seed, shape, initialisation and tokenizer source.
    """
    out_dir = Path(out_dir)
    tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else fetch_default_model()
    unknown = set(overrides) - set(DEFAULT_SHAPE) - set(DEFAULT_INIT)
    if unknown:
        raise TypeError(f"build_tiny_llama: unknown parameters {sorted(unknown)}")
    shape = {k: overrides.get(k, v) for k, v in DEFAULT_SHAPE.items()}
    init = {k: float(overrides.get(k, v)) for k, v in DEFAULT_INIT.items()}
    params = _build_params(seed, shape, init, tokenizer_dir)
    if not force and _is_built(out_dir, params):
        return out_dir
    with build_lock(out_dir):
        if force or not _is_built(out_dir, params):  # or another process built it meanwhile
            _build(out_dir, seed, shape, init, tokenizer_dir, params)
    return out_dir


def _build(out_dir: Path, seed: int, shape: dict[str, Any], init: dict[str, float],
           tokenizer_dir: Path, params: dict[str, Any]) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        **shape,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        attention_bias=False,
        mlp_bias=False,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    _initialise(model, seed, init)

    staging = out_dir.with_name(out_dir.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    model.save_pretrained(staging)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, staging / name)
    (staging / BUILD_MARKER).write_text(json.dumps(params, indent=1))
    if out_dir.exists():
        shutil.rmtree(out_dir)
    staging.rename(out_dir)


def tiny_model_dir(num_key_value_heads: int = DEFAULT_SHAPE["num_key_value_heads"]) -> Path:
    name = TINY_MODEL_NAME
    if num_key_value_heads != DEFAULT_SHAPE["num_key_value_heads"]:
        name += f"-kv{num_key_value_heads}"
    return cache_dir() / "models" / name


def fetch_tiny_model(
    seed: int = 0,
    force: bool = False,
    num_key_value_heads: int = DEFAULT_SHAPE["num_key_value_heads"],
) -> Path:
    """The tiny model in the kvevict cache folder (built on first use).

    ``num_key_value_heads=1`` gives a multi-query variant: at tensor parallel 2
    vLLM replicates its one KV head on both ranks.
    """
    return build_tiny_llama(
        tiny_model_dir(num_key_value_heads), seed, force=force,
        num_key_value_heads=num_key_value_heads,
    )


def build_tiny_gates(model: Path, out: Path, seed: int = 0) -> Path:
    """Retention gates for the model's shapes, drawn from a seeded generator:
    log β spread over about (-5, -0.01), so retentions differ across tokens,
    heads and layers and one global ranking has something to rank."""
    import torch

    from vllm_kvevict.policies.gate_checkpoints import save_gates
    from vllm_kvevict.policies.retention_gate import RetentionGateConfig, RetentionGates

    config = json.loads((model / "config.json").read_text())
    gate_config = RetentionGateConfig(
        hidden_size=config["hidden_size"], num_layers=config["num_hidden_layers"],
        num_kv_heads=config["num_key_value_heads"], width=32, bias_init=3.0,
        activation=config.get("hidden_act", "silu"), tie_readout=True,
    )
    gates = RetentionGates(gate_config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(gates.named_parameters()):
            if name.startswith("bias"):
                param.fill_(gate_config.bias_init)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                scale = (2.0 if name.startswith("linear3") else 1.0) / math.sqrt(param.shape[1])
                param.normal_(0.0, scale, generator=generator)
    save_gates(out, gates, {"model": "tiny random model", "seed": seed})
    return out
