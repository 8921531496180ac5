"""The GPU payload: vLLM's CUDA build and what it needs, for a GPU machine
that has PyTorch and Triton but no vLLM and no package registry, in one
archive small enough to travel with this repository in one 64 MiB copy.

Three commands::

    python scripts/gpu_payload.py build     # where PyPI is reachable
    python scripts/gpu_payload.py check     # the archive against its manifest,
                                            # and its size with the working tree
    python scripts/gpu_payload.py unpack DEST   # on the GPU machine
                                            # (scripts/gpu_check.sh --stage 2 runs it)

``build`` installs, without pip on the GPU machine ever running, into one
tree (``site/``, put on ``PYTHONPATH``):

* vLLM's CUDA wheel, less what the plugin's path never loads (``PRUNED``);
  its compiled ops ``vllm/_C_stable_libtorch.abi3.so`` cut to the Hopper code
  (``cut_fat_binaries``: per fat binary the sm_90/sm_90a cubins, or its newest
  PTX for an older architecture where it has none) and stripped of symbols;
  FlashAttention 3 (``_vllm_fa3_C``, Hopper cubins only) stripped of symbols,
  so the full-cache baseline runs on ``FLASH_ATTN`` as users run it;
* the runtime dependencies of vLLM and of this plugin that the GPU image
  lacks, resolved for CPython ``--python-version`` (the walk leaves out the
  GPU stack, the image's packages and the kernel libraries of other
  backends, and what only they require);
* this repository's wheel (its entry point registers the plugin; the checks
  run the working tree's code on top of it by default);
* the default model's tokenizer files (``tokenizer/``), from which the test
  models are built on the machine.

It is packed as ``payload.tar.xz`` beside ``MANIFEST.json`` (sha256, size, and
the recipe's key: a payload built by another recipe, vLLM or Python is
stale), and ``site/PAYLOAD.md`` inside records what was cut, pruned, carried
and left out, and why.

Beside it, ``build`` also packs vLLM's compiled ops uncut
(``gpu-payload-original-c/``, 54 MiB): the fallback should the cut ones fail
on a GPU. The two do not fit one copy together: a first run unpacks the
payload (``unpack``), a second one, started while the machine keeps its
files, brings the uncut ops (``unpack --original-c DIR``: the payload
already unpacked in DEST is reused, its recipe checked from its own copy of
the manifest).
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import hashlib
import io
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FORMAT = 2
VLLM_VERSION = "0.32.0"
PYTHON_VERSION = "3.12"  # the GPU image's python3 is 3.12.3
GLIBC = "2.35"
DEFAULT_OUT = ROOT / "build" / "gpu-payload"
TRANSFER_LIMIT = 64 * 2**20  # the most one copy to the GPU machine carries, working tree included

# Parts of vLLM's wheel that the path of a Llama served with the plugin's
# Triton backend (or vLLM's FLASH_ATTN for the full cache) never loads: each
# is imported under try/except or only by the models and features that use it.
PRUNED = {
    "vllm/vllm_flash_attn/_vllm_fa2_C*.so": "FlashAttention 2 (FA3 serves Hopper)",
    "vllm/_moe_C_stable_libtorch*.so": "fused MoE kernels (MoE models)",
    "vllm/vllm-rs": "Rust front end (opt-in)",
    "vllm/third_party/deep_gemm/*": "DeepGEMM (FP8 GEMM; VLLM_USE_DEEP_GEMM=0)",
    "vllm/third_party/fmha_sm100/*": "SM100 sparse attention",
    "vllm/_flashmla_C*.so": "FlashMLA (MLA models)",
    "vllm/_flashmla_extension_C*.so": "FlashMLA (MLA models)",
    "vllm/_deepselect_C*.so": "DeepSeek sparse indexer",
    "vllm/_flashkda_C*.so": "Kimi delta attention",
    "vllm/_qutlass_C*.so": "QuTLASS (FP4 quantization)",
}
# Cut to the Hopper code, then stripped.
CUT = ("vllm/_C_stable_libtorch.abi3.so",)
# Already Hopper-only: symbols stripped.
STRIPPED = ("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so",)
KEEP_ARCH = 90

# The GPU stack the image provides, and kernel libraries of backends and
# features the plugin's path does not use.
GPU_STACK = {"torch", "torchvision", "torchaudio", "triton", "numpy"}
GPU_STACK_PREFIXES = ("nvidia-", "cuda-")
KERNEL_LIBS = {
    "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "tilelang", "quack-kernels",
    "tokenspeed-mla", "humming-kernels", "fastsafetensors", "instanttensor", "torchcodec",
    "pynvvideocodec", "flash-attn", "xformers", "deep-gemm",
}
# Loaded neither by an offline engine with eviction nor by `vllm serve`
# answering a completion (measured with python -X importtime on vLLM's CPU
# build); carried with --all-deps.
NOT_LOADED = {
    "mistral-common", "anthropic", "mcp", "mcp-types", "outlines-core", "lm-format-enforcer",
    "fastapi-cloud-cli", "sentry-sdk", "depyf",
}
# The GPU image's Python packages (its 'cuda' image, read on 2026-11-17).
IMAGE = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt
jax-cuda13-plugin jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes
mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind narwhals networkx ninja numba
numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout
pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools
shellingham simplejson six sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server
tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch torchaudio torchdiffeq
torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer typing-extensions
typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
"""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def canon(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def fail(message: str) -> None:
    raise SystemExit(f"gpu_payload: {message}")


# --------------------------------------------------------------------------- fat binaries

FATBIN_MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2


@dataclasses.dataclass(frozen=True)
class FatEntry:
    """One entry of a fat binary: a cubin (``KIND_ELF``) or PTX for ``arch``."""

    start: int  # offset of the entry's header in the file
    length: int  # header and payload
    kind: int
    arch: int


@dataclasses.dataclass(frozen=True)
class FatBinary:
    start: int  # offset of its 16-byte header in the file
    header_size: int
    body_size: int  # the entries that follow the header
    entries: tuple[FatEntry, ...]


def elf_section(data: bytes | bytearray, name: str) -> tuple[int, int] | None:
    """``(file offset, size)`` of the ELF64 section ``name``, or None."""
    if data[:4] != b"\x7fELF" or data[4] != 2:
        fail("not an ELF64 file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    entsize, count, names_index = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * entsize) for i in range(count)]
    names_offset = headers[names_index][4]
    for name_offset, _type, _flags, _addr, offset, size in headers:
        start = names_offset + name_offset
        if data[start:data.index(b"\0", start)].decode() == name:
            return offset, size
    return None


def fat_binaries(data: bytes | bytearray, offset: int, size: int) -> list[FatBinary]:
    """The fat binaries laid out in ``data[offset:offset + size]`` (a
    ``.nv_fatbin`` section: 8-byte aligned, zero padding between them).

    Header (16 bytes): magic 0xBA55ED50, version (u16), header size (u16), size
    of the entries that follow (u64). Entry header: kind (u16: 1 PTX, 2 ELF),
    version (u16), header size (u32), payload size (u64), ..., architecture
    (u32 at byte 28, e.g. 90).
    """
    out, pos, end = [], offset, offset + size
    while pos + 16 <= end:
        magic, _version, header_size, body_size = struct.unpack_from("<IHHQ", data, pos)
        if magic != FATBIN_MAGIC:
            if any(data[pos:pos + 8]):
                fail(f"unexpected bytes at offset {pos:#x} of the fat-binary section")
            pos += 8
            continue
        entries, cursor, body_end = [], pos + header_size, pos + header_size + body_size
        while cursor < body_end:
            kind, _entry_version, entry_header, payload = struct.unpack_from("<HHIQ", data, cursor)
            (arch,) = struct.unpack_from("<I", data, cursor + 28)
            if kind not in (KIND_PTX, KIND_ELF) or entry_header < 32 or cursor + entry_header + payload > body_end:
                fail(f"malformed fat-binary entry at offset {cursor:#x}")
            entries.append(FatEntry(cursor, entry_header + payload, kind, arch))
            cursor += entry_header + payload
        out.append(FatBinary(pos, header_size, body_size, tuple(entries)))
        pos = body_end
    return out


def entries_to_keep(fat: FatBinary, arch: int = KEEP_ARCH) -> tuple[FatEntry, ...]:
    """The ``arch`` cubins; else the newest PTX at most ``arch`` (the driver
    compiles it); else every entry (the fat binary has no code this GPU can
    run and stays as it is)."""
    cubins = tuple(e for e in fat.entries if e.kind == KIND_ELF and e.arch == arch)
    if cubins:
        return cubins
    ptx = [e for e in fat.entries if e.kind == KIND_PTX and e.arch <= arch]
    if ptx:
        return (max(ptx, key=lambda e: e.arch),)
    return fat.entries


def cut_fat_binaries(data: bytearray, arch: int = KEEP_ARCH) -> dict[str, int]:
    """Keep, in place, only ``entries_to_keep`` of every fat binary of the
    ``.nv_fatbin`` section: the kept entries move to the front of the fat
    binary, its size field says their length and the rest is zeroed. Offsets
    and sizes of the sections, and every byte outside the fat binaries'
    bodies, stay the same (the host code registers each fat binary by its
    address). Returns counts for the record."""
    section = elf_section(data, ".nv_fatbin")
    if section is None:
        fail("no .nv_fatbin section")
    stats = {"fat_binaries": 0, "entries": 0, "kept": 0, "without_code_for_arch": 0,
             "bytes_before": 0, "bytes_after": 0}
    for fat in fat_binaries(data, *section):
        keep = entries_to_keep(fat, arch)
        body = b"".join(bytes(data[e.start:e.start + e.length]) for e in keep)
        start = fat.start + fat.header_size
        data[start:start + fat.body_size] = body + bytes(fat.body_size - len(body))
        struct.pack_into("<Q", data, fat.start + 8, len(body))
        stats["fat_binaries"] += 1
        stats["entries"] += len(fat.entries)
        stats["kept"] += len(keep)
        stats["without_code_for_arch"] += not any(e.arch <= arch if e.kind == KIND_PTX else e.arch == arch
                                                  for e in fat.entries)
        stats["bytes_before"] += fat.body_size
        stats["bytes_after"] += len(body)
    return stats


def strip_symbols(path: Path) -> None:
    subprocess.run(["strip", "--strip-all", str(path)], check=True)


# --------------------------------------------------------------------------- the recipe


def plugin_metadata() -> dict[str, object]:
    """pyproject.toml's runtime dependencies and entry points: what the
    payload's copy of the plugin's metadata must agree with."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {"dependencies": project["dependencies"], "entry-points": project.get("entry-points", {})}


def recipe(python_version: str, glibc: str, all_deps: bool, image: set[str]) -> dict[str, object]:
    """Everything a payload's contents depend on; its sha256 is the payload's key."""
    return {
        "format": FORMAT,
        "vllm": VLLM_VERSION,
        "python": python_version,
        "glibc": glibc,
        "all_deps": all_deps,
        "pruned": sorted(PRUNED),
        "cut": [*CUT, KEEP_ARCH],
        "stripped": list(STRIPPED),
        "excluded": sorted(GPU_STACK | KERNEL_LIBS | (set() if all_deps else NOT_LOADED)),
        "image": sorted(image),
        "plugin": plugin_metadata(),
    }


def recipe_key(spec: dict[str, object]) -> str:
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()


def image_packages(path: str | None) -> set[str]:
    if path:
        names = [re.split(r"[=<>!~ @;]", line.strip(), maxsplit=1)[0] for line in open(path)]
        return {canon(n) for n in names if n and not n.startswith("#")}
    return {canon(n) for n in IMAGE.split()}


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


# --------------------------------------------------------------------------- build


def pip(python: str, *args: str) -> None:
    subprocess.run([python, "-m", "pip", "--disable-pip-version-check", *args], check=True)


def target_args(python_version: str, glibc: str) -> list[str]:
    minor = int(glibc.split(".")[1])
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(minor, 16, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    cp = "cp" + python_version.replace(".", "")
    args = ["--only-binary=:all:", "--python-version", python_version, "--implementation", "cp",
            "--abi", cp, "--abi", "abi3", "--abi", "none"]
    for platform in platforms:
        args += ["--platform", platform]
    return args


def resolve_dependencies(python: str, vllm_wheel: Path, work: Path, python_version: str, glibc: str,
                         all_deps: bool, image: set[str]) -> tuple[list[str], list[str]]:
    """The pins to carry (``name==version``) and the record's lines: the
    requirements of vLLM and of the plugin, resolved by pip for the target
    Python, walked from the roots without entering an excluded project, so
    what only an excluded project requires stays out."""
    from packaging.requirements import Requirement

    def why_excluded(name: str) -> str | None:
        name = canon(name)
        if name in GPU_STACK or name.startswith(GPU_STACK_PREFIXES):
            return "GPU stack (the image's)"
        if name in KERNEL_LIBS:
            return "kernel library of another backend or feature"
        if name in image:
            return "on the GPU image"
        if name in NOT_LOADED and not all_deps:
            return "loaded neither by an offline engine nor by vllm serve (--all-deps carries it)"
        return None

    env = {
        "python_version": python_version, "python_full_version": python_version + ".0",
        "platform_machine": "x86_64", "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix",
        "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": "",
    }
    with zipfile.ZipFile(vllm_wheel) as archive:
        metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
    requirements = [("vllm", line.split(":", 1)[1].strip())
                    for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
    requirements += [("vllm-kvevict", text) for text in plugin_metadata()["dependencies"]]
    roots, excluded = [], {}
    for parent, text in requirements:
        req = Requirement(text)
        if req.marker is not None and not req.marker.evaluate(env):
            continue
        reason = why_excluded(req.name)
        if reason:
            excluded.setdefault(canon(req.name), (parent, str(req), reason))
        else:
            roots.append((parent, req))
    (work / "roots.txt").write_text("".join(f"{req}\n" for _, req in roots))
    report = work / "resolution.json"
    result = subprocess.run(
        [python, "-m", "pip", "--disable-pip-version-check", "install", "--dry-run", "--ignore-installed",
         "--quiet", "--report", str(report), "--target", str(work / "dry-run"),
         *target_args(python_version, glibc), "-r", str(work / "roots.txt")],
        capture_output=True, text=True,
    )
    if result.returncode != 0:
        fail("pip could not resolve the dependencies for Python " + python_version + ":\n" + result.stderr[-4000:])
    items = {canon(i["metadata"]["name"]): i for i in json.loads(report.read_text())["install"]}
    chosen: dict[str, tuple[str, set[str]]] = {}
    queue = [(parent, req, "") for parent, req in roots]
    while queue:
        parent, req, extra = queue.pop()
        name = canon(req.name)
        if req.marker is not None and not req.marker.evaluate({**env, "extra": extra}):
            continue
        reason = why_excluded(name)
        if reason:
            excluded.setdefault(name, (parent, str(req), reason))
            continue
        if name not in items:
            fail(f"{req} (required by {parent}) is missing from pip's resolution")
        first_visit = name not in chosen
        seen = chosen.setdefault(name, (parent, set()))[1]
        new_extras = set(req.extras) - seen
        if not first_visit and not new_extras:
            continue
        seen.update(new_extras)
        for dep in items[name]["metadata"].get("requires_dist", []):
            for wanted in ([""] if first_visit else []) + sorted(new_extras):
                queue.append((name, Requirement(dep), wanted))
    pins = [f"{items[n]['metadata']['name']}=={items[n]['metadata']['version']}" for n in sorted(chosen)]
    lines = [f"- {pin} (for {chosen[canon(pin.split('==')[0])][0]})" for pin in pins]
    lines += [""] + [f"- left out: {req} — {reason} (for {parent})"
                     for _, (parent, req, reason) in sorted(excluded.items())]
    return pins, lines


def build_plugin_wheel(python: str, out: Path) -> Path:
    """This repository's wheel, from a copy of the files git tracks or would
    track (committed or not): a build/ folder in the tree could hold modules
    deleted since."""
    source = out / "source"
    shutil.rmtree(source, ignore_errors=True)
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                           cwd=ROOT, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        path = ROOT / name.decode()
        if path.is_file():
            (source / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, source / name.decode())
    wheels = out / "plugin-wheel"
    shutil.rmtree(wheels, ignore_errors=True)
    pip(python, "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(source))
    shutil.rmtree(source)
    return next(wheels.glob("vllm_kvevict-*.whl"))


def prune(site: Path) -> list[str]:
    lines = []
    for pattern, why in PRUNED.items():
        matched = [p for p in site.glob(pattern.replace("/*", "")) if p.exists()]
        if not matched:
            fail(f"nothing in vLLM {VLLM_VERSION} matches {pattern}: update PRUNED")
        for path in matched:
            size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else path.stat().st_size
            shutil.rmtree(path) if path.is_dir() else path.unlink()
            lines.append(f"- pruned `{path.relative_to(site)}` ({size / 2**20:.1f} MiB): {why}")
    return lines


def relocate_scripts(site: Path) -> None:
    """pip --target writes console scripts with this interpreter's path: run
    them with the python3 on the GPU machine's PATH instead."""
    for script in (site / "bin").glob("*"):
        text = script.read_bytes()
        if text.startswith(b"#!"):
            script.write_bytes(b"#!/usr/bin/env python3\n" + text.split(b"\n", 1)[1])


def pack_original_c(vllm_wheel: Path, folder: Path) -> None:
    """vLLM's compiled ops as the wheel has them, xz-packed, with a manifest."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    packed = folder / (Path(CUT[0]).name + ".xz")
    with zipfile.ZipFile(vllm_wheel) as wheel, open(packed, "wb") as handle:
        data = wheel.read(CUT[0])
        handle.write(subprocess.run(["xz", "-9", "-T0", "-c"], input=data, capture_output=True, check=True).stdout)
    (folder / "MANIFEST.json").write_text(json.dumps({
        "format": FORMAT, "vllm": VLLM_VERSION, "path": CUT[0], "archive": packed.name,
        "sha256": sha256_file(packed), "bytes": packed.stat().st_size,
        "unpacked_sha256": hashlib.sha256(data).hexdigest(),
    }, indent=1) + "\n")
    print(f"{packed}: {packed.stat().st_size / 2**20:.1f} MiB (the uncut compiled ops, the fallback)")


def build(args: argparse.Namespace) -> int:
    out = Path(args.out).resolve()
    python = args.python or sys.executable
    image = image_packages(args.image_packages)
    spec = recipe(args.python_version, args.glibc, args.all_deps, image)
    # Downloads are kept beside the payload (not in it: the payload's folder is what travels).
    downloads, work = out.with_name(out.name + "-downloads"), out.with_name(out.name + "-work")
    stage = work / "stage"
    site = stage / "site"
    for folder in (downloads / "vllm", downloads / "deps"):
        folder.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(work, ignore_errors=True)
    site.mkdir(parents=True)
    target = target_args(args.python_version, args.glibc)

    print(f"== vLLM {VLLM_VERSION} (CUDA wheel)", flush=True)
    pip(python, "download", "--quiet", "--no-deps", "--only-binary=:all:", "--platform", "manylinux_2_28_x86_64",
        "--python-version", args.python_version, "--implementation", "cp", "-d", str(downloads / "vllm"),
        f"vllm=={VLLM_VERSION}")
    vllm_wheel = next(downloads.glob(f"vllm/vllm-{VLLM_VERSION}-*manylinux*x86_64.whl"))

    print(f"== dependencies the GPU image lacks (CPython {args.python_version}, glibc <= {args.glibc})", flush=True)
    pins, dependency_lines = resolve_dependencies(python, vllm_wheel, work, args.python_version, args.glibc,
                                                  args.all_deps, image)
    (work / "pins.txt").write_text("\n".join(pins) + "\n")
    pip(python, "download", "--quiet", "--no-deps", *target, "-d", str(downloads / "deps"), "-r", str(work / "pins.txt"))
    wanted = {canon(p.split("==")[0]): p.split("==")[1] for p in pins}
    dep_wheels = [w for w in downloads.glob("deps/*.whl")
                  if wanted.get(canon(w.name.split("-")[0])) == w.name.split("-")[1]]
    if len(dep_wheels) != len(pins):
        fail(f"{len(pins)} dependencies resolved, {len(dep_wheels)} wheels downloaded")

    print("== this repository's wheel", flush=True)
    plugin_wheel = build_plugin_wheel(python, work)

    print(f"== one tree: {len(dep_wheels) + 2} wheels", flush=True)
    pip(python, "install", "--quiet", "--no-deps", "--no-compile", "--target", str(site), *target,
        str(vllm_wheel), str(plugin_wheel), *map(str, dep_wheels))
    relocate_scripts(site)
    record = [f"# GPU payload (format {FORMAT})", "",
              f"Built {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} by scripts/gpu_payload.py for CPython "
              f"{args.python_version}, manylinux x86_64 up to glibc {args.glibc}; recipe {recipe_key(spec)[:16]}.",
              "", f"## vLLM {VLLM_VERSION} (CUDA wheel {vllm_wheel.name}, {vllm_wheel.stat().st_size / 2**20:.0f} MiB)", ""]
    record += prune(site)
    for name in CUT:
        path = site / name
        before = path.stat().st_size
        data = bytearray(path.read_bytes())
        stats = cut_fat_binaries(data, KEEP_ARCH)
        path.write_bytes(data)
        strip_symbols(path)
        record.append(
            f"- cut `{name}` to sm_{KEEP_ARCH} and stripped: {before / 2**20:.1f} -> {path.stat().st_size / 2**20:.1f} "
            f"MiB; {stats['fat_binaries']} fat binaries, {stats['kept']} of {stats['entries']} entries kept "
            f"({stats['bytes_before'] / 2**20:.1f} -> {stats['bytes_after'] / 2**20:.1f} MiB), "
            f"{stats['without_code_for_arch']} with neither sm_{KEEP_ARCH} cubins nor older PTX left as they are")
    for name in STRIPPED:
        path = site / name
        before = path.stat().st_size
        strip_symbols(path)
        record.append(f"- stripped `{name}`: {before / 2**20:.1f} -> {path.stat().st_size / 2**20:.1f} MiB")
    record += ["", f"## Dependencies carried ({len(pins)}) and left out", ""] + dependency_lines
    record += ["", f"## This plugin: {plugin_wheel.name} (entry point; the checks serve the working tree's code)"]

    tokenizer_dir = Path(args.tokenizer_dir) if args.tokenizer_dir else None
    if tokenizer_dir is None:
        sys.path.insert(0, str(ROOT))
        from vllm_kvevict.default_model import fetch_default_model

        tokenizer_dir = fetch_default_model()
    (stage / "tokenizer").mkdir()
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, stage / "tokenizer" / name)
    if not (stage / "tokenizer" / "tokenizer.json").is_file():
        fail(f"no tokenizer.json in {tokenizer_dir}")
    record += ["", f"## tokenizer/: the default model's tokenizer files, from {tokenizer_dir}"]
    (site / "PAYLOAD.md").write_text("\n".join(record) + "\n")
    shutil.copy2(site / "PAYLOAD.md", out / "PAYLOAD.md")  # readable without unpacking
    for cache in site.rglob("__pycache__"):
        shutil.rmtree(cache)

    print("== payload.tar.xz", flush=True)
    archive = out / "payload.tar.xz"
    unpacked = sum(f.stat().st_size for f in stage.rglob("*") if f.is_file())
    with open(archive, "wb") as handle:
        tar = subprocess.Popen(["tar", "-C", str(stage), "--sort=name", "--owner=0", "--group=0",
                                "-cf", "-", "site", "tokenizer"], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-9", "-T0", "-c"], stdin=tar.stdout, stdout=handle, check=True)
        if tar.wait() != 0:
            fail("tar failed")
    manifest = {
        "format": FORMAT, "recipe_sha256": recipe_key(spec), "recipe": spec,
        "archive": archive.name, "sha256": sha256_file(archive), "bytes": archive.stat().st_size,
        "unpacked_bytes": unpacked, "built": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
        "revision": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                   text=True).stdout.strip(),
    }
    (out / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    pack_original_c(vllm_wheel, out.with_name(out.name + "-original-c"))
    shutil.rmtree(work)
    if args.verbose:
        print((out / "PAYLOAD.md").read_text())
    print(f"{archive}: {manifest['bytes'] / 2**20:.1f} MiB ({unpacked / 2**20:.0f} MiB unpacked)")
    return check(argparse.Namespace(payload=str(out), python_version=args.python_version, glibc=args.glibc,
                                    all_deps=args.all_deps, image_packages=args.image_packages))


# --------------------------------------------------------------------------- check and unpack


def verified_archive(payload: Path, spec: dict[str, object]) -> tuple[Path, dict[str, object]]:
    """The archive, after its manifest, sha256, size and recipe are checked;
    every problem is one line naming the fix."""
    rebuild = "build it where PyPI is reachable: python scripts/gpu_payload.py build"
    manifest_path = payload / "MANIFEST.json"
    if not manifest_path.is_file():
        fail(f"no GPU payload in {payload} (no MANIFEST.json); {rebuild}")
    manifest = verified_manifest(json.loads(manifest_path.read_text()), payload, spec)
    archive = payload / manifest["archive"]
    if not archive.is_file():
        fail(f"{archive} is missing; {rebuild}")
    if archive.stat().st_size != manifest["bytes"] or sha256_file(archive) != manifest["sha256"]:
        fail(f"{archive} differs from MANIFEST.json (size or sha256): copied incompletely; copy it again or {rebuild}")
    return archive, manifest


def verified_manifest(manifest: dict[str, object], payload: Path, spec: dict[str, object]) -> dict[str, object]:
    """``manifest``, if its format and recipe are this checkout's."""
    rebuild = "build it where PyPI is reachable: python scripts/gpu_payload.py build"
    if manifest.get("format") != FORMAT:
        fail(f"the payload in {payload} has format {manifest.get('format')}, this checkout reads {FORMAT}; {rebuild}")
    if manifest["recipe_sha256"] != recipe_key(spec):
        built = manifest.get("recipe", {})
        differs = sorted(k for k in set(built) | set(spec) if built.get(k) != spec.get(k))
        fail(f"the payload in {payload} is stale (built {manifest.get('built')} from {manifest.get('revision')}; "
             f"differs in {', '.join(differs) or 'its key'}); {rebuild}")
    return manifest


def working_tree_bytes() -> int:
    """What travels with the payload: the files git tracks or would track."""
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.split(b"\0")
    return sum((ROOT / f.decode()).stat().st_size for f in files if f and (ROOT / f.decode()).is_file())


def check(args: argparse.Namespace) -> int:
    payload = Path(args.payload)
    spec = recipe(args.python_version, args.glibc, args.all_deps, image_packages(args.image_packages))
    archive, manifest = verified_archive(payload, spec)
    tree = working_tree_bytes()
    total = tree + manifest["bytes"] + (payload / "MANIFEST.json").stat().st_size
    print(f"{archive}: matches MANIFEST.json and this checkout's recipe; {manifest['bytes'] / 2**20:.1f} MiB "
          f"+ working tree {tree / 2**20:.1f} MiB = {total / 2**20:.1f} MiB of {TRANSFER_LIMIT / 2**20:.0f} MiB")
    if total > TRANSFER_LIMIT:
        fail(f"payload and working tree are {total / 2**20:.1f} MiB, over the {TRANSFER_LIMIT / 2**20:.0f} MiB "
             "one copy carries")
    return 0


def unpack(args: argparse.Namespace) -> int:
    """Check the payload, then unpack it into DEST (once per archive: DEST
    keeps a copy of the manifest, and a payload unpacked there already is
    reused, also when the payload itself did not travel this time); with
    ``--original-c``, put the uncut compiled ops in place."""
    payload, dest = Path(args.payload), Path(args.dest)
    spec = recipe(args.python_version, args.glibc, args.all_deps, image_packages(args.image_packages))
    unpacked = dest / "MANIFEST.json"
    if not (payload / "MANIFEST.json").is_file() and unpacked.is_file():
        verified_manifest(json.loads(unpacked.read_text()), dest, spec)
        print(f"{dest}: the payload unpacked there before (built {json.loads(unpacked.read_text())['built']})")
    else:
        archive, manifest = verified_archive(payload, spec)
        if not (unpacked.is_file() and json.loads(unpacked.read_text())["sha256"] == manifest["sha256"]):
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            start = time.monotonic()
            subprocess.run(["tar", "-C", str(dest), "-xJf", str(archive)], check=True)
            shutil.copy2(payload / "MANIFEST.json", unpacked)
            print(f"{dest}: unpacked {manifest['unpacked_bytes'] / 2**20:.0f} MiB in {time.monotonic() - start:.1f}s "
                  f"(built {manifest['built']} from {manifest['revision']})")
        else:
            print(f"{dest}: this payload is unpacked there already")
    if args.original_c:
        folder = Path(args.original_c)
        if not (folder / "MANIFEST.json").is_file():
            fail(f"no MANIFEST.json in {folder}; build it where PyPI is reachable: python scripts/gpu_payload.py build")
        manifest = json.loads((folder / "MANIFEST.json").read_text())
        packed = folder / manifest["archive"]
        if manifest["vllm"] != VLLM_VERSION or manifest["format"] != FORMAT:
            fail(f"{folder} holds vLLM {manifest['vllm']}'s ops (format {manifest['format']}), this checkout serves "
                 f"{VLLM_VERSION}; rebuild it: python scripts/gpu_payload.py build")
        if not packed.is_file() or sha256_file(packed) != manifest["sha256"]:
            fail(f"{packed} differs from its MANIFEST.json: copy it again")
        data = subprocess.run(["xz", "-dc", str(packed)], capture_output=True, check=True).stdout
        if hashlib.sha256(data).hexdigest() != manifest["unpacked_sha256"]:
            fail(f"{packed} does not unpack to the recorded file: copy it again")
        (dest / "site" / manifest["path"]).write_bytes(data)
        print(f"{dest}: {manifest['path']} replaced by the uncut one ({len(data) / 2**20:.1f} MiB)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--python-version", default=PYTHON_VERSION, help="the GPU machine's Python, X.Y")
    common.add_argument("--glibc", default=GLIBC, help="newest manylinux glibc accepted")
    common.add_argument("--all-deps", action="store_true", help="also carry the dependencies vLLM does not load")
    common.add_argument("--image-packages", metavar="FILE",
                        help="names on the GPU image, one a line ('pip freeze'), instead of the built-in list")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("build", parents=[common], help="build payload.tar.xz and MANIFEST.json")
    p.add_argument("--out", default=str(DEFAULT_OUT))
    p.add_argument("--python", help="the interpreter whose pip downloads and installs (default: this one)")
    p.add_argument("--tokenizer-dir", help="tokenizer files to carry (default: the default model's)")
    p.add_argument("--verbose", action="store_true", help="print the payload's record")
    p = commands.add_parser("check", parents=[common], help="check the payload and its size with the working tree")
    p.add_argument("payload", nargs="?", default=str(DEFAULT_OUT))
    p = commands.add_parser("unpack", parents=[common], help="check the payload and unpack it into DEST")
    p.add_argument("dest")
    p.add_argument("--payload", default=str(DEFAULT_OUT))
    p.add_argument("--original-c", metavar="DIR", help="put the uncut compiled ops from DIR in place")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"\d+\.\d+", args.python_version):
        fail("--python-version X.Y")
    return {"build": build, "check": check, "unpack": unpack}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
