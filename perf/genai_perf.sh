#!/usr/bin/env bash
# genai-perf recipe for either entry point over streaming gRPC (Triton's KServe API):
#   ensemble   -> --backend tensorrtllm (TRT-LLM tensor names, [1,1] tensors)
#   vllm_model -> --backend vllm        (text_input + sampling_parameters JSON, [1] tensors)
#
#   perf/genai_perf.sh [ensemble|vllm_model] [GRPC_URL] [extra genai-perf profile args]
#   perf/genai_perf.sh ensemble localhost:8001 --concurrency 8 --request-count 64
#
# genai-perf 0.0.16 wants numpy 2 / pandas 3 and a heap of plotting packages; pinned to numpy<2 and pandas<3 it
# runs, but it lives in its own environment (.venv-genai-perf, made by scripts/setup.sh unless WITH_GENAI_PERF=0;
# this script installs it if it is missing) so the engine's environment stays small. It drives the perf_analyzer
# of .venv (tritonclient[all]), found on PATH, and counts tokens with the served model's tokenizer folder (no model
# hub here): TOKENIZER=hf_models/... to change. Server metrics come from METRICS_URL (default: port 8002 of the
# gRPC host). tests/test_genai_perf.py runs the same command, smaller, against both entry points.
# Deterministic output lengths: genai-perf sends min_length (ensemble) or min_tokens (vllm_model) = max_tokens.
# Its "Output Sequence Length" re-tokenizes the streamed text joined up, so it can differ from the tokens generated
# by a few (BPE merges across token boundaries); add `--extra-inputs return_num_output_tokens:true` to have the
# server's own count in perf/out/genai_perf/<model>/*/profile_export.json. perf_analyzer 2.51 writes stale bytes
# there for declared outputs a response lacks; one that reads as a NaN float leaves the file empty and genai-perf
# fails ("Failed to parse JSON string: ''"), a few runs in a hundred. So this script asks for the float outputs
# (`return_log_probs` for the ensemble, `return_cumulative_logprob` for vllm_model): the server then sends them and
# perf_analyzer reads real values (the cost: one log-softmax per token in the sampler).
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-ensemble}; URL=${2:-localhost:8001}
shift $(( $# < 2 ? $# : 2 ))
case "$MODEL" in
  ensemble) BACKEND=tensorrtllm; FLOATS=return_log_probs:true ;;
  vllm_model) BACKEND=vllm; FLOATS=return_cumulative_logprob:true ;;
  *) echo "unknown entry point $MODEL (ensemble or vllm_model)" >&2; exit 2 ;;
esac
WITH_GENAI_PERF=1 bash scripts/setup.sh >/dev/null
export PATH=$PWD/.venv/bin:$PATH
cudart=$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/nvidia/cuda_runtime/lib
export LD_LIBRARY_PATH=$cudart${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export HF_HUB_OFFLINE=1   # the tokenizer is a local folder
.venv-genai-perf/bin/genai-perf profile -m "$MODEL" --backend "$BACKEND" --endpoint-type kserve --streaming \
  -u "$URL" --tokenizer "${TOKENIZER:-hf_models/tiny-llama}" \
  --server-metrics-url "${METRICS_URL:-http://${URL%:*}:8002/metrics}" \
  --synthetic-input-tokens-mean 128 --synthetic-input-tokens-stddev 0 --output-tokens-mean 64 \
  --output-tokens-mean-deterministic --random-seed 0 --concurrency 4 --request-count 32 --warmup-request-count 4 \
  --extra-inputs "$FLOATS" --artifact-dir "perf/out/genai_perf/$MODEL" "$@"
