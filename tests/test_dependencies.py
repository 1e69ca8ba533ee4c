"""Declared dependencies match the imports (pyproject.toml): every third-party module the product
packages import comes from a distribution in ``[project] dependencies``, every one the tests,
benchmarks and scripts import from one there or in the ``test`` extra, and every declared
distribution is imported (or named below with the reason it is needed without an import).
Modules map to distributions with ``importlib.metadata.packages_distributions()``."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
PRODUCT = tuple(PYPROJECT["tool"]["importlinter"]["root_packages"])
TOOLING = ("tests", "bench", "scripts")
# modules of tests/, bench/ and scripts/ import their siblings by file name (cluster_utils, _common, ...)
SIBLINGS = {p.stem for folder in TOOLING for p in (REPO / folder).glob("*.py")}
OURS = set(PRODUCT) | set(TOOLING) | SIBLINGS | {"__future__"}

# declared, used, but never imported by name
NOT_IMPORTED = {
    "accelerate": "transformers refuses to load a GGUF file without it",
    "jinja2": "transformers renders chat templates with it",
    "pytest-timeout": "pytest plugin: the suite's `timeout` ini option",
    "import-linter": "the `lint-imports` command of scripts/test.sh",
    "grpcio-tools": "tests/test_proto_sync.py runs scripts/gen_proto.py (`python -m grpc_tools.protoc`)",
}
# imported, deliberately not declared
NOT_DECLARED = {"vllm": "bench/_decode_vllm.py runs in its own venv (bench/README.md)"}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _names(requirements: list[str]) -> set[str]:
    return {_norm(re.match(r"[A-Za-z0-9][A-Za-z0-9._-]*", r).group()) for r in requirements}


DEPENDENCIES = _names(PYPROJECT["project"]["dependencies"])
TEST_EXTRA = _names(PYPROJECT["project"]["optional-dependencies"]["test"])


def _third_party_imports(folders: tuple[str, ...]) -> dict[str, set[str]]:
    """``{top-level module: files importing it}`` over every ``.py`` under ``folders``, stdlib and ours left out."""
    found: dict[str, set[str]] = {}
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    modules = [node.module]
                else:
                    continue
                for top in {m.split(".")[0] for m in modules} - OURS - set(sys.stdlib_module_names):
                    found.setdefault(top, set()).add(path.relative_to(REPO).as_posix())
    return found


def _undeclared(imports: dict[str, set[str]], declared: set[str]) -> dict[str, str]:
    dists = packages_distributions()
    return {top: f"{sorted(files)[:3]} import it; installed from {dists.get(top, 'nothing installed')}"
            for top, files in imports.items()
            if top not in NOT_DECLARED and not declared & {_norm(d) for d in dists.get(top, [])}}


def _distributions_of(modules: set[str]) -> set[str]:
    dists = packages_distributions()
    return {_norm(d) for m in modules for d in dists.get(m, [])}


def test_product_imports_are_declared_dependencies():
    missing = _undeclared(_third_party_imports(PRODUCT), DEPENDENCIES)
    assert not missing, f"add to [project] dependencies in pyproject.toml: {missing}"


def test_test_bench_and_script_imports_are_declared():
    missing = _undeclared(_third_party_imports(TOOLING), DEPENDENCIES | TEST_EXTRA)
    assert not missing, f"add to the test extra (or dependencies) in pyproject.toml: {missing}"


def test_every_declared_distribution_is_used():
    used = _distributions_of(set(_third_party_imports(PRODUCT)))
    unused = DEPENDENCIES - used - set(NOT_IMPORTED)
    assert not unused, f"[project] dependencies nothing in the product imports: {sorted(unused)}"
    used |= _distributions_of(set(_third_party_imports(TOOLING)))
    unused = TEST_EXTRA - used - set(NOT_IMPORTED)
    assert not unused, f"test extra nothing imports: {sorted(unused)}"


def test_the_tested_versions_pin_every_declared_distribution():
    pinned = {_norm(line.split("==")[0]) for line in (REPO / "constraints.txt").read_text().splitlines()
              if line and not line.startswith("#")}
    unpinned = (DEPENDENCIES | TEST_EXTRA) - pinned
    assert not unpinned, f"not in constraints.txt: {sorted(unpinned)}"
