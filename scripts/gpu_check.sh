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
             (env.txt; its freeze feeds gpu_payload.py build --image-packages)
  tests      tests/test_triton_kernels.py, test_window_scores.py and
             test_value_norms.py with TRITON_INTERPRET unset: the compiled
             kernels on the GPU (test_kernel_mode fails otherwise)
  bench      benchmarks/kernel_bench.py: target 1, decode attention at B=16,
             L=16k, bf16 as a percentage of the measured copy bandwidth (both
             KV layouts); target 2, one eviction step against one decode step
             over 32 layers
  sanitizer  compute-sanitizer --tool memcheck over the kernel tests, with
             PyTorch's caching allocator off so every tensor is its own
             allocation: the named cases (attention, compaction, vLLM's views;
             not the sweeps) by default, all of them with --sanitizer full
Stage 2 (vLLM, from the GPU payload of scripts/gpu_payload.py build):
  payload    the payload checked against its MANIFEST.json (sha256, size, and
             the recipe: a stale or missing payload is one line naming the
             fix) and unpacked into --work (no pip, no registry); with
             --original-c, vLLM's uncut compiled ops put in place
  ops        scripts/gpu_ops_check.py: the vLLM ops a Llama runs (rms_norm,
             fused_add_rms_norm, silu_and_mul, rotary_embedding,
             reshape_and_cache_flash) against torch, and the plugin's gate;
             stage 2 stops here if they fail
  kernels    the kernel tests at the tiny model's shape (head_dim 32, fp32),
             compiled, beside the serve checks
  serve      side by side: scripts/gpu_serve_check.py over the tiny random
             model (SnapKV slots, AdaKV+SnapKV, MomentKV, learned, prefix
             caching with MomentKV) compiled with piecewise CUDA graphs
             (learned: compiled, without graphs, as start-up requires), the
             same eager, and MomentKV through `vllm serve` (check (e));
             greedy tokens against the CPU recording, poison mode, blocks
             returned to the pool
  throughput benchmarks/gpu_throughput.py: the full cache against SnapKV and
             MomentKV at 25% kept on a random model of Llama-3.2-1B's shape;
             its engines start with the serve checks, its timed runs follow
             them, one at a time

Results (in --results DIR): summary.md; stage 1: env.txt, kernel-tests.txt,
kernel-bench.md, sanitizer.txt; stage 2: stage2.txt, serve-check.txt,
serve-check.json, throughput.md, throughput.json, logs.tar.gz (the engines'
logs). Exit status: 0 when every step run passed, 1 otherwise, 2 when no
NVIDIA GPU is usable.

Options:
  --stage 1|2|all      which stages (default all)
  --results DIR        default gpu-check-results
  --payload DIR        the payload's folder (default build/gpu-payload)
  --original-c DIR     the uncut compiled ops (build/gpu-payload-original-c):
                       the fallback when the cut ones fail; with a payload
                       unpacked by a run just before (the machine keeps --work
                       while warm), DIR may travel without the payload
  --work DIR           scratch: the unpacked payload, the models, the engines'
                       logs (default ${TMPDIR:-/tmp}/kvevict-gpu-check)
  --python PY          the interpreter holding torch and triton (default python3)
  --plugin tree|payload  the plugin code stage 2 serves: this working tree's
                       (default) or the wheel in the payload
  --sanitizer subset|full|off   default subset
  --skip LIST          steps to leave out, comma-separated: tests, bench,
                       sanitizer (stage 1), kernels, serve, http, throughput
                       (stage 2)
  --settings LIST      gpu_serve_check.py's offline settings (default: all five)
  --job-timeout S      seconds each stage-2 check may run (default 420; the
                       throughput benchmark, whose timed runs follow them,
                       half as long again)
  -h, --help           this text
EOF
}

STAGES="all"
RESULTS="gpu-check-results"
PAYLOAD="build/gpu-payload"
ORIGINAL_C=""
WORK="${TMPDIR:-/tmp}/kvevict-gpu-check"
JOB_TIMEOUT=420
PY="python3"
PLUGIN="tree"
SANITIZER="subset"
SETTINGS="snapkv,adakv_snapkv,momentkv,learned,prefix"
SKIP=""
while [ $# -gt 0 ]; do
    case "$1" in
        --stage) STAGES="$2"; shift 2 ;;
        --results) RESULTS="$2"; shift 2 ;;
        --payload) PAYLOAD="$2"; shift 2 ;;
        --original-c) ORIGINAL_C="$2"; shift 2 ;;
        --job-timeout) JOB_TIMEOUT="$2"; shift 2 ;;
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
    write_summary  # after every step: a run cut short keeps what it did
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
        "$PY" -m pytest tests/test_triton_kernels.py tests/test_window_scores.py tests/test_value_norms.py \
        -q -rs -p no:cacheprovider --noconftest > "$out" 2>&1
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
    for name, key in (("head pages, AdaKV + SnapKV", "engine"), ("slots, SnapKV", "engine_slots"),
                      ("head pages, MomentKV", "engine_momentkv"), ("head pages, CriticalKV", "engine_criticalkv"),
                      ("head pages, every layer at once, AdaKV + SnapKV", "engine_every_layer")):
        if t.get(key + '_eviction_step_us') is not None:
            parts.append(f"served path, {name}: {t[key + '_eviction_step_us'] / 1e3:,.1f} ms = "
                         f"{t[key + '_eviction_over_decode']:.2f}x a decode step")
v = f.get("value_factor")
if v:
    layers = t["layers"] if t else 1
    over = v["kernel_all_layers_over_decode"]
    parts.append(f"value factor (CriticalKV, DefensiveKV), one layer: kernel {v['kernel_us'] / 1e3:,.1f} ms "
                 f"({v['kernel_tflops']:,.0f} TFLOP/s), torch {v['torch_us'] / 1e3:,.1f} ms"
                 + (f"; x{layers} layers = {over:.1f}x a decode step" if over else ""))
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
        --print-limit 50 "$PY" -m pytest tests/test_triton_kernels.py tests/test_window_scores.py \
        tests/test_value_norms.py -q -p no:cacheprovider --noconftest \
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

# Stage 2's environment: vLLM's CUDA build from the unpacked payload, the
# working tree's plugin (or the payload's) on top, the kernel libraries this
# payload leaves out kept out of vLLM's way.
stage2_env() {
    local site="$WORK/payload/site"
    export PYTHONPATH="$site"
    [ "$PLUGIN" = tree ] && export PYTHONPATH="$SITE:$site"
    export PATH="$site/bin:$PATH" PYTHONSAFEPATH=1 PYTHONUNBUFFERED=1
    export VLLM_USE_FLASHINFER_SAMPLER=0 VLLM_USE_DEEP_GEMM=0 VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1
    export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TORCHINDUCTOR_COMPILE_THREADS=2
    unset TRITON_INTERPRET
}

# Unpack (or reuse) the payload; with --original-c, put the uncut compiled ops in place.
stage2_payload() {
    local out="$RESULTS/stage2.txt" args=(unpack "$WORK/payload" --payload "$PAYLOAD")
    [ -n "$ORIGINAL_C" ] && args+=(--original-c "$ORIGINAL_C")
    if "$PY" scripts/gpu_payload.py "${args[@]}" >> "$out" 2>&1; then
        step 2 payload passed "$(tail -1 "$out")"
    else
        step 2 payload failed "$(tail -1 "$out")"
        return 1
    fi
}

# vLLM's compiled ops against torch, and the plugin's gate: nothing else runs if they fail.
stage2_ops() {
    local out="$RESULTS/stage2.txt" json="$WORK/ops.json" gate
    { echo; echo "## vLLM's ops against torch"; } >> "$out"
    if ! "$PY" scripts/gpu_ops_check.py --json "$json" >> "$out" 2>&1; then
        step 2 "vLLM's compiled ops" failed "$(tail -1 "$out"); if the cut ops fail, rerun with the uncut ones (docs/gpu.md: The GPU check)"
        return 1
    fi
    step 2 "vLLM's compiled ops" passed "$(tail -1 "$out" | sed 's/^gpu_ops_check: //')"
    gate="$("$PY" -c 'import vllm, vllm_kvevict; from vllm_kvevict.plugin import compat; print("vLLM {}; plugin from {}; gate: {}".format(vllm.__version__, vllm_kvevict.__file__, compat.unsupported_reason() or "open"))' 2>&1 | tail -1)"
    echo "$gate" >> "$out"
    case "$gate" in
        *"gate: open") step 2 "plugin gate" passed "$gate" ;;
        *) step 2 "plugin gate" failed "$gate"; return 1 ;;
    esac
}

# The serve checks (compiled, eager, vllm serve) side by side, then the
# throughput benchmark's timed runs alone on the GPU (its engines start with
# the checks). Each job's output is kept; the summary gets one row per job.
stage2_serve() {
    local model="$WORK/tiny-model" tokenizer="$WORK/payload/tokenizer" done="$WORK/checks-done"
    local common=(--expect benchmarks/gpu_reference_tokens.json --model "$model" --timeout "$JOB_TIMEOUT"
                  --gpu-memory-utilization 0.02)
    rm -f "$done" "$WORK"/serve-check-*.json "$WORK"/job-*.txt "$WORK"/serve-*/serve-check.json
    # The tiny model's builder is the tests' (tests/tiny_model.py).
    if ! "$PY" -c 'import sys; sys.path.append("tests"); from tiny_model import build_tiny_llama; build_tiny_llama(sys.argv[1], 0, tokenizer_dir=sys.argv[2])' \
            "$model" "$tokenizer" >> "$RESULTS/stage2.txt" 2>&1; then
        step 2 "tiny model" failed "$(tail -1 "$RESULTS/stage2.txt")"
        return
    fi
    local pids=() names=()
    launch() {  # launch NAME COMMAND...: in the background, output in $WORK/job-NAME.txt
        local name=$1; shift
        timeout "$JOB_TIMEOUT" "$@" > "$WORK/job-$name.txt" 2>&1 &
        pids+=($!); names+=("$name")
    }
    skipping serve 2 || {
        launch compiled "$PY" scripts/gpu_serve_check.py "${common[@]}" --settings "$SETTINGS" \
            --jobs 8 --work "$WORK/serve-compiled"
        launch eager "$PY" scripts/gpu_serve_check.py "${common[@]}" --settings "$SETTINGS" --enforce-eager \
            --jobs 8 --work "$WORK/serve-eager"
    }
    skipping http 2 || launch http "$PY" scripts/gpu_serve_check.py "${common[@]}" --settings momentkv --http \
        --work "$WORK/serve-http"
    # The kernels compiled at the tiny model's shape (head_dim 32, fp32), beside the engines that run them.
    local kernels_pid=""
    if ! skipping kernels 2; then
        timeout "$JOB_TIMEOUT" "$PY" -m pytest tests/test_triton_kernels.py -q -rs -p no:cacheprovider --noconftest \
            -k "d32" > "$WORK/job-kernels.txt" 2>&1 &
        kernels_pid=$!
    fi
    local bench_pid=""
    if ! skipping throughput 2; then
        # Its timed runs follow the checks: half as long again, and it stops
        # itself first, so what it measured is written.
        local bench_timeout=$((JOB_TIMEOUT * 3 / 2))
        timeout "$bench_timeout" "$PY" benchmarks/gpu_throughput.py --tokenizer-dir "$tokenizer" --work "$WORK/throughput" \
            --json "$RESULTS/throughput.json" --wait-for "$done" --timeout "$((bench_timeout - 20))" \
            > "$RESULTS/throughput.md" 2>&1 &
        bench_pid=$!
    fi
    local i rc last
    for i in "${!pids[@]}"; do
        wait "${pids[$i]}"
        rc=$?
        cat "$WORK/job-${names[$i]}.txt" >> "$RESULTS/serve-check.txt"
        cp "$WORK/serve-${names[$i]}/serve-check.json" "$WORK/serve-check-${names[$i]}.json" 2>/dev/null
        last="$(grep '^gpu_serve_check' "$WORK/job-${names[$i]}.txt" | tail -1)"
        if [ $rc -eq 0 ]; then
            step 2 "serve check, ${names[$i]}" passed "${last#gpu_serve_check: }"
        else
            step 2 "serve check, ${names[$i]}" failed "${last:-exit $rc: $(tail -1 "$WORK/job-${names[$i]}.txt")}; see serve-check.txt"
        fi
    done
    if [ -n "$kernels_pid" ]; then
        wait "$kernels_pid"
        rc=$?
        { echo; echo "## kernel tests at the tiny model's shape (compiled)"; cat "$WORK/job-kernels.txt"; } >> "$RESULTS/stage2.txt"
        last="$(grep -E '[0-9]+ (passed|failed|error)' "$WORK/job-kernels.txt" | tail -1)"
        if [ $rc -eq 0 ]; then step 2 "kernel tests, head_dim 32 (compiled)" passed "$last"
        else step 2 "kernel tests, head_dim 32 (compiled)" failed "${last:-exit $rc}; see stage2.txt"; fi
    fi
    touch "$done"
    "$PY" - "$RESULTS/serve-check.json" "$WORK" <<'PYEOF'
import json, pathlib, sys
paths = sorted(pathlib.Path(sys.argv[2]).glob("serve-check-*.json"))
merged = {p.stem.removeprefix("serve-check-"): json.loads(p.read_text()) for p in paths}
json.dump(merged, open(sys.argv[1], "w"), indent=1)
PYEOF
    if [ -n "$bench_pid" ]; then
        wait "$bench_pid"
        rc=$?
        last="$(grep -E '^\| (full|snapkv|momentkv)' "$RESULTS/throughput.md" | awk -F'|' '{printf "%s%s %s tok/s", sep, $2, $6; sep=";"}')"
        if [ $rc -eq 0 ]; then
            step 2 "throughput" done "$last"
        else
            step 2 "throughput" failed "exit $rc${last:+: $last}; see throughput.md"
        fi
    fi
}

run_stage2() {
    : > "$RESULTS/stage2.txt"
    stage2_payload || return
    stage2_env
    stage2_ops || return
    stage2_serve
    (cd / && tar -czf "$RESULTS/logs.tar.gz" --ignore-failed-read -C "$WORK" \
        $(cd "$WORK" && ls -d serve-*/*.log throughput/*.log 2>/dev/null)) 2>/dev/null
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
