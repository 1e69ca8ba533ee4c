"""The architecture's rules that import-linter cannot see (its contracts are in pyproject.toml
and run as ``lint-imports`` in scripts/test.sh): the router process loads no torch, and no
source file or function outgrows the size the developers' guide allows."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 400
MAX_FUNCTION_LINES = 60
PACKAGES = ("common", "engine", "kvtransfer", "serving", "router", "prefill_worker", "decode_worker",
            "colocated_worker", "deploy", "loadtest", "pdcluster", "bench", "scripts", "tests")


def _sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (REPO / pkg).rglob("*.py")]
    # generated protobuf/gRPC stubs are exempt
    return sorted(p for p in files if "pdcluster/v1" not in p.as_posix())


def test_router_loads_without_torch():
    code = ("import sys\nimport router.server, router.service\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'kvtransfer'))\n"
            "assert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_router_actor_process_loads_without_torch():
    """A router's Ray actor process also imports :mod:`deploy.actors` (its actor class): it may
    read the workers' configuration declarations, never torch or engine/KV code."""
    code = ("import sys\nimport router.server, router.service, deploy.actors\n"
            "config = {'engine', 'engine.config', 'kvtransfer', 'kvtransfer.config'}\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'kvtransfer', "
            "'prefill_worker', 'decode_worker', 'colocated_worker') and m not in config)\n"
            "assert not bad, bad\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr


def test_no_source_file_over_400_lines():
    long = {str(p.relative_to(REPO)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > MAX_FILE_LINES}
    assert not long, f"files over {MAX_FILE_LINES} lines: {long}"


def test_no_function_over_60_lines():
    long = {}
    for p in _sources():
        if p.parent.name == "bench" and p.name.endswith("_report.py"):
            continue  # benchmarks' report writers (markdown tables) are exempt
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    long[f"{p.relative_to(REPO)}:{node.lineno} {node.name}"] = n
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines: {long}"
