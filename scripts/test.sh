#!/usr/bin/env bash
# Install everything (scripts/install.sh: .venv), then run the whole test suite in that venv
# (real Redis, real local Ray, real gRPC on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# the venv first on PATH: the tests start `pdcluster`, `ray` and Python subprocesses from it
source .venv/bin/activate
# the model cache inside the checkout: nothing the tests read lies outside the repository
export PDCLUSTER_MODEL_CACHE="${PDCLUSTER_MODEL_CACHE:-$PWD/.cache/models}"
# the architecture's layering contracts (pyproject.toml [tool.importlinter])
lint-imports
# one line per test, named as it starts: a run that ends abruptly (a process killed) shows where; the 30
# slowest tests listed at the end (what to trim when the run nears its time budget)
python -m pytest -v --durations=30 tests "$@"
