"""The process group of one worker's tensor-parallel ranks (gloo on CPU, NCCL on CUDA).

Built from a :class:`torch.distributed.TCPStore` that rank 0 hosts on loopback, without
the global default group, so a worker's own ``torch.distributed`` use (the
``torch_dist`` KV transport) stays independent of it.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist


def host_store(size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's store on ``127.0.0.1`` (a free port: ``store.port``)."""
    return dist.TCPStore("127.0.0.1", 0, size, True, timeout=datetime.timedelta(seconds=timeout_s),
                         wait_for_workers=False)


class TpGroup:
    """Collectives over the ranks of one worker.

    Args:
        store: the rendezvous (rank 0's :func:`host_store`, or a client of it).
        rank / size: this rank, all ranks.
        device: where the tensors live (``cuda`` -> NCCL, else gloo).
        timeout_s: seconds a collective may wait for a peer before it raises.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        self.rank, self.size = rank, size
        timeout = datetime.timedelta(seconds=timeout_s)
        device = torch.device(device)
        if device.type == "cuda":
            torch.cuda.set_device(device.index or 0)
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(store, rank, size, timeout)

    def set_timeout(self, timeout_s: float) -> None:
        """Let every later collective wait ``timeout_s`` seconds for a peer before it raises (the group
        is built with a longer one, which covers the ranks' start and model load)."""
        self.pg.set_timeout(datetime.timedelta(seconds=timeout_s))

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks, in place; returns ``t``."""
        self.pg.allreduce([t]).wait()
        return t

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's ``t`` (same shape everywhere), in rank order."""
        out = [torch.empty_like(t) for _ in range(self.size)]
        self.pg.allgather([out], [t.contiguous()]).wait()
        return out


def connect(port: int, rank: int, size: int, device: torch.device, timeout_s: float) -> TpGroup:
    """Rank ``rank`` (> 0) joins the group whose store rank 0 hosts on ``port``."""
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=timeout_s))
    return TpGroup(store, rank, size, device, timeout_s)
