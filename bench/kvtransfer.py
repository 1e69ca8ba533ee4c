"""KV transfer bandwidth and latency per transport for the KV of 1k- and 8k-token prompts
of SmolLM2-135M (float32, 46,080 bytes per token), against a raw loopback TCP copy of the
same bytes and against the prompt's prefill time, all measured in the same run.

1. The prompt (real text cut from ``sonnet.txt``) is prefilled through our
   :class:`ModelRunner` into a sender-side paged cache (prompts over the 2048-token budget
   in chunked steps of 2048); prefill seconds = median of ``--prefill-reps`` runs after a
   warm-up (one run, no warm-up, for prompts over the budget).
2. A receiver process (``bench/_kv_receiver.py``) holds a decode-side cache of the same
   shape and serves gRPC ``KvTransfer.PushKv`` (kvtransfer's servicer, a sink over
   ``TransferTable``) and a raw TCP socket on 127.0.0.1. Each transport pushes the prompt's
   blocks ``--reps`` times from this process (``bench/_kv_measure.py``); latency = median
   seconds from send to acknowledgement, GB/s = payload bytes / that. ``grpc_floor``: gRPC
   Python alone streaming the same messages, framed beforehand, to a handler that drops them.
3. The gRPC path's CPU work stage by stage (same chunks, serial; ``bench/_kv_stages.py``) and,
   with py-spy, where real transfers spend their samples in both processes (``bench/_kv_pyspy.py``).

Per transport and prompt: ``payload_bytes``, ``gb_per_s``, latency, ``ratio_raw_tcp``
(GB/s over raw TCP's GB/s) and ``ratio_prefill_time`` (transfer seconds / prefill seconds).
Writes ``<name>.json`` and ``<name>.md`` under ``--out-dir`` and prints the JSON to stdout.
``--quick`` runs the 1k prompt only (3 repetitions) into a temporary folder.

Usage::

    python bench/kvtransfer.py --quick
    python bench/kvtransfer.py
"""

from __future__ import annotations

import sys
from pathlib import Path

_REPO = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    sys.path.insert(0, str(_REPO))  # the package `kvtransfer` ahead of this script's folder
    from _kv_main import main

    raise SystemExit(main())
elif __name__ == "kvtransfer":
    # Imported under the package's name because bench/ is ahead of the repository root on
    # sys.path (`python bench/<script>.py`, tests that insert bench/): load the package
    # `kvtransfer` in this module's place, so importers get it and not this script.
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "kvtransfer", _REPO / "kvtransfer" / "__init__.py", submodule_search_locations=[str(_REPO / "kvtransfer")])
    _package = importlib.util.module_from_spec(_spec)
    sys.modules["kvtransfer"] = _package
    _spec.loader.exec_module(_package)
