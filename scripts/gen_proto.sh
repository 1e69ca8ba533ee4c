#!/usr/bin/env bash
# Regenerate the committed Python protobuf/gRPC code in pdcluster/v1/ from
# proto/pdcluster/v1/*.proto (needs grpcio-tools, pinned in pyproject's [test] extra):
# protoc, then the servicer bases' placeholder bodies rewritten (scripts/gen_proto.py).
# tests/test_proto_sync.py fails until this has been run after a .proto change.
set -euo pipefail
cd "$(dirname "$0")/.."
python scripts/gen_proto.py
