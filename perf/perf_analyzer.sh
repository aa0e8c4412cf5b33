#!/usr/bin/env bash
# perf_analyzer over streaming gRPC against either entry point, then TTFT / inter-token latency from its
# per-response timestamps (perf_analyzer 2.51 itself prints request latency and throughput only).
#
#   perf/perf_analyzer.sh [ensemble|vllm_model] [GRPC_URL] [CONCURRENCY_RANGE] [MAX_TOKENS] [extra perf_analyzer args]
#   perf/perf_analyzer.sh ensemble localhost:8001 1:8:1 64
#
# Writes perf/out/perf_analyzer/<model>/{inputs.json,profile_export.json}.
set -euo pipefail
cd "$(dirname "$0")/.."
MODEL=${1:-ensemble}; URL=${2:-localhost:8001}; RANGE=${3:-1:4:1}; MAX_TOKENS=${4:-64}
shift $(( $# < 4 ? $# : 4 ))
OUT=perf/out/perf_analyzer/$MODEL
mkdir -p "$OUT"
bash scripts/setup.sh >/dev/null
PROMPT="The with statement is used to wrap the execution of a block with methods defined by a context manager."
case "$MODEL" in
  ensemble)   # TRT-LLM-shaped: one tensor per field
    printf '{"data":[{"text_input":["%s"],"max_tokens":[%d],"stream":[true],"exclude_input_in_output":[true]}]}\n' \
      "$PROMPT" "$MAX_TOKENS" > "$OUT/inputs.json" ;;
  vllm_model) # vLLM-shaped: sampling fields in one JSON string
    printf '{"data":[{"text_input":["%s"],"stream":[true],"sampling_parameters":["{\\"max_tokens\\": %d}"],"exclude_input_in_output":[true]}]}\n' \
      "$PROMPT" "$MAX_TOKENS" > "$OUT/inputs.json" ;;
  *) echo "unknown entry point $MODEL (ensemble or vllm_model)" >&2; exit 2 ;;
esac
# perf_analyzer from tritonclient[all] links libcudart even on a CPU machine: the pip CUDA runtime provides it.
rm -f "$OUT/profile_export.json"   # perf_analyzer refuses to overwrite it, so a second run would fail
export LD_LIBRARY_PATH=$PWD/.venv/lib/python3.11/site-packages/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
.venv/bin/perf_analyzer -m "$MODEL" -u "$URL" -i grpc --streaming --input-data "$OUT/inputs.json" \
  --concurrency-range "$RANGE" --measurement-interval 5000 --profile-export-file "$OUT/profile_export.json" "$@"
.venv/bin/python perf/pa_summary.py "$OUT/profile_export.json"
