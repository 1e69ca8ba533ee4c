"""The committed generated code in ``pdcluster/v1/`` matches ``proto/pdcluster/v1/*.proto``.

Regenerates every .proto with ``scripts/gen_proto.py`` (the pinned ``grpcio-tools``, then the
servicer bases' placeholder bodies rewritten) into a temporary folder and compares byte for byte,
so a .proto edit without regeneration (or a stale stub left behind after a .proto was deleted)
fails here instead of at runtime. Every method of every service is implemented by pdcluster's own
servicer, so the generated bases' UNIMPLEMENTED answers are never what a pdcluster server gives.
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
REGEN = "scripts/gen_proto.sh  (= python scripts/gen_proto.py, run in the repo root)"
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


def _protos() -> list[Path]:
    protos = sorted(PROTO_DIR.glob("*.proto"))
    assert protos, f"no .proto files under {PROTO_DIR}"
    return protos


def _generate(out: Path) -> None:
    res = subprocess.run([sys.executable, "scripts/gen_proto.py", str(out)], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, f"scripts/gen_proto.py failed ({res.returncode}):\n{res.stderr}"


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


def test_pdclusters_servicers_implement_every_method_of_their_service():
    from decode_worker.server import DecodeWorkerServicer
    from kvtransfer.grpc_receiver import KvTransferServicer
    from pdcluster.v1 import kv_pb2, router_pb2, worker_pb2
    from prefill_worker.server import PrefillWorkerServicer
    from router.service import RouterServicer

    for cls, service in ((RouterServicer, router_pb2.DESCRIPTOR.services_by_name["Router"]),
                         (DecodeWorkerServicer, worker_pb2.DESCRIPTOR.services_by_name["DecodeWorker"]),
                         (PrefillWorkerServicer, worker_pb2.DESCRIPTOR.services_by_name["PrefillWorker"]),
                         (KvTransferServicer, kv_pb2.DESCRIPTOR.services_by_name["KvTransfer"])):
        base = next((b for b in cls.__mro__ if b.__module__.startswith("pdcluster.v1.")), None)
        missing = [m.name for m in service.methods
                   if not callable(getattr(cls, m.name, None)) or getattr(cls, m.name) is getattr(base, m.name, None)]
        assert not missing, f"{cls.__name__} leaves {missing} to the generated base (UNIMPLEMENTED)"


def test_the_servicer_bases_answer_unimplemented_naming_the_method():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        from gen_proto import PLACEHOLDER, answer_unimplemented
    finally:
        sys.path.pop(0)
    source = f"class RouterServicer:\n    def Abort(self, request, context):\n{PLACEHOLDER}"
    assert "'pdcluster.v1.Router/Abort is not served here'" in answer_unimplemented(source)
    with pytest.raises(ValueError, match="outside a servicer method"):
        answer_unimplemented(PLACEHOLDER)
