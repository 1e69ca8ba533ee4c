"""The committed generated code in ``pdcluster/v1/`` matches ``proto/pdcluster/v1/*.proto``.

Regenerates every .proto with the pinned ``grpcio-tools`` into a temporary folder
and compares byte for byte, so a .proto edit without regeneration (or a stale
stub left behind after a .proto was deleted) fails here instead of at runtime.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("grpc_tools", reason="grpcio-tools is needed to regenerate the protos")

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto" / "pdcluster" / "v1"
GEN_DIR = ROOT / "pdcluster" / "v1"
REGEN = (
    "scripts/gen_proto.sh  (= python -m grpc_tools.protoc -I proto --python_out=. "
    "--grpc_python_out=. --pyi_out=. proto/pdcluster/v1/*.proto, run in the repo root)"
)
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _protos() -> list[Path]:
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files under {PROTO_DIR}"
    return protos


def _generate(out: Path) -> None:
    cmd = [
        sys.executable, "-m", "grpc_tools.protoc", "-I", "proto",
        f"--python_out={out}", f"--grpc_python_out={out}", f"--pyi_out={out}",
        *(str(p.relative_to(ROOT)) for p in _protos()),
    ]
    res = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"protoc failed ({res.returncode}):\n{res.stderr}"


def test_generated_code_matches_protos(tmp_path):
    _generate(tmp_path)
    fresh_dir = tmp_path / "pdcluster" / "v1"
    fresh = sorted(p.name for p in fresh_dir.iterdir())
    # three outputs per .proto, nothing else
    assert fresh == sorted(p.stem + s for p in _protos() for s in SUFFIXES)
    stale = []
    for name in fresh:
        committed = GEN_DIR / name
        if not committed.exists() or committed.read_bytes() != (fresh_dir / name).read_bytes():
            stale.append(name)
    assert not stale, (
        f"pdcluster/v1/ is out of date with proto/pdcluster/v1/ for {stale}; "
        f"regenerate with {REGEN}"
    )


def test_no_generated_file_without_proto():
    stems = {p.stem for p in _protos()}
    orphans = [
        p.name for p in sorted(GEN_DIR.iterdir())
        if p.name.endswith(SUFFIXES) and p.name.split("_pb2")[0] not in stems
    ]
    assert not orphans, (
        f"pdcluster/v1/ holds generated files whose .proto is gone: {orphans}; delete them and "
        f"regenerate with {REGEN}"
    )


def test_generated_modules_import_and_name_their_proto():
    from pdcluster.v1 import common_pb2, kv_pb2, router_pb2, worker_pb2

    for mod, proto in ((common_pb2, "common"), (kv_pb2, "kv"), (router_pb2, "router"), (worker_pb2, "worker")):
        assert mod.DESCRIPTOR.name == f"pdcluster/v1/{proto}.proto"
        assert mod.DESCRIPTOR.package == "pdcluster.v1"
