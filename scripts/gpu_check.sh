#!/usr/bin/env bash
# Checks the plugin's Triton kernels and its CUDA serving path on a machine with
# an NVIDIA GPU; see --help.
set -uo pipefail

usage() {
    cat <<'EOF'
Usage: bash scripts/gpu_check.sh [options]

Run from the repository root on a machine with an NVIDIA GPU, PyTorch and
Triton (no package registry needed). Two stages:

Stage 1 (no vLLM):
  env        nvidia-smi, torch / triton / CUDA versions, glibc, pip freeze
             (env.txt; its freeze feeds prepare_gpu_payload.sh --image-packages)
  tests      tests/test_triton_kernels.py with TRITON_INTERPRET unset: the
             compiled kernels on the GPU (test_kernel_mode fails otherwise)
  bench      benchmarks/kernel_bench.py: target 1, decode attention at B=16,
             L=16k, bf16 as a percentage of the measured copy bandwidth (both
             KV layouts); target 2, one eviction step against one decode step
             over 32 layers
  sanitizer  compute-sanitizer --tool memcheck over the kernel tests, with
             PyTorch's caching allocator off so every tensor is its own
             allocation: the named cases (attention, compaction, vLLM's views;
             not the sweeps) by default, all of them with --sanitizer full
Stage 2 (vLLM):
  payload    with --payload DIR: the parts checked against DIR/MANIFEST
             (sha256 and size), reassembled, checked again, unpacked; a venv
             (--system-site-packages, and the interpreter's own site folders,
             so the machine's torch and triton are the ones used) gets the
             wheels with pip install --no-index --no-deps; pip check's report
             is kept
  import     'import vllm._C_stable_libtorch' (and vllm._C where the build has
             it): vLLM's compiled ops on this machine's torch. If they cannot
             load, stage 2 stops here and says so
  serve      scripts/gpu_serve_check.py --expect benchmarks/gpu_reference_tokens.json:
             the tiny model served with eviction (SnapKV, AdaKV+SnapKV,
             MomentKV, learned), greedy tokens against the recorded CPU run, no
             NaN with freed blocks poisoned, blocks returned to the pool

Results (at most 8 files, in --results DIR): summary.md, env.txt,
kernel-tests.txt, kernel-bench.md, sanitizer.txt, stage2.txt, serve-check.txt,
serve-check.json. Exit status: 0 when every step run passed, 1 otherwise,
2 when no NVIDIA GPU is usable.

Options:
  --stage 1|2|all      which stages (default all)
  --results DIR        default gpu-check-results
  --payload DIR        the parts and MANIFEST from prepare_gpu_payload.sh
                       (e.g. build/gpu-payload/parts); without it stage 2 uses
                       the venv of an earlier install (--venv), else --python
  --venv DIR           where the payload is installed
                       (default ${TMPDIR:-/tmp}/kvevict-gpu-check/venv)
  --work DIR           scratch: the reassembled payload, the tiny model, the
                       engines' logs (default ${TMPDIR:-/tmp}/kvevict-gpu-check/work)
  --python PY          the interpreter holding torch and triton (default python3)
  --plugin tree|payload  the plugin code stage 2 serves: this working tree's
                       (default) or the wheel in the payload
  --sanitizer subset|full|off   default subset
  --skip LIST          steps to leave out, comma-separated: tests, bench,
                       sanitizer, serve (e.g. to keep one run under a time limit)
  --settings LIST      gpu_serve_check.py's settings (default: all four)
  -h, --help           this text
EOF
}

STAGES="all"
RESULTS="gpu-check-results"
PAYLOAD=""
SCRATCH="${TMPDIR:-/tmp}/kvevict-gpu-check"
VENV="$SCRATCH/venv"
WORK="$SCRATCH/work"
PY="python3"
PLUGIN="tree"
SANITIZER="subset"
SETTINGS=""
SKIP=""
while [ $# -gt 0 ]; do
    case "$1" in
        --stage) STAGES="$2"; shift 2 ;;
        --results) RESULTS="$2"; shift 2 ;;
        --payload) PAYLOAD="$2"; shift 2 ;;
        --venv) VENV="$2"; shift 2 ;;
        --work) WORK="$2"; shift 2 ;;
        --python) PY="$2"; shift 2 ;;
        --plugin) PLUGIN="$2"; shift 2 ;;
        --sanitizer) SANITIZER="$2"; shift 2 ;;
        --settings) SETTINGS="$2"; shift 2 ;;
        --skip) SKIP=",$2,"; shift 2 ;;
        -h|--help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    esac
done
case "$STAGES" in 1|2|all) ;; *) echo "gpu_check.sh: --stage 1, 2 or all" >&2; exit 2 ;; esac
case "$SANITIZER" in subset|full|off) ;; *) echo "gpu_check.sh: --sanitizer subset, full or off" >&2; exit 2 ;; esac
case "$PLUGIN" in tree|payload) ;; *) echo "gpu_check.sh: --plugin tree or payload" >&2; exit 2 ;; esac

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT" || exit 2
# The repository's top-level triton_kernels/ must not shadow the package of
# that name vLLM imports: no Python started here puts the current folder first.
export PYTHONSAFEPATH=1
if [ ! -f tests/test_triton_kernels.py ] || [ ! -d triton_kernels ]; then
    echo "gpu_check.sh: run it from a checkout of the repository" >&2
    exit 2
fi

# One line and exit 2 where no NVIDIA GPU can be used.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "gpu_check.sh: needs an NVIDIA GPU: nvidia-smi is not on this machine"
    exit 2
fi
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_check.sh: needs an NVIDIA GPU: nvidia-smi finds none ($(nvidia-smi -L 2>&1 | head -1))"
    exit 2
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >/dev/null 2>&1; then
    echo "gpu_check.sh: needs an NVIDIA GPU visible to PyTorch: $PY cannot import torch or sees no CUDA device"
    exit 2
fi

mkdir -p "$RESULTS" "$WORK"
RESULTS="$(cd "$RESULTS" && pwd)"
WORK="$(cd "$WORK" && pwd)"
STEPS="$WORK/steps.tsv"
: > "$STEPS"
FAILED=0

# skipping NAME: whether --skip names the step (and a summary row saying so).
skipping() {
    case "$SKIP" in *",$1,"*) step "$2" "$1" skipped "--skip"; return 0 ;; esac
    return 1
}

# step STAGE NAME RESULT DETAIL: one row of the summary.
step() {
    printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$4" >> "$STEPS"
    echo "[stage $1] $2: $3${4:+ ($4)}"
    case "$3" in passed|done|skipped) ;; *) FAILED=1 ;; esac
}

write_summary() {
    {
        echo "# GPU check"
        echo
        echo "$(date -u +%Y-%m-%dT%H:%MZ); $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1)"
        echo "$VERSIONS"
        echo
        echo "| stage | step | result | detail |"
        echo "|---|---|---|---|"
        while IFS=$'\t' read -r stage name result detail; do
            echo "| $stage | $name | $result | ${detail//|/\\|} |"
        done < "$STEPS"
    } > "$RESULTS/summary.md"
}
VERSIONS="$("$PY" -c 'import sys, torch, triton; print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")' 2>&1 | tail -1)"
trap write_summary EXIT

# The package as pyproject.toml installs it (vllm_kvevict with triton_kernels/
# and csrc/ inside), copied from this tree: stage 1 needs no build and no vLLM.
SITE="$WORK/tree-site"
rm -rf "$SITE"
mkdir -p "$SITE"
cp -r vllm_kvevict "$SITE/vllm_kvevict"
rm -rf "$SITE/vllm_kvevict/triton_kernels" "$SITE/vllm_kvevict/csrc"
cp -r triton_kernels "$SITE/vllm_kvevict/triton_kernels"
cp -r csrc "$SITE/vllm_kvevict/csrc"
find "$SITE" -name __pycache__ -prune -exec rm -rf {} +

stage1_env() {
    {
        echo "## nvidia-smi"; nvidia-smi
        echo; echo "## python"
        "$PY" - <<'PYEOF'
import platform, sys
import torch, triton
print(f"python {sys.version.split()[0]} ({sys.executable})")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}")
p = torch.cuda.get_device_properties(0)
print(f"{p.name}: {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB, capability {p.major}.{p.minor}")
print(f"glibc {platform.libc_ver()[1]}")
PYEOF
        echo; echo "## tools"
        (nvcc --version 2>/dev/null | tail -2) || echo "nvcc: not found"
        (compute-sanitizer --version 2>/dev/null | head -3) || echo "compute-sanitizer: not found"
        echo; echo "## pip freeze ($PY)"
        "$PY" -m pip freeze 2>/dev/null || echo "(pip not available)"
    } > "$RESULTS/env.txt" 2>&1
    step 1 env "done" "$VERSIONS"
}

# The compiled kernels: TRITON_INTERPRET unset (test_kernel_mode fails otherwise).
stage1_tests() {
    local out="$RESULTS/kernel-tests.txt" start=$SECONDS rc line
    env -u TRITON_INTERPRET PYTHONSAFEPATH=1 PYTHONPATH="$SITE" \
        "$PY" -m pytest tests/test_triton_kernels.py -q -rs -p no:cacheprovider --noconftest > "$out" 2>&1
    rc=$?
    line="$(grep -E '[0-9]+ (passed|failed|error)' "$out" | tail -1)"
    if [ $rc -eq 0 ]; then
        step 1 "kernel tests (compiled, $((SECONDS - start))s)" passed "$line"
    else
        step 1 "kernel tests (compiled)" failed "${line:-exit $rc}; see kernel-tests.txt"
    fi
}

stage1_bench() {
    local out="$RESULTS/kernel-bench.md" figures="$WORK/kernel-bench.json" rc
    rm -f "$figures"
    env -u TRITON_INTERPRET PYTHONSAFEPATH=1 PYTHONPATH="$SITE" \
        "$PY" benchmarks/kernel_bench.py --json "$figures" > "$out" 2>&1
    rc=$?
    if [ $rc -ne 0 ] || [ ! -f "$figures" ]; then
        step 1 "kernel benchmark" failed "exit $rc; see kernel-bench.md"
        return
    fi
    step 1 "kernel benchmark" "done" "$("$PY" - "$figures" <<'PYEOF'
import json, sys
f = json.load(open(sys.argv[1]))
parts = [f"copy {f['copy_GBps']:,.0f} GB/s"]
for row in f["target1_decode"]:
    parts.append(f"target 1 {row['layout']}: {row['triton_pct_copy']:.0f}% of copy "
                 f"({row['triton_GBps']:,.0f} GB/s; moments {row['moments_pct_copy']:.0f}%; "
                 f"{row['baseline']} {row['baseline_pct_copy']:.0f}%)")
t = f["target2_eviction"]
if t:
    parts.append(f"target 2 ({t['layers']} layers, {t['layout']}): eviction {t['eviction_step_us'] / 1e3:,.1f} ms / "
                 f"decode {t['decode_step_us'] / 1e3:,.1f} ms = {t['eviction_over_decode']:.2f}x, "
                 f"{100 * t['eviction_over_decode_per_step']:.1f}% per decode step at interval {t['decode_interval']}")
print("; ".join(parts))
PYEOF
)"
}

# memcheck with PyTorch's caching allocator off: every tensor its own
# allocation, so a read or write past one is caught.
stage1_sanitizer() {
    local out="$RESULTS/sanitizer.txt" select=() what="all kernel tests" start=$SECONDS rc line
    if [ "$SANITIZER" = off ]; then
        step 1 "compute-sanitizer memcheck" skipped "--sanitizer off"
        return
    fi
    if ! command -v compute-sanitizer >/dev/null 2>&1; then
        step 1 "compute-sanitizer memcheck" failed "compute-sanitizer is not on this machine"
        return
    fi
    if [ "$SANITIZER" = subset ]; then
        select=(-k "matches_reference or on_vllm_views or unowned_rows or splits_agree or compaction_then_attention or kernel_mode")
        what="named cases, no sweeps"
    fi
    env -u TRITON_INTERPRET PYTHONSAFEPATH=1 PYTHONPATH="$SITE" PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
        timeout 3000 compute-sanitizer --tool memcheck --target-processes all --error-exitcode 3 \
        --print-limit 50 "$PY" -m pytest tests/test_triton_kernels.py -q -p no:cacheprovider --noconftest \
        "${select[@]}" > "$out" 2>&1
    rc=$?
    line="$(grep -E '[0-9]+ (passed|failed)' "$out" | tail -1); $(grep -E 'ERROR SUMMARY' "$out" | tail -1)"
    case $rc in
        0) step 1 "compute-sanitizer memcheck ($what, $((SECONDS - start))s)" passed "$line" ;;
        3) step 1 "compute-sanitizer memcheck ($what)" failed "memory errors: $line; see sanitizer.txt" ;;
        124) step 1 "compute-sanitizer memcheck ($what)" failed "timed out after 3000s" ;;
        *) step 1 "compute-sanitizer memcheck ($what)" failed "exit $rc: $line; see sanitizer.txt" ;;
    esac
}

run_stage1() {
    stage1_env
    skipping tests 1 || stage1_tests
    skipping bench 1 || stage1_bench
    skipping sanitizer 1 || stage1_sanitizer
}

install_payload() {
    # Verify, reassemble, unpack, install into $VENV. Returns non-zero on failure.
    local manifest="$PAYLOAD/MANIFEST" sha size name tar="$WORK/payload.tar.gz"
    [ -f "$manifest" ] || { echo "no MANIFEST in $PAYLOAD"; return 1; }
    local parts=()
    while read -r sha size name; do
        case "$sha" in \#*|"") continue ;; esac
        case "$name" in
            *.part-*)
                [ -f "$PAYLOAD/$name" ] || { echo "missing part $name in $PAYLOAD"; return 1; }
                [ "$(stat -c %s "$PAYLOAD/$name")" = "$size" ] || { echo "$name: size differs from MANIFEST"; return 1; }
                [ "$(sha256sum "$PAYLOAD/$name" | cut -d' ' -f1)" = "$sha" ] || { echo "$name: sha256 differs from MANIFEST"; return 1; }
                parts+=("$PAYLOAD/$name") ;;
            *) TAR_SHA="$sha"; TAR_SIZE="$size" ;;
        esac
    done < "$manifest"
    echo "${#parts[@]} parts match MANIFEST"
    if [ -f "$VENV/.kvevict-payload" ] && [ "$(cat "$VENV/.kvevict-payload")" = "$TAR_SHA" ]; then
        echo "this payload is installed in $VENV already"
        return 0
    fi
    cat "${parts[@]}" > "$tar"
    [ "$(stat -c %s "$tar")" = "$TAR_SIZE" ] && [ "$(sha256sum "$tar" | cut -d' ' -f1)" = "$TAR_SHA" ] \
        || { echo "the reassembled payload's sha256 or size differs from MANIFEST"; return 1; }
    echo "reassembled payload matches MANIFEST ($TAR_SIZE bytes)"
    rm -rf "$WORK/payload" && mkdir -p "$WORK/payload" && tar -xzf "$tar" -C "$WORK/payload" && rm -f "$tar" || return 1
    cat "$WORK/payload/PAYLOAD.txt"
    rm -rf "$VENV"
    # --system-site-packages reaches the base interpreter's folders only; when
    # $PY is itself a venv's (the image's torch lives in one), a .pth adds its
    # site folders, after the new venv's own.
    "$PY" -m venv --system-site-packages --without-pip "$VENV" || return 1
    local site
    site="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || return 1
    "$PY" -c 'import site, sys; print("\n".join(p for p in sys.path if p.endswith(("site-packages", "dist-packages"))))' \
        > "$site/_kvevict_base_site.pth" || return 1
    "$PY" -m pip install --quiet --no-index --no-deps --upgrade --target "$site" "$WORK/payload"/wheels/*.whl || return 1
    echo "$TAR_SHA" > "$VENV/.kvevict-payload"
    echo "installed $(find "$WORK/payload/wheels" -name "*.whl" | wc -l) wheels into $VENV"
}

run_stage2() {
    local out="$RESULTS/stage2.txt" vpy rc
    : > "$out"
    if [ -n "$PAYLOAD" ]; then
        if install_payload >> "$out" 2>&1; then
            step 2 payload passed "installed in $VENV"
        else
            step 2 payload failed "$(tail -1 "$out")"
            return
        fi
    fi
    if [ -x "$VENV/bin/python" ]; then vpy="$VENV/bin/python"; else vpy="$PY"; fi
    local tokenizer="$WORK/payload/tokenizer"
    local pythonpath=""
    [ "$PLUGIN" = tree ] && pythonpath="$SITE"
    {
        echo; echo "## pip check ($vpy)"
        PYTHONSAFEPATH=1 "$vpy" -m pip check 2>&1 || true
        # vLLM's compiled ops on this torch, before anything else.
        echo; echo "## import check"
    } >> "$out"
    PYTHONSAFEPATH=1 "$vpy" - >> "$out" 2>&1 <<'PYEOF'
import importlib.util, sys, traceback
import torch
try:
    import vllm
except Exception:
    traceback.print_exc()
    print("IMPORT-FAILED import vllm")
    sys.exit(1)
print(f"vllm {vllm.__version__} from {vllm.__file__}; torch {torch.__version__}")
failed = False
for name in ("vllm._C_stable_libtorch", "vllm._C"):
    if name == "vllm._C" and importlib.util.find_spec(name) is None:
        print("vllm._C: not in this build")
        continue
    try:
        importlib.import_module(name)
        print(f"{name}: loaded")
    except Exception as exc:
        traceback.print_exc()
        print(f"IMPORT-FAILED {name}: {type(exc).__name__}: {exc}")
        failed = True
sys.exit(1 if failed else 0)
PYEOF
    rc=$?
    if [ $rc -ne 0 ]; then
        local error
        error="$(grep IMPORT-FAILED "$out" | head -1 | sed 's/^IMPORT-FAILED //')"
        echo "gpu_check.sh: stage 2 stopped: this vLLM build cannot load its compiled ops on this machine's torch" \
             "($("$vpy" -c 'import torch; print(torch.__version__)' 2>/dev/null)): ${error:-see stage2.txt}" | tee -a "$out"
        step 2 "vLLM compiled ops import" failed "this vLLM build cannot load on this torch: ${error:-see stage2.txt}"
        return
    fi
    step 2 "vLLM compiled ops import" passed "$(grep -E '^vllm [0-9]' "$out" | head -1)"
    {
        echo; echo "## plugin"
        env PYTHONSAFEPATH=1 PYTHONPATH="$pythonpath" "$vpy" -c \
            'import vllm_kvevict; from vllm_kvevict.vllm_glue import compat; print(vllm_kvevict.__file__); print("unsupported:", compat.unsupported_reason())' 2>&1
    } >> "$out"

    skipping serve 2 && return
    local args=(--expect benchmarks/gpu_reference_tokens.json --work "$WORK/serve")
    [ -d "$tokenizer" ] && args+=(--tokenizer-dir "$tokenizer")
    [ -n "$SETTINGS" ] && args+=(--settings "$SETTINGS")
    env -u TRITON_INTERPRET PYTHONSAFEPATH=1 PYTHONPATH="$pythonpath" \
        "$vpy" scripts/gpu_serve_check.py "${args[@]}" > "$RESULTS/serve-check.txt" 2>&1
    rc=$?
    cp "$WORK/serve/serve-check.json" "$RESULTS/serve-check.json" 2>/dev/null
    local last
    last="$(grep '^gpu_serve_check' "$RESULTS/serve-check.txt" | tail -1)"
    if [ $rc -eq 0 ]; then
        step 2 "serve check" passed "${last#gpu_serve_check: }"
    else
        step 2 "serve check" failed "${last:-exit $rc: $(tail -1 "$RESULTS/serve-check.txt")}; see serve-check.txt"
    fi
}

case "$STAGES" in
    1) run_stage1 ;;
    2) run_stage2 ;;
    all) run_stage1; run_stage2 ;;
esac
write_summary
trap - EXIT
echo
cat "$RESULTS/summary.md"
exit $FAILED
