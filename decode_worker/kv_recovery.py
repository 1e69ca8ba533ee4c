"""What a decode worker does when a reservation's KV will not arrive.

Three triggers close a transfer before its KV was delivered:

* the KV receiver reports it failed (corrupt chunk, incomplete stream): ``kv_failed``;
* its lease expires (the prefill worker went silent);
* the router reports that the prefill side failed (``DecodeWorker.FailTransfer``).

Each one applies ``SchedulerConfig.kv_failure_policy`` (the handlers live in
:class:`decode_worker.scheduler.DecodeScheduler`, which owns every state transition):

* ``"error"``: the request ends with UNAVAILABLE and its blocks go back to the pool.
* ``"recompute"``: the request keeps its reserved prompt blocks and is rebuilt here
  through the preemption-recompute path: ``prompt[:-1]`` is computed without
  sampling, then a decode step feeding ``prompt[-1]`` at position
  ``len(prompt) - 1`` samples the first token. The first draw of a seeded request's
  generator then happens here (no draw is skipped, unlike a delivered transfer whose
  first token the prefill worker drew), so its token stream equals a normal run's.

Closing the transfer happens under the transfer table's lock, so a chunk of the
failed transfer that arrives later can never write into the (kept or reused) blocks.
"""

from __future__ import annotations

import enum


class KvFailureOutcome(enum.Enum):
    """What became of a request whose prefill side was reported failed."""

    UNKNOWN_REQUEST = "unknown_request"  # not here (ended) or not waiting for that transfer
    FAILED = "failed"                    # policy "error": ended with UNAVAILABLE
    RECOMPUTING = "recomputing"          # its KV is (being) rebuilt here; decoding goes on
    KV_COMPLETE = "kv_complete"          # the KV had arrived already; decoding goes on
