#!/usr/bin/env bash
# The served step of perf/gpu_check.sh: tritonserver from perf/pack_tritonserver.py's archive, on a host without
# the nvidia-pytriton wheel (a lent GPU machine), serving the anchor profile through `ensemble` and `llm` over gRPC,
# then the engine alone on the same requests (perf/benchmark.py; served / engine alone is what it prints last).
#
#   perf/gpu_served.sh PACK MODEL_DIR OUT [BENCHMARK_ARGS...]
#
# PACK: the archive (.tar or .tar.xz); MODEL_DIR: the served model; OUT: benchmark.json, the server's log and
# benchmark.log go there. The Python that runs it is $PY (gpu_check.sh's), with the project importable.
set -uo pipefail
PACK=$1 MODEL_DIR=$2 OUT=$3
shift 3
PY=${PY:-python3}
mkdir -p "$OUT"
UNPACKED=$(mktemp -d)
tar xf "$PACK" -C "$UNPACKED" || { echo "served: cannot unpack $PACK"; exit 1; }
HOME_DIR=$UNPACKED/tritonserver
# The stub links this Python's libpython: say so plainly when the image has none to give it.
LIBDIR=$("$PY" -c "import sysconfig; print(sysconfig.get_config_var('LIBDIR') or '')")
MISSING=$(LD_LIBRARY_PATH="$LIBDIR:$HOME_DIR/libs" ldd "$HOME_DIR/backends/python/triton_python_backend_stub" \
          "$HOME_DIR/bin/tritonserver" | grep "not found" | sort -u)
if [ -n "$MISSING" ]; then
    echo "served: libraries not found on this host (is the pack for this Python, $("$PY" -V 2>&1)?):"
    echo "$MISSING"
    exit 1
fi
export TRELLM_TRITONSERVER_HOME=$HOME_DIR
# The Python-backend stubs embed an interpreter that ignores PYTHONPATH but reads its site-packages' .pth files,
# written here for the step's length: the folders through which alone the project is importable (gpu_check.sh's
# links on a GPU image), and where this Python's numpy is 2, the pack's numpy 1.26.4 ahead of it (this server's stub
# sends empty tensors from numpy 2 arrays).
LINES=()
if [ -n "${PYTHONPATH:-}" ] && ! env -u PYTHONPATH "$PY" -c "import trellm_backend" 2>/dev/null; then
    IFS=: read -r -a LINES <<<"$PYTHONPATH"
fi
if [ "$("$PY" -c "import numpy; print(numpy.__version__.split('.')[0])")" -ge 2 ]; then
    LINES+=("import sys; sys.path.insert(0, '$UNPACKED/numpy1')")
fi
PTH=
if [ "${#LINES[@]}" -gt 0 ]; then
    PTH=$("$PY" -c "import site; print(site.getsitepackages()[0])")/trellm-gpu-served.pth
    printf '%s\n' "${LINES[@]}" >"$PTH" || { echo "served: cannot write $PTH for the stubs"; exit 1; }
fi
trap 'rm -rf "$UNPACKED"; [ -z "$PTH" ] || rm -f "$PTH"' EXIT
export PYTHONPATH="$UNPACKED/site${PYTHONPATH:+:$PYTHONPATH}"
"$PY" perf/benchmark.py --start-server --model-dir "$MODEL_DIR" --profiles anchor --model ensemble,llm \
    --baselines engine --out "$OUT" --no-progress "$@" 2>&1 | tee "$OUT/benchmark.log"
exit "${PIPESTATUS[0]}"
