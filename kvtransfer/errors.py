"""Exceptions raised by the KV transfer layer."""

from __future__ import annotations

from typing import Any


class KvTransferError(RuntimeError):
    """A KV transfer did not complete; the sender's view of the failure.

    Raised by :meth:`kvtransfer.transport.KvSender.send` when the destination
    is unreachable, the call timed out, the receiver rejected a chunk (corrupt,
    stale, incomplete) or its acknowledgement does not match what was sent.

    Attributes:
        transfer_id: the failed transfer.
        reason: human-readable cause (also the exception message).
    """

    def __init__(self, transfer_id: str, reason: str) -> None:
        super().__init__(f"KV transfer {transfer_id!r} failed: {reason}")
        self.transfer_id = transfer_id
        self.reason = reason


class KvIntegrityError(ValueError):
    """A received chunk fails verification (bad header, dtype, shape or checksum).

    Attributes:
        header: the decoded msgpack header when it parsed (so the receiver can
            tell which transfer the bad chunk belonged to), else ``None``.
    """

    def __init__(self, message: str, header: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.header = header


class StaleTransferError(RuntimeError):
    """A write targets a transfer that is no longer reserved as addressed.

    Raised by a :class:`kvtransfer.transport.KvReceiverSink` when the transfer
    was reclaimed (lease expired, aborted), its generation differs, or the
    block ids are not among the reserved ones. Nothing has been written.
    """


class KvDataPlaneError(RuntimeError):
    """The data plane of a transfer failed: it could not start, or moving a tensor failed or timed out.

    Raised by a transport's data plane (e.g. the torch_dist pair groups); the gRPC
    control plane turns it into a failed transfer (:class:`KvTransferError` on the
    sender, an ``"incomplete: data plane: ..."`` rejection on the receiver).
    """
