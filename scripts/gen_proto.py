"""Generate the Python protobuf/gRPC code of ``proto/pdcluster/v1/*.proto`` into ``OUT`` (default: the
repository root, i.e. the committed ``pdcluster/v1/``), with the pinned ``grpcio-tools``.

grpc-tools gives each generated servicer base class a body per method that sets UNIMPLEMENTED and
raises ``NotImplementedError('Method not implemented!')``. pdcluster's servicers implement every
method (tests/test_proto_sync.py checks it); the base classes' bodies are rewritten here to the one
answer they stand for, ``context.abort(UNIMPLEMENTED, '<service>/<method> is not served here')``,
so the committed code carries no placeholder. ``tests/test_proto_sync.py`` runs this script and
compares its output with the committed files byte for byte.

Usage: ``python scripts/gen_proto.py [OUT]`` (``bash scripts/gen_proto.sh`` runs it in place).
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTOS = sorted((ROOT / "proto" / "pdcluster" / "v1").glob("*.proto"))
PLACEHOLDER = ("        context.set_code(grpc.StatusCode.UNIMPLEMENTED)\n"
               "        context.set_details('Method not implemented!')\n"
               "        raise NotImplementedError('Method not implemented!')\n")


def answer_unimplemented(source: str, package: str = "pdcluster.v1") -> str:
    """``source`` (a generated ``*_pb2_grpc.py``) with each servicer method's placeholder body replaced
    by an UNIMPLEMENTED answer naming the method.

    Raises:
        ValueError: a placeholder outside a ``class <Service>Servicer`` method (grpc-tools changed shape).
    """
    out, service, method = [], None, None
    lines = source.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        if m := re.match(r"class (\w+)Servicer\b", line):
            service = m.group(1)
        elif m := re.match(r"    def (\w+)\(self, ", line):
            method = m.group(1)
        if "".join(lines[i:i + 3]) == PLACEHOLDER:
            if service is None or method is None:
                raise ValueError(f"a placeholder body outside a servicer method at line {i + 1}")
            out.append(f"        context.abort(grpc.StatusCode.UNIMPLEMENTED, "
                       f"'{package}.{service}/{method} is not served here')\n")
            i += 3
            continue
        out.append(line)
        i += 1
    return "".join(out)


def generate(out: Path) -> None:
    """Run protoc for every .proto into ``out``, then rewrite the servicer placeholders.

    Raises:
        RuntimeError: protoc failed (its stderr in the message).
    """
    res = subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", f"--python_out={out}",
                          f"--grpc_python_out={out}", f"--pyi_out={out}", *(str(p.relative_to(ROOT)) for p in PROTOS)],
                         cwd=ROOT, capture_output=True, text=True)
    if res.returncode != 0:
        raise RuntimeError(f"protoc failed ({res.returncode}):\n{res.stderr}")
    for path in sorted((out / "pdcluster" / "v1").glob("*_pb2_grpc.py")):
        path.write_text(answer_unimplemented(path.read_text()))


if __name__ == "__main__":
    generate(Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT)
