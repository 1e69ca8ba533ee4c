"""The fault-injecting ``"faulty"`` transport (``tests/kv_faults.py``) around ``"grpc"``, through the registry.

Each fault hits chunk 0 of a one-chunk transfer into a real receiver over the decode
worker's reservation table, and gives its documented outcome with nothing written into
the receiver's blocks (a duplicate's first copy aside) and nothing completed.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from kv_helpers import Receiver, faulty_config, sender_cache, start_receiver

from kvtransfer import KvTransferConfig, KvTransferError, KvTransferServicer, TransferState, create_sender

LAYERS, BS = 4, 16
SRC, DST = [3, 1, 0], [2, 5, 7]


@pytest.fixture
def recv() -> Iterator[Receiver]:
    r = start_receiver(LAYERS, 8, BS, faulty_config("drop"))  # the faulty receiver is the inner one
    yield r
    r.server.stop(0)


def _failed_send(recv: Receiver, cfg: KvTransferConfig, during=None) -> str:
    """One transfer of all layers in one chunk with ``cfg``'s sender; its failure reason.
    ``during`` runs in a thread while the send is in flight."""
    sender = create_sender(cfg)
    helper = threading.Thread(target=during) if during is not None else None
    try:
        dest = recv.reserve("t1", DST)
        if helper is not None:
            helper.start()
        with pytest.raises(KvTransferError) as ei:
            sender.send("r1", "t1", dest, sender_cache(LAYERS, 4, BS), SRC, 5, layers_per_chunk=LAYERS)
        assert sender.poll("t1") == TransferState.FAILED
    finally:
        if helper is not None:
            helper.join()
        sender.close()
    assert recv.sink.completed == {}
    return ei.value.reason


def _nothing_written(recv: Receiver) -> bool:
    return recv.sink.writes == 0 and bool(torch.all(recv.cache == -1))


def test_faulty_receiver_is_the_inner_transports(recv) -> None:
    assert isinstance(recv.servicer, KvTransferServicer)


def test_drop_is_refused_as_incomplete(recv) -> None:
    reason = _failed_send(recv, faulty_config("drop", chunk="0"))
    assert "receiver rejected: incomplete: sender sent 1 chunks, 0 received" in reason, reason
    recv.wait_closed("t1")
    assert "incomplete" in recv.sink.failed["t1"] and len(recv.sink.table) == 0
    assert _nothing_written(recv)


def test_corrupt_is_refused_by_its_checksum(recv) -> None:
    reason = _failed_send(recv, faulty_config("corrupt", chunk="0"))
    assert "receiver rejected: corrupt: checksum mismatch" in reason, reason
    recv.wait_closed("t1")
    assert "checksum" in recv.sink.failed["t1"] and len(recv.sink.table) == 0
    assert recv.servicer.poll("t1") == TransferState.FAILED
    assert _nothing_written(recv)


def test_duplicate_is_refused_at_its_second_copy(recv) -> None:
    reason = _failed_send(recv, faulty_config("duplicate", chunk="0"))
    assert "receiver rejected: corrupt: tokens of [0, 48) of layer 0 sent twice" in reason, reason
    recv.wait_closed("t1")
    assert "sent twice" in recv.sink.failed["t1"] and len(recv.sink.table) == 0
    assert recv.sink.writes == 1  # the first copy; the transfer failed, so its blocks serve no request


def test_delay_past_the_deadline_times_out(recv) -> None:
    """The receiver never saw a chunk: it fails nothing, and the reservation waits for its lease."""
    t0 = time.monotonic()
    reason = _failed_send(recv, faulty_config("delay", chunk="0", delay_s="1.5", timeout_s=0.5))
    assert "DEADLINE_EXCEEDED" in reason, reason
    assert time.monotonic() - t0 < 0.5 + 1.0
    assert recv.sink.failed == {} and len(recv.sink.table) == 1  # still reserved
    assert _nothing_written(recv)


def test_delay_past_the_lease_is_stale(recv) -> None:
    """The reservation is reclaimed (as by its lease) while chunk 0 is held: the chunk is turned away."""
    reason = _failed_send(recv, faulty_config("delay", chunk="0", delay_s="0.5"),
                          during=lambda: (time.sleep(0.1), recv.sink.table.close("t1", None)))
    assert "receiver rejected: stale:" in reason, reason
    assert recv.sink.failed == {} and len(recv.sink.table) == 0
    assert _nothing_written(recv)


@pytest.mark.parametrize("options, match", [
    ({}, "fault must be one of"),
    ({"fault": "melt"}, "fault must be one of"),
    ({"fault": "drop", "colour": "red"}, "takes no option"),
    ({"fault": "delay"}, "needs option delay_s"),
    ({"fault": "drop", "chunk": "-1"}, ">= 0"),
    ({"fault": "drop", "inner.x": "1"}, "'grpc' takes no option"),
])
def test_bad_options_are_refused(options, match) -> None:
    cfg = KvTransferConfig(transport="faulty", transport_module="tests.kv_faults", transport_options=options)
    with pytest.raises(ValueError, match=match):
        create_sender(cfg)
