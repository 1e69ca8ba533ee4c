"""Layer-wise streaming: LayerProgress, and senders that ship each layer once it is computed."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from kv_helpers import Receiver, faulty_config, sender_cache, start_receiver, tokens_of

from kvtransfer import GrpcKvSender, KvTransferError, LayerProgress, TransferState, create_sender

LAYERS, BS = 4, 16
SRC, DST = [3, 1, 0], [2, 5, 7]


def test_progress_waits_and_times() -> None:
    p = LayerProgress(3)
    with pytest.raises(KvTransferError, match="timed out"):
        p.wait_layers(1, 0.01)
    p.layer_done(0)
    p.wait_layers(1, 0)
    threading.Timer(0.05, p.layer_done, args=(2,)).start()  # marks layers 1 and 2 at once
    p.wait_layers(3, 2.0)
    threading.Timer(0.05, p.finish, args=(9, {"lp": -1.0})).start()
    assert p.wait_finished(2.0) == (9, {"lp": -1.0})
    times = p.ready_times
    assert times[0] <= times[1] == times[2] <= p.finished_at
    with pytest.raises(ValueError):
        p.wait_layers(4, 0)
    p.fail("late")  # ignored after finish
    assert p.error is None


def test_progress_fail_and_finish_imply() -> None:
    p = LayerProgress(2)
    threading.Timer(0.05, p.fail, args=("oom",)).start()
    with pytest.raises(KvTransferError, match="oom"):
        p.wait_layers(2, 2.0)
    with pytest.raises(KvTransferError, match="oom"):
        p.wait_finished(0)
    r = LayerProgress.ready(2, 4)
    r.wait_layers(2, 0)
    assert r.wait_finished(0) == (4, None) and r.layers_ready == 2
    with pytest.raises(ValueError, match="after layer"):
        q = LayerProgress(3)
        q.layer_done(2)
        q.layer_done(0)


@pytest.fixture
def recv() -> Iterator[Receiver]:
    r = start_receiver(LAYERS, 8, BS)
    yield r
    r.server.stop(0)


def _producer(progress: LayerProgress, pause_s: float, fail_at: int | None = None) -> threading.Thread:
    def run() -> None:
        for layer in range(LAYERS):
            time.sleep(pause_s)
            if layer == fail_at:
                progress.fail("step failed")
                return
            progress.layer_done(layer)
        time.sleep(pause_s)
        progress.finish(11, {"top": {11: -0.1}})

    t = threading.Thread(target=run)
    t.start()
    return t


def test_streaming_send_delivers_everything_and_overlaps(recv) -> None:
    cache = sender_cache(LAYERS, 4, BS)
    sender = GrpcKvSender(timeout_s=10.0)
    try:
        progress = LayerProgress(LAYERS)
        producer = _producer(progress, 0.05)
        result = sender.send("r1", "t1", recv.reserve("t1", DST), cache, SRC, None, layers_per_chunk=1,
                             progress=progress)
        producer.join()
    finally:
        sender.close()
    assert recv.sink.completed == {"t1": 11}
    assert torch.equal(tokens_of(recv.cache, DST, 48), tokens_of(cache, SRC, 48))
    assert result.num_chunks == LAYERS and result.input_finished_at == progress.finished_at
    assert result.first_chunk_at < progress.finished_at  # layer 0 left while later layers "computed"
    assert result.first_chunk_at >= progress.ready_times[0]
    assert result.hidden_fraction == 1.0 and result.seconds_after_finish >= 0
    assert sender.poll("t1") == TransferState.SUCCESS


def test_waiting_for_input_is_polled(recv) -> None:
    sender = GrpcKvSender(timeout_s=10.0)
    progress = LayerProgress(LAYERS)
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", sender.send(
        "r1", "t1", recv.reserve("t1", DST), sender_cache(LAYERS, 4, BS), SRC, None, progress=progress)))
    t.start()
    try:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            try:
                if sender.poll("t1") == TransferState.WAITING_FOR_INPUT:
                    break
            except KeyError:
                pass
            time.sleep(0.01)
        assert sender.poll("t1") == TransferState.WAITING_FOR_INPUT
        progress.layer_done(0)
        progress.finish(3)
        t.join(10)
    finally:
        sender.close()
    assert out["r"].bytes_sent > 0 and sender.poll("t1") == TransferState.SUCCESS


def test_producer_failure_fails_both_sides_and_frees(recv) -> None:
    sender = GrpcKvSender(timeout_s=10.0)
    try:
        progress = LayerProgress(LAYERS)
        producer = _producer(progress, 0.02, fail_at=2)
        with pytest.raises(KvTransferError, match="step failed"):
            sender.send("r1", "t1", recv.reserve("t1", DST), sender_cache(LAYERS, 4, BS), SRC, None,
                        progress=progress)
        producer.join()
    finally:
        sender.close()
    recv.wait_closed("t1")
    assert "t1" in recv.sink.failed and len(recv.sink.table) == 0  # reservation freed
    assert recv.servicer.poll("t1") == sender.poll("t1") == TransferState.FAILED


def test_unpackable_logprobs_from_finish_raise_type_error(recv) -> None:
    sender = GrpcKvSender(timeout_s=10.0)
    try:
        progress = LayerProgress.ready(LAYERS, 1, {"x": object()})
        with pytest.raises(TypeError):
            sender.send("r1", "t1", recv.reserve("t1", DST), sender_cache(LAYERS, 4, BS), SRC, None,
                        progress=progress)
    finally:
        sender.close()
    recv.wait_closed("t1")
    assert "t1" in recv.sink.failed and sender.poll("t1") == TransferState.FAILED


def test_chunk_delay_slows_a_streamed_transfer_only(recv) -> None:
    """Every chunk held 0.05 s on its way (the "faulty" transport): the transfer takes that long and lands intact."""
    sender = create_sender(faulty_config("delay", delay_s="0.05", timeout_s=5.0))
    cache = sender_cache(LAYERS, 4, BS)
    try:
        t0 = time.monotonic()
        sender.send("r1", "t1", recv.reserve("t1", DST), cache, SRC, 2, layers_per_chunk=1)
        assert time.monotonic() - t0 >= LAYERS * 0.05
    finally:
        sender.close()
    assert recv.sink.completed == {"t1": 2}
    assert torch.equal(tokens_of(recv.cache, DST, 48), tokens_of(cache, SRC, 48))
