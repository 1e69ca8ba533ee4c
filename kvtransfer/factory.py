"""Build the sender a :class:`~kvtransfer.config.KvTransferConfig` names."""

from __future__ import annotations

from kvtransfer.config import KvTransferConfig
from kvtransfer.transport import KvSender, get_transport


def create_sender(cfg: KvTransferConfig) -> KvSender:
    """A new sender of the transport ``cfg.transport``.

    Every registered sender factory takes the keyword arguments ``timeout_s``,
    ``max_chunk_bytes``, ``corrupt_chunk_index`` and ``chunk_delay_s``.

    Raises:
        KeyError: ``cfg.transport`` is not registered (the message lists those that are).
    """
    factory = get_transport(cfg.transport).sender_factory
    return factory(timeout_s=cfg.timeout_s, max_chunk_bytes=cfg.max_chunk_bytes,
                   corrupt_chunk_index=cfg.test_corrupt_chunk_index, chunk_delay_s=cfg.test_chunk_delay_s)
