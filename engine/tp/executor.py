"""A tensor-parallel rank > 0: loads its shard, owns its share of the paged KV cache and
runs every step rank 0 hands it, until rank 0 says stop or goes away.

Runs in a process rank 0 spawned (:func:`engine.tp.runner.start_tp_runner`); the step
plans arrive over a pipe from rank 0 (its end closing -> the rank exits), the
activations move over the group's collectives.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from common.model_arch import DecoderArch
from common.model_config import ModelConfig
from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model_runner import ModelRunner
from engine.tp import TpLayout
from engine.tp.group import connect
from engine.tp.layers import load_tp_model

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to start (pickled to it).

    Attributes:
        rank / port: this rank and the port of rank 0's rendezvous store on loopback.
        model: the whole model's config; layout: how it splits.
        cache: KV cache geometry (blocks, block size, dtype) of every rank's share.
        device / dtype: resolved (``"cuda:1"``, ``torch.float32``...).
        num_threads: torch intra-op threads of the rank; timeout_s: how long joining the group and
            loading may wait for the other ranks; step_timeout_s: how long a step's collective may
            wait for a peer (a hung rank) once the rank serves.
        arch: the model family's layer differences (read once, by rank 0).
    """

    rank: int
    port: int
    model: ModelConfig
    layout: TpLayout
    cache: CacheConfig
    device: str
    dtype: torch.dtype
    num_threads: int
    timeout_s: float
    arch: DecoderArch
    step_timeout_s: float


def share(kv: torch.Tensor) -> torch.Tensor:
    """``kv`` made shareable with rank 0 (CPU: moved into shared memory; CUDA: IPC)."""
    return kv.share_memory_() if kv.device.type == "cpu" else kv


def build_rank(spec: RankSpec) -> ModelRunner:
    """Join the group, load this rank's shard and allocate its KV share."""
    torch.set_num_threads(spec.num_threads)
    dev = torch.device(spec.device)
    group = connect(spec.port, spec.rank, spec.layout.size, dev, spec.timeout_s)
    model = load_tp_model(spec.model, spec.layout, group, dev, spec.dtype, arch=spec.arch)
    kv = share(allocate_kv_cache(spec.layout.local_config(spec.model), spec.cache, dev))
    group.set_timeout(spec.step_timeout_s)
    return ModelRunner(model, kv, spec.cache.block_size)


def rank_main(spec: RankSpec, conn, kv_queue) -> None:
    """Process entry of rank ``spec.rank``: hand rank 0 the KV share, then run each plan
    received on ``conn`` (``None`` or a closed pipe ends it)."""
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s")
    try:
        runner = build_rank(spec)
    except Exception as exc:  # noqa: BLE001 - rank 0 must learn why instead of waiting
        kv_queue.put((spec.rank, repr(exc)))
        raise
    kv_queue.put((spec.rank, runner.kv_cache))
    while True:
        try:
            plan = conn.recv()
        except (EOFError, OSError):
            log.info("rank 0 went away; tensor-parallel rank %d exits", spec.rank)
            return
        if plan is None:
            return
        try:
            runner.forward_logits(plan)
        except Exception:
            log.exception("tensor-parallel rank %d failed a step; exiting", spec.rank)
            return
