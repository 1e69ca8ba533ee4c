#!/usr/bin/env bash
# Install everything (scripts/install.sh: .venv), bring a local cluster up (Ray + Redis + router +
# 1 prefill + 1 decode worker serving SmolLM2-135M-Instruct on CPU), generate from a few real
# prompts, and bring it down. STATE_DIR, PORT and HTTP_PORT (default .demo-state in this checkout, 50051,
# 8000) keep it apart from a cluster of yours. The model is dequantized into $PDCLUSTER_MODEL_CACHE
# (default .cache/models in this checkout): nothing the demo reads lies outside the repository.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
source .venv/bin/activate  # pdcluster and python from the venv install.sh made
STATE_DIR="${STATE_DIR:-$PWD/.demo-state}"
export PDCLUSTER_MODEL_CACHE="${PDCLUSTER_MODEL_CACHE:-$PWD/.cache/models}"
pdcluster down --state-dir "$STATE_DIR" >/dev/null 2>&1 || true
trap 'pdcluster down --state-dir "$STATE_DIR"' EXIT
pdcluster up --local --prefill 1 --decode 1 --port "${PORT:-50051}" --http-port "${HTTP_PORT:-8000}" \
  --state-dir "$STATE_DIR"
pdcluster status --state-dir "$STATE_DIR"
mkdir -p "$STATE_DIR"
PROMPTS="$STATE_DIR/demo-prompts.txt"
python - "$PROMPTS" <<'PY'
import json, pathlib, sys
rows = [json.loads(l) for l in pathlib.Path("loadtest/data/prompts/mt_bench_question.jsonl").read_text().splitlines()]
prompts = [r["turns"][0] for r in rows[:3]]
pathlib.Path(sys.argv[1]).write_text("".join(p + "\n" for p in prompts))
PY
while IFS= read -r prompt; do
  echo; echo "### $prompt"
  pdcluster generate --state-dir "$STATE_DIR" --chat --stream --max-tokens 64 --temperature 0 "$prompt"
done < "$PROMPTS"
rm -f "$PROMPTS"
echo; echo "### raw completion, sampled with a seed"
pdcluster generate --state-dir "$STATE_DIR" --max-tokens 32 --temperature 0.8 --seed 7 "Once upon a time"
echo; echo "### structured output: the answer constrained to a JSON schema"
pdcluster generate --state-dir "$STATE_DIR" --chat --max-tokens 48 --temperature 0 \
  --structured-outputs '{"json": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
    "country": {"type": "string", "maxLength": 20}}, "required": ["city", "country"]}}' \
  "Name the capital of France as JSON."
