"""Where the gRPC KV path spends its time: py-spy samples of the sender and the receiver
process during real transfers, each sample classified by its innermost Python frame.

C work (torch copies, CRC32, protobuf, gRPC core) is attributed to the Python line that
called it; the line's text decides the category. py-spy's own idle detection does not
work on this machine, so samples whose innermost line is a wait (a lock, ``accept``, the
control pipe, an empty work queue, the idle raw TCP connection) are counted as idle and
left out of the shares. Sampling is ``--nonblocking`` (the processes are not paused; a
sample may be torn).
"""

from __future__ import annotations

import collections
import linecache
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: (category, predicate on (function, file, line text)); first match wins.
RULES = (
    ("idle (waiting on a lock, accept, a queue or the control pipe)",
     lambda f, p, t: any(k in t for k in (".wait(", "accept(", "sys.stdin", "readline", "work_queue.get",
                                          "recv_into(")) or f.startswith("Condition.wait")),
    ("gather (index_select of the blocks)", lambda f, p, t: f.startswith(("gather_blocks", "_index"))),
    ("tobytes copy", lambda f, p, t: f.startswith("tensor_to_bytes")),
    ("CRC32", lambda f, p, t: "crc32" in t),
    ("protobuf: building the KvChunk (payload copied in)", lambda f, p, t: "KvChunk(" in t),
    ("protobuf: serialize / parse (gRPC's serializer call)", lambda f, p, t: f.startswith("_transform")),
    ("copy into a writable tensor (tensor_from_bytes)", lambda f, p, t: f.startswith("tensor_from_bytes")),
    ("cache write (TransferTable.write, index_copy_)", lambda f, p, t: f.startswith("TransferTable.write")),
    ("gRPC: handing a send / receive to the core (call.operate, start_server_batch)",
     lambda f, p, t: "operate(" in t or "start_server_batch(" in t),
    ("gRPC Python's thread handoffs (Condition notify / enter)", lambda f, p, t: f.startswith("Condition.")),
    ("gRPC core: completion-queue poll (socket I/O, HTTP/2, or waiting for them)",
     lambda f, p, t: "next_event(" in t or ".poll(" in t),
)
IDLE = RULES[0][0]


def available() -> bool:
    return shutil.which("py-spy") is not None


def _source_line(path: str, line: int) -> str:
    for root in sys.path:
        candidate = Path(root or ".") / path
        if candidate.is_file():
            return linecache.getline(str(candidate), line).strip()
    return ""


def classify(frame: str) -> str:
    """Category of one py-spy frame ``"function (path:line)"``."""
    func, _, rest = frame.partition(" (")
    path, _, line = rest.rstrip(")").rpartition(":")
    text = _source_line(path, int(line)) if line.isdigit() else ""
    return next((name for name, pred in RULES if pred(func, path, text)), "other")


def parse_raw(text: str) -> collections.Counter:
    """``{innermost frame: samples}`` of a py-spy ``--format raw`` file."""
    leaves: collections.Counter = collections.Counter()
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            leaves[stack.split(";")[-1]] += int(n)
    return leaves


def summarize(leaves: collections.Counter, top: int = 8) -> dict:
    """Samples, idle samples, busy share per category and the busiest innermost lines."""
    cats: collections.Counter = collections.Counter()
    busy_leaves: collections.Counter = collections.Counter()
    for leaf, n in leaves.items():
        c = classify(leaf)
        cats[c] += n
        if c != IDLE:
            busy_leaves[leaf] += n
    busy = sum(n for c, n in cats.items() if c != IDLE)
    return {"samples": sum(cats.values()), "idle_samples": cats[IDLE], "busy_samples": busy,
            "categories": [{"category": c, "samples": n, "share_of_busy": n / busy if busy else 0.0}
                           for c, n in cats.most_common() if c != IDLE],
            "top_lines": [{"frame": f, "samples": n, "share_of_busy": n / busy if busy else 0.0}
                          for f, n in busy_leaves.most_common(top)]}


def record(pids: dict[str, int], run, rate: int = 100) -> dict:
    """Sample every process of ``pids`` with py-spy while ``run()`` executes.

    Returns:
        ``{name: summarize(...)}`` plus ``"wall_s"`` (of ``run``) and ``"rate_hz"``.
    """
    tmp = Path(tempfile.mkdtemp(prefix="kv-pyspy-"))
    procs = {name: subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                                     "--nonblocking", "--output", str(tmp / f"{name}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for name, pid in pids.items()}
    time.sleep(1.5)  # attach
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    out: dict = {"wall_s": wall, "rate_hz": rate}
    for name, p in procs.items():
        p.send_signal(signal.SIGINT)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
        f = tmp / f"{name}.txt"
        if not f.exists():
            raise RuntimeError(f"py-spy wrote nothing for {name}: {p.stderr.read().decode()[-500:]}")
        out[name] = summarize(parse_raw(f.read_text()))
    shutil.rmtree(tmp, ignore_errors=True)
    return out
