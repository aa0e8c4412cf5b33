#!/usr/bin/env bash
# The GPU check: proves the CUDA path whenever a GPU is lent, in under 9 minutes, writing everything to one folder.
#
#   perf/gpu_check.sh [OUT]             on a GPU host: the steps below, compiled (OUT: perf/out/gpu_check)
#   perf/gpu_check.sh --dry-run [OUT]   on a CPU: the same steps on a few tests and tiny shapes, kernels interpreted
#                                       (tests/test_gpu_check.py runs this in CI, so the script cannot rot)
#
# Runs with .venv/bin/python when there is one, else python3 (a GPU image's own torch, triton and transformers);
# the project's packages are made importable from the checkout without installing it. Steps, each under its own
# time limit so that one stuck step still leaves the others' results:
#   1. env.txt       nvidia-smi, versions
#   2. kernels.log   tests/test_kernels.py compiled on the GPU against the PyTorch references (every dtype, INT8/FP8
#                    KV caches, INT8/INT4 weights), the C++ CPU operators' tests left out
#   3. parity.log    greedy tokens equal transformers': the default model and every variant of tests/hf_models.py
#                    (one with GQA and head_dim 128), chunked prefill, prefix caching, preemption, speculation
#   4. figures.json  perf/gpu_bench.py: copy bandwidth, decode step against its floor, as scheduled and replayed
#                    from CUDA graphs (profile_decode_batches.txt, profile_decode_padded.txt), decode
#                    attention bandwidth beside SDPA, prefill tok/s, the anchor profile through the engine
#   5. served.log    tritonserver on this host from perf/pack_tritonserver.py's archive (TRELLM_GPU_PACK, default
#                    perf/out/gpu-pack.tar.xz, carried to the GPU machine; the step is left out without it): the
#                    anchor profile through `ensemble` and `llm` over gRPC against the engine alone (perf/gpu_served.sh)
#   6. summary.md    one table to paste into perf/RESULTS.md
# Exit status 0 only when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
DRY=0
if [ "${1:-}" = "--dry-run" ]; then DRY=1; shift; fi
OUT=$(realpath -m "${1:-perf/out/gpu_check}")
mkdir -p "$OUT"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON; elif [ -x .venv/bin/python ]; then PY=$PWD/.venv/bin/python; else PY=python3; fi
export PYTHONUNBUFFERED=1
if ! "$PY" -c "import trellm_backend, trellm_kernels" 2>/dev/null; then
    # Not installed (a GPU image): the import names of pyproject.toml's package-dir, as links to the checkout.
    LINKS=$(mktemp -d)
    ln -s "$PWD/backend" "$LINKS/trellm_backend"
    ln -s "$PWD/kernels" "$LINKS/trellm_kernels"
    ln -s "$PWD/client" "$LINKS/trellm_client"
    ln -s "$PWD/openai_api" "$LINKS/trellm_openai"
    export PYTHONPATH="$LINKS${PYTHONPATH:+:$PYTHONPATH}"
fi
MODELS=${TRELLM_GPU_CHECK_MODELS:-${TMPDIR:-/tmp}/trellm-gpu-check-models}
PYTEST=("$PY" -m pytest -q -p no:cacheprovider -o addopts= -rf)

step() {   # step NAME SECONDS COMMAND...: run COMMAND with its output in OUT/NAME.log, record its status
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    echo "[gpu_check] $name (at most ${limit}s)"
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name $rc $((SECONDS - start))" >>"$OUT/status.txt"
    echo "[gpu_check] $name: exit $rc in $((SECONDS - start))s; $(tail -n 1 "$OUT/$name.log")"
}

: >"$OUT/status.txt"
{
    date -u
    nvidia-smi 2>&1 || echo "nvidia-smi: not available (dry run: $DRY)"
    "$PY" - <<'EOF'
import os, platform, torch, triton, transformers
print("python", platform.python_version(), "torch", torch.__version__, "triton", triton.__version__,
      "transformers", transformers.__version__, "cpus", os.cpu_count())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(p.name, f"sm_{p.major}{p.minor}", p.multi_processor_count, "SMs", round(p.total_memory / 2**30, 1), "GiB")
EOF
} >"$OUT/env.txt" 2>&1

if [ "$DRY" = 1 ]; then
    # A few tests of each kind: the point is the script, not the coverage (CI runs both files in full).
    KERNEL_ENV=(env TRITON_INTERPRET=1 TRELLM_KERNEL_TEST_DEVICE=cpu TRELLM_CPU_OPS=0)
    KERNEL_SELECT=(-k "test_attention_split_decode or test_write_kv_skips_padding or fp8_encoding or silu_and_mul")
    PARITY=(tests/test_engine.py -k test_default_model_matches_transformers)
    BENCH=(--dry-run --anchor-model hf_models/tiny-llama)
    BENCH_ENV=(env TRITON_INTERPRET=1 TRELLM_CPU_OPS=0)
    LIMITS=(300 300 300 300)
    PACK=$OUT/pack.tar            # this interpreter's server, packed here: the step's unpacking is what is checked
    "$PY" perf/pack_tritonserver.py "$PACK" >/dev/null
    SERVED=(hf_models/tiny-llama --smoke)
else
    KERNEL_ENV=(env TRELLM_KERNEL_TEST_DEVICE=cuda TRELLM_CPU_OPS=0)
    KERNEL_SELECT=(-k "not linear_prepared")
    # pytest-xdist, when installed, compiles the kernels' many variants on several cores
    if "$PY" -c "import xdist" 2>/dev/null; then KERNEL_SELECT+=(-n 8); fi
    PARITY=(tests/test_engine.py tests/test_prefix_cache.py tests/test_spec_decode.py tests/test_padded_decode.py
            -m "not server" -k "not in_their_own_process")
    BENCH=()
    BENCH_ENV=(env TRELLM_CPU_OPS=0)
    LIMITS=(150 170 200 200)
    PACK=${TRELLM_GPU_PACK:-perf/out/gpu-pack.tar.xz}
    SERVED=("$MODELS/anchor")     # built by the bench step
fi
step kernels "${LIMITS[0]}" "${KERNEL_ENV[@]}" "${PYTEST[@]}" tests/test_kernels.py "${KERNEL_SELECT[@]}"
step parity "${LIMITS[1]}" env TRELLM_CPU_OPS=0 "${PYTEST[@]}" "${PARITY[@]}"
step bench "${LIMITS[2]}" "${BENCH_ENV[@]}" "$PY" perf/gpu_bench.py --out "$OUT" --models "$MODELS" "${BENCH[@]}"
if [ -f "$PACK" ]; then
    step served "${LIMITS[3]}" env PY="$PY" bash perf/gpu_served.sh "$PACK" "${SERVED[0]}" "$OUT/served" \
        "${SERVED[@]:1}"
else
    echo "[gpu_check] served: left out, no $PACK (make it with perf/pack_tritonserver.py $PACK --python X.Y)"
fi
"$PY" perf/gpu_bench.py --summarize "$OUT" >"$OUT/summary.md"
cat "$OUT/summary.md"
! grep -qv " 0 " "$OUT/status.txt"
