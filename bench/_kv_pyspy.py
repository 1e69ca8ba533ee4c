"""Where the gRPC KV path spends its time: py-spy samples of the sender and the receiver
process during real transfers, each sample classified by its innermost Python frame.

C work (torch copies, CRC32C, gRPC core) is attributed to the Python line that
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

#: the category of the lines where gRPC Python enters its C core to send or receive.
OPERATE = "gRPC core entered through call.operate / start_server_batch (its buffers, HTTP/2, socket I/O)"

#: (category, predicate on (function, file, line text)); first match wins.
RULES = (
    ("idle (waiting on a lock, accept, a queue or the control pipe)",
     lambda f, p, t: any(k in t for k in (".wait(", "accept(", "sys.stdin", "readline", "work_queue.get",
                                          "recv_into(")) or f.startswith("Condition.wait")),
    ("gather (index_select of the blocks into the reused buffer)",
     lambda f, p, t: f.startswith(("gather_blocks", "block_index", "_out_view", "frame_kv_chunk"))),
    ("CRC32C", lambda f, p, t: f.startswith("crc32c") or "crc32" in t),
    ("framing: the copy into the message (frame_bytes)", lambda f, p, t: f.startswith(("frame_bytes", "_varint"))),
    ("splitting the message (parse_frame)", lambda f, p, t: f.startswith(("parse_frame", "_read_varint", "_skip"))),
    ("msgpack header, checks and the tensor view",
     lambda f, p, t: f.startswith(("_kv_header", "_parse_header", "_check_kv_header", "decode_chunk",
                                   "encode_kv_chunk", "tensor_from_payload", "tensor_payload", "_require"))),
    ("cache write (row copies into the reserved blocks)",
     lambda f, p, t: f.startswith(("TransferTable.write", "copy_rows", "scatter_blocks", "scatter_tokens"))),
    ("gRPC's serializer call (_transform)", lambda f, p, t: f.startswith("_transform")),
    (OPERATE, lambda f, p, t: "operate(" in t or "start_server_batch(" in t),
    ("gRPC Python's thread handoffs (Condition notify / enter, queues)",
     lambda f, p, t: f.startswith(("Condition.", "Queue.", "_put", "_take", "_ReadAhead"))),
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


def _stacks(text: str):
    """``(frames, samples)`` of each line of a py-spy ``--format raw`` file."""
    for line in text.splitlines():
        stack, _, n = line.rpartition(" ")
        if stack and n.isdigit():
            yield stack.split(";"), int(n)


def _innermost_python(frames: list[str]) -> str:
    return next((f for f in reversed(frames) if ".py:" in f), frames[-1])


def parse_raw(text: str) -> collections.Counter:
    """``{innermost Python frame: samples}`` of a py-spy ``--format raw`` file (native
    frames below it, with ``--native``, are skipped)."""
    leaves: collections.Counter = collections.Counter()
    for frames, n in _stacks(text):
        leaves[_innermost_python(frames)] += n
    return leaves


def native_breakdown(text: str, category: str, top: int = 6) -> dict:
    """Innermost native frames (``--native``) of the samples whose innermost Python frame is
    in ``category``; an unresolved address counts by its library."""
    leaves: collections.Counter = collections.Counter()
    for frames, n in _stacks(text):
        if classify(_innermost_python(frames)) == category:
            leaf = frames[-1]
            lib = leaf.rsplit("(", 1)[-1].rstrip(")")
            leaves[f"unresolved address in {lib}" if leaf.startswith("0x") else leaf] += n
    total = sum(leaves.values())
    return {"category": category, "samples": total,
            "leaves": [{"frame": f, "samples": c, "share": c / total} for f, c in leaves.most_common(top)]}


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


def record(pids: dict[str, int], run, rate: int = 100, native_category: str | None = None) -> dict:
    """Sample every process of ``pids`` with py-spy while ``run()`` executes.

    Args:
        native_category: sample with ``--native`` (blocking: the process is paused per
            sample) and add ``native`` (:func:`native_breakdown` of this category) per process.

    Returns:
        ``{name: summarize(...)}`` plus ``"wall_s"`` (of ``run``), ``"rate_hz"``, ``"native"``.
    """
    tmp = Path(tempfile.mkdtemp(prefix="kv-pyspy-"))
    mode = ["--native"] if native_category else ["--nonblocking"]
    procs = {name: subprocess.Popen(["py-spy", "record", "--pid", str(pid), "--rate", str(rate), "--format", "raw",
                                     *mode, "--output", str(tmp / f"{name}.txt")],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
             for name, pid in pids.items()}
    time.sleep(1.5)  # attach
    t0 = time.perf_counter()
    run()
    wall = time.perf_counter() - t0
    out: dict = {"wall_s": wall, "rate_hz": rate, "native": bool(native_category)}
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
        text = f.read_text()
        out[name] = summarize(parse_raw(text))
        if native_category:
            out[name]["native"] = native_breakdown(text, native_category)
    shutil.rmtree(tmp, ignore_errors=True)
    return out
