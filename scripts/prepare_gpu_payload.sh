#!/usr/bin/env bash
# Build the files a GPU machine without a package registry needs to serve this
# plugin with vLLM's CUDA build (scripts/gpu_check.sh --payload DIR installs them).
# Run it on a machine that reaches PyPI; see --help.
set -euo pipefail

usage() {
    cat <<'EOF'
Usage: bash scripts/prepare_gpu_payload.sh [options]

Builds, for an x86_64 Linux machine with an NVIDIA GPU, PyTorch and Triton but
no vLLM and no package registry:

  1. vLLM's CUDA wheel (vllm==VERSION, manylinux_2_28_x86_64), stripped of what
     the plugin's Triton attention backend never loads: FlashAttention 2 and 3
     (vllm/vllm_flash_attn/*.so), the MoE kernels (_moe_C_stable_libtorch), the
     Rust front end (vllm-rs), DeepGEMM and the SM100 FMHA sources
     (vllm/third_party/deep_gemm, fmha_sm100), FlashMLA, DeepSelect, FlashKDA and
     QuTLASS. vLLM imports each of these under try/except or only for the
     models and features that use them. Repacked as a valid wheel (RECORD
     rewritten); what was removed is listed in STRIPPED.txt inside the payload.
  2. The wheels of vLLM's and the plugin's runtime dependencies that the GPU
     image lacks, for CPython --python-version on manylinux (glibc up to
     --glibc), found by walking the requirements from vLLM's METADATA and
     skipping the excluded projects below (and what only they require).
  3. This repository's own wheel (pip wheel --no-deps, from a copy of the files
     git tracks or would track, committed or not).
  4. The default model's tokenizer files (tokenizer/): the tiny test model that
     scripts/gpu_serve_check.py serves is built from them.

Everything is put in one gzipped tar, split into parts of at most --part-size
bytes (so that a part and this repository's working tree fit in 64 MiB, the most
some GPU machines take in one copy), with a MANIFEST holding the sha256 and
size of each part and of the reassembled tar.

Excluded dependencies (never downloaded; listed in DEPENDENCIES.txt):
  GPU stack, the image's own:  torch torchvision torchaudio triton numpy,
                               nvidia-* and cuda-* (CUDA runtime wheels)
  kernel libraries of other backends and features (FlashInfer, TileLang,
  CUTLASS DSL, ...): flashinfer-python flashinfer-cubin flashinfer-jit-cache
                     tilelang quack-kernels tokenspeed-mla humming-kernels
                     fastsafetensors instanttensor torchcodec pynvvideocodec
                     flash-attn xformers deep-gemm
  present on the GPU image (reused as they are; numba and llvmlite among them):
                     the list read off the 'cuda' image on 2026-11-17, or the
                     names in --image-packages FILE
  loaded neither by an offline engine with eviction nor by 'vllm serve'
  answering a completion (measured with python -X importtime on vLLM's CPU
  build; --all-deps carries them): mistral-common (Mistral tokenizers, and
  with it pycountry) anthropic mcp mcp-types (and with them cryptography)
  outlines-core lm-format-enforcer (other structured-output backends)
  fastapi-cloud-cli sentry-sdk depyf
What only excluded projects require is left out with them.
Installed with --no-deps, so a version the image holds that a new package
does not accept shows only at run time: gpu_check.sh runs 'pip check' and keeps
its report.

Options:
  --out DIR              output folder (default build/gpu-payload, git-ignored):
                         DIR/parts/ is what to carry, DIR/downloads/ a cache
  --vllm-version V       default 0.32.0
  --python-version X.Y   the GPU machine's Python (default 3.12: the image's
                         python3 is 3.12.3)
  --glibc X.Y            newest manylinux glibc accepted (default 2.35)
  --part-size SIZE       split's -b size (default 56M: a part and a ~6 MiB
                         working tree stay under 64 MiB)
  --all-deps             also carry the dependencies vLLM does not load here
  --image-packages FILE  names present on the GPU image, one a line ('pip
                         freeze' output, as in the last section of gpu_check.sh's
                         env.txt), instead of the built-in list
  --tokenizer-dir DIR    tokenizer files to carry (default: the default model's
                         folder, converted by 'kvevict fetch-model' if needed)
  --python PY            the Python whose pip downloads (default: .venv/bin/python
                         if present, else python3)
  -h, --help             this text
EOF
}

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="build/gpu-payload"
VLLM_VERSION="0.32.0"
PY_VERSION="3.12"
GLIBC="2.35"
PART_SIZE="56M"
IMAGE_PACKAGES=""
ALL_DEPS=0
TOKENIZER_DIR=""
PY=""
while [ $# -gt 0 ]; do
    case "$1" in
        --out) OUT="$2"; shift 2 ;;
        --vllm-version) VLLM_VERSION="$2"; shift 2 ;;
        --python-version) PY_VERSION="$2"; shift 2 ;;
        --glibc) GLIBC="$2"; shift 2 ;;
        --part-size) PART_SIZE="$2"; shift 2 ;;
        --image-packages) IMAGE_PACKAGES="$(cd "$(dirname "$2")" && pwd)/$(basename "$2")"; shift 2 ;;
        --all-deps) ALL_DEPS=1; shift ;;
        --tokenizer-dir) TOKENIZER_DIR="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "prepare_gpu_payload.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
cd "$ROOT"
if [ -z "$PY" ]; then
    if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
"$PY" -m pip --version >/dev/null 2>&1 || { echo "prepare_gpu_payload.sh: $PY has no pip; pass --python" >&2; exit 1; }
case "$PY_VERSION" in [0-9].[0-9]*) ;; *) echo "prepare_gpu_payload.sh: --python-version X.Y" >&2; exit 2 ;; esac
CP="cp${PY_VERSION/./}"
GLIBC_MINOR="${GLIBC#2.}"

mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
DOWNLOADS="$OUT/downloads"
STAGE="$OUT/stage"
PARTS="$OUT/parts"
rm -rf "$STAGE" "$PARTS"
mkdir -p "$DOWNLOADS/vllm" "$DOWNLOADS/deps" "$STAGE/wheels" "$STAGE/tokenizer" "$PARTS"

PLATFORMS=()
for ((minor = GLIBC_MINOR; minor >= 17; minor--)); do PLATFORMS+=(--platform "manylinux_2_${minor}_x86_64"); done
PLATFORMS+=(--platform manylinux2014_x86_64 --platform manylinux2010_x86_64 --platform manylinux1_x86_64
            --platform linux_x86_64)
TARGET=(--only-binary=:all: "${PLATFORMS[@]}" --python-version "$PY_VERSION" --implementation cp
        --abi "$CP" --abi abi3 --abi none)

echo "== 1. vLLM $VLLM_VERSION (CUDA wheel)"
"$PY" -m pip download --quiet --no-deps --only-binary=:all: --platform manylinux_2_28_x86_64 \
    --python-version "$PY_VERSION" --implementation cp -d "$DOWNLOADS/vllm" "vllm==$VLLM_VERSION"
VLLM_WHEEL="$(find "$DOWNLOADS/vllm" -name "vllm-$VLLM_VERSION-*manylinux*x86_64.whl" | sort | head -1)"
[ -n "$VLLM_WHEEL" ] || { echo "prepare_gpu_payload.sh: no vLLM $VLLM_VERSION wheel was downloaded" >&2; exit 1; }
echo "downloaded $(basename "$VLLM_WHEEL"): $(du -m "$VLLM_WHEEL" | cut -f1) MiB"

# Strip and repack; RECORD keeps the hashes of the files that stay.
"$PY" - "$VLLM_WHEEL" "$STAGE/wheels" "$STAGE/STRIPPED.txt" <<'PYEOF'
import csv, fnmatch, io, os, sys, zipfile

source, out_dir, report = sys.argv[1:4]
# What the Triton attention backend never loads (each import is optional in vLLM).
STRIP = [
    "vllm/vllm_flash_attn/_vllm_fa2_C*.so",      # FlashAttention 2
    "vllm/vllm_flash_attn/_vllm_fa3_C*.so",      # FlashAttention 3
    "vllm/_moe_C_stable_libtorch*.so",            # fused MoE kernels
    "vllm/vllm-rs",                               # Rust front end (opt-in)
    "vllm/third_party/deep_gemm/*",               # DeepGEMM (FP8 GEMM), headers included
    "vllm/third_party/fmha_sm100/*",              # SM100 sparse attention (MiniMax M3)
    "vllm/_flashmla_C*.so", "vllm/_flashmla_extension_C*.so",  # FlashMLA (MLA models)
    "vllm/_deepselect_C*.so",                     # DeepSeek sparse indexer
    "vllm/_flashkda_C*.so",                       # Kimi delta attention
    "vllm/_qutlass_C*.so",                        # QuTLASS (FP4 quantization)
]
name = os.path.basename(source)
target = os.path.join(out_dir, name)
removed, kept_bytes = [], 0
with zipfile.ZipFile(source) as src, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED, compresslevel=6) as dst:
    record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
    dropped = set()
    for info in src.infolist():
        if info.filename == record_name:
            continue
        if any(fnmatch.fnmatch(info.filename, pattern) for pattern in STRIP):
            dropped.add(info.filename)
            removed.append((info.compress_size, info.file_size, info.filename))
            continue
        data = src.read(info)
        out = zipfile.ZipInfo(info.filename, date_time=info.date_time)
        out.external_attr = info.external_attr
        out.compress_type = zipfile.ZIP_DEFLATED
        dst.writestr(out, data)
        kept_bytes += len(data)
    rows = list(csv.reader(io.StringIO(src.read(record_name).decode())))  # RECORD is CSV
    missing = dropped - {row[0] for row in rows if row}
    if missing:
        sys.exit(f"strip: files not in RECORD: {sorted(missing)[:5]}")
    text = io.StringIO()
    csv.writer(text, lineterminator="\n").writerows(row for row in rows if row and row[0] not in dropped)
    info = zipfile.ZipInfo(record_name, date_time=(2020, 1, 1, 0, 0, 0))
    info.external_attr = 0o644 << 16
    dst.writestr(info, text.getvalue(), zipfile.ZIP_DEFLATED)
with zipfile.ZipFile(target) as check:  # a valid archive, RECORD and contents agreeing
    bad = check.testzip()
    if bad:
        sys.exit(f"strip: {bad} is corrupt in the repacked wheel")
    names = set(check.namelist())
    listed = {row[0] for row in csv.reader(io.StringIO(check.read(record_name).decode())) if row}
    if listed != names:
        sys.exit(f"strip: RECORD and the files differ: {sorted(listed ^ names)[:5]}")
with open(report, "w") as handle:
    handle.write(f"Removed from {name} (compressed MiB, unpacked MiB, path):\n")
    for compressed, size, path in sorted(removed, reverse=True):
        handle.write(f"{compressed / 2**20:9.2f} {size / 2**20:9.2f}  {path}\n")
total = sum(c for c, _, _ in removed)
print(f"stripped {len(removed)} files ({total / 2**20:.1f} MiB compressed); "
      f"repacked wheel {os.path.getsize(target) / 2**20:.1f} MiB ({kept_bytes / 2**20:.0f} MiB unpacked)")
PYEOF

echo "== 2. dependencies the GPU image lacks (CPython $PY_VERSION, glibc <= $GLIBC)"
REPACKED="$STAGE/wheels/$(basename "$VLLM_WHEEL")"
"$PY" - "$REPACKED" "$ROOT/pyproject.toml" "$PY_VERSION" "$IMAGE_PACKAGES" "$OUT" "$STAGE/DEPENDENCIES.txt" \
    "$ALL_DEPS" -- "${TARGET[@]}" <<'PYEOF'
import json, re, subprocess, sys, zipfile

wheel, pyproject, py_version, image_file, out, report, all_deps = sys.argv[1:8]
all_deps = all_deps == "1"
target_args = sys.argv[9:]
try:
    from packaging.requirements import Requirement
except ImportError:
    from pip._vendor.packaging.requirements import Requirement

# The GPU stack the image provides, and kernel libraries of backends and
# features the plugin's Triton backend does not use.
GPU_STACK = {"torch", "torchvision", "torchaudio", "triton", "numpy"}
GPU_STACK_PREFIXES = ("nvidia-", "cuda-")
KERNEL_LIBS = {
    "flashinfer-python", "flashinfer-cubin", "flashinfer-jit-cache", "tilelang", "quack-kernels",
    "tokenspeed-mla", "humming-kernels", "fastsafetensors", "instanttensor", "torchcodec",
    "pynvvideocodec", "flash-attn", "xformers", "deep-gemm",
}
# Loaded neither by an offline LLM with eviction nor by `vllm serve` answering
# a completion (measured on vLLM's CPU build: python -X importtime); carried
# with --all-deps.
NOT_LOADED = {
    "mistral-common", "anthropic", "mcp", "mcp-types", "outlines-core", "lm-format-enforcer",
    "fastapi-cloud-cli", "sentry-sdk", "depyf",
}
# Read off the GPU image ('cuda', nvidia-h100-x1 and nvidia-h200) on 2026-11-17.
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


def canon(name):
    return re.sub(r"[-_.]+", "-", name).lower()


if image_file:
    names = [re.split(r"[=<>!~ @;]", line.strip(), maxsplit=1)[0] for line in open(image_file)]
    image = {canon(n) for n in names if n and not n.startswith("#")}
    image_source = image_file
else:
    image = {canon(n) for n in IMAGE.split()}
    image_source = "the list read off the GPU image on 2026-11-17"


def why_excluded(name):
    name = canon(name)
    if name in GPU_STACK or name.startswith(GPU_STACK_PREFIXES):
        return "GPU stack (the image's)"
    if name in KERNEL_LIBS:
        return "kernel library of another backend or feature"
    if name in image:
        return "present on the GPU image"
    if name in NOT_LOADED and not all_deps:
        return "not loaded by an offline engine or vllm serve (--all-deps carries it)"
    return None


env = {
    "python_version": py_version, "python_full_version": py_version + ".0", "platform_machine": "x86_64",
    "platform_system": "Linux", "sys_platform": "linux", "os_name": "posix", "implementation_name": "cpython",
    "platform_python_implementation": "CPython", "extra": "",
}
with zipfile.ZipFile(wheel) as archive:
    metadata = archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))).decode()
requirements = [("vllm", line.split(":", 1)[1].strip())
                for line in metadata.splitlines() if line.startswith("Requires-Dist:")]
deps = re.search(r"^dependencies = \[(.*?)^\]", open(pyproject).read(), re.S | re.M).group(1)
requirements += [("vllm-kvevict", text) for text in re.findall(r'"([^"]+)"', deps)]
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

# Resolve the roots' dependency tree (metadata only), then walk it from the
# roots without entering an excluded project: what only those need stays out.
with open(f"{out}/roots.txt", "w") as handle:
    handle.write("\n".join(str(req) for _, req in roots) + "\n")
cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
       "--report", f"{out}/resolution.json", "--target", f"{out}/.dry-run-target", *target_args,
       "-r", f"{out}/roots.txt"]
result = subprocess.run(cmd, capture_output=True, text=True)
if result.returncode != 0:
    sys.exit("pip could not resolve the dependencies:\n" + result.stderr[-4000:])
items = {canon(i["metadata"]["name"]): i for i in json.load(open(f"{out}/resolution.json"))["install"]}
chosen = {}  # name: (the project that first required it, the extras asked for)
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
        sys.exit(f"{req} (required by {parent}) is missing from pip's resolution")
    first_visit = name not in chosen
    seen_extras = chosen.setdefault(name, (parent, set()))[1]
    new_extras = set(req.extras) - seen_extras
    if not first_visit and not new_extras:
        continue
    seen_extras.update(new_extras)
    # A requirement's own dependencies (extra ""), once; those of each extra, once.
    for dep in items[name]["metadata"].get("requires_dist", []):
        for wanted in ([""] if first_visit else []) + sorted(new_extras):
            queue.append((name, Requirement(dep), wanted))
with open(f"{out}/pins.txt", "w") as handle:
    for name in sorted(chosen):
        handle.write(f"{items[name]['metadata']['name']}=={items[name]['metadata']['version']}\n")
with open(report, "w") as handle:
    handle.write(f"Dependencies carried ({len(chosen)}), each with the project that first required it:\n")
    for name in sorted(chosen):
        meta = items[name]["metadata"]
        handle.write(f"  {meta['name'] + '==' + meta['version']:48s} for {chosen[name][0]}\n")
    handle.write(f"\nExcluded ({len(excluded)}; image list: {image_source}):\n")
    for name, (parent, req, reason) in sorted(excluded.items()):
        handle.write(f"  {req:60s} {reason} (for {parent})\n")
print(f"{len(chosen)} dependencies to carry, {len(excluded)} excluded (see DEPENDENCIES.txt)")
PYEOF
"$PY" -m pip download --quiet --no-deps "${TARGET[@]}" -d "$DOWNLOADS/deps" -r "$OUT/pins.txt" \
    2> >(grep -v "is ignored: it is neither" >&2)
# Copy each pinned wheel (file names spell projects in their own ways: compare canonically).
"$PY" - "$OUT/pins.txt" "$DOWNLOADS/deps" "$STAGE/wheels" <<'PYEOF'
import os, re, shutil, sys

pins, downloads, wheels = sys.argv[1:4]
canon = lambda s: re.sub(r"[-_.]+", "-", s).lower()  # noqa: E731
files = {}
for f in os.listdir(downloads):
    if f.endswith(".whl"):
        name, version = f.split("-")[:2]
        files.setdefault((canon(name), version), f)
for pin in open(pins).read().split():
    name, version = pin.split("==")
    f = files.get((canon(name), version))
    if f is None:
        sys.exit(f"no wheel of {pin} was downloaded")
    shutil.copy2(os.path.join(downloads, f), wheels)
PYEOF

echo "== 3. this repository's wheel"
# Built from a copy of the files git tracks or would track (committed or not):
# setuptools' build/lib in the tree could hold modules deleted since.
SOURCE="$OUT/source"
rm -rf "$SOURCE" && mkdir -p "$SOURCE"
git ls-files -z --cached --others --exclude-standard | xargs -0 cp --parents -t "$SOURCE" 2>/dev/null || true
[ -f "$SOURCE/pyproject.toml" ] || { echo "prepare_gpu_payload.sh: run it in a git checkout" >&2; exit 1; }
"$PY" -m pip wheel --quiet --no-deps -w "$STAGE/wheels" "$SOURCE" 2> >(grep -v "is ignored: it is neither" >&2)
rm -rf "$SOURCE"
ls "$STAGE/wheels"/vllm_kvevict-*.whl >/dev/null

echo "== 4. the default model's tokenizer files"
if [ -z "$TOKENIZER_DIR" ]; then
    TOKENIZER_DIR="$("$PY" -c 'from vllm_kvevict.default_model import fetch_default_model; print(fetch_default_model())')"
fi
for file in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
    if [ -f "$TOKENIZER_DIR/$file" ]; then cp "$TOKENIZER_DIR/$file" "$STAGE/tokenizer/"; fi
done
if [ ! -f "$STAGE/tokenizer/tokenizer.json" ]; then
    echo "prepare_gpu_payload.sh: no tokenizer.json in $TOKENIZER_DIR" >&2
    exit 1
fi
echo "$(find "$STAGE/tokenizer" -type f | wc -l) files from $TOKENIZER_DIR"

REVISION="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
git diff --quiet HEAD 2>/dev/null || REVISION="$REVISION, with uncommitted changes"
{
    echo "vllm-kvevict GPU payload, made by scripts/prepare_gpu_payload.sh on $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "vLLM $VLLM_VERSION (CUDA wheel, stripped: STRIPPED.txt); dependencies for CPython $PY_VERSION on"
    echo "manylinux x86_64 up to glibc $GLIBC (DEPENDENCIES.txt); this repository's wheel (git $REVISION);"
    echo "tokenizer/: the default model's tokenizer files (for scripts/gpu_serve_check.py --tokenizer-dir)."
    echo "Install: bash scripts/gpu_check.sh --payload DIR (DIR holds the parts and MANIFEST)."
} > "$STAGE/PAYLOAD.txt"

echo "== 5. tar, parts, MANIFEST"
TAR="$OUT/payload.tar.gz"
tar -czf "$TAR" -C "$STAGE" .
split -b "$PART_SIZE" -d -a 2 "$TAR" "$PARTS/payload.tar.gz.part-"
{
    echo "# sha256 bytes name: each part, then the tar they reassemble into (the parts in name order)"
    for part in "$PARTS"/payload.tar.gz.part-*; do
        echo "$(sha256sum "$part" | cut -d' ' -f1) $(stat -c %s "$part") $(basename "$part")"
    done
    echo "$(sha256sum "$TAR" | cut -d' ' -f1) $(stat -c %s "$TAR") payload.tar.gz"
} > "$PARTS/MANIFEST"
rm -f "$TAR"
rm -rf "$OUT/.dry-run-target"

echo
echo "payload contents (KiB):"
du -k "$STAGE"/wheels/*.whl | sort -n -r | awk '{n = split($2, p, "/"); printf "  %8d  %s\n", $1, p[n]}'
echo "  $(du -sk "$STAGE/tokenizer" | cut -f1)  tokenizer/"
echo
echo "parts in $PARTS (carry each with the working tree; gpu_check.sh --payload reassembles them):"
awk '!/^#/ {printf "  %-22s %8.1f MiB  sha256 %s\n", $3, $2 / 1048576, $1}' "$PARTS/MANIFEST"
