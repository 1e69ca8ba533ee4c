#!/usr/bin/env bash
# Install everything, then run the whole test suite (real Redis, real local Ray, real gRPC on loopback).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/install.sh
# the architecture's layering contracts (pyproject.toml [tool.importlinter])
lint-imports
python3 -m pytest -q tests "$@"
