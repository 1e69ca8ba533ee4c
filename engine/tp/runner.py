"""Rank 0 of a tensor-parallel worker: a :class:`~engine.model_runner.ModelRunner` that
starts ranks ``1..size-1`` as processes on this node (``torch.multiprocessing``, spawn),
hands each of them every step's plan before running the step on its own shard, and
holds every rank's KV share (shared memory on CPU, CUDA IPC on GPU) so the KV transfer
can read and write each rank's heads (:attr:`TpModelRunner.kv_parts`)."""

from __future__ import annotations

import logging
import queue
from dataclasses import replace

import torch
import torch.multiprocessing as mp

from common.model_arch import DecoderArch
from common.model_config import ModelConfig
from engine.config import CacheConfig
from engine.kv_cache import allocate_kv_cache
from engine.model.families import load_arch
from engine.model_runner import ModelRunner
from engine.step import StepOutput, StepPlan
from engine.tp import TpLayout
from engine.tp.executor import RankSpec, rank_main
from engine.tp.group import TpGroup, host_store
from engine.tp.layers import load_tp_model

log = logging.getLogger(__name__)


class TpModelRunner(ModelRunner):
    """Rank 0's runner. ``conns`` / ``procs``: the pipes to and processes of ranks 1.. ;
    ``shards``: every rank's KV cache ``[L, 2, num_blocks, block_size, local_kv_heads, D]``
    (``shards[0]`` is this rank's own); ``store``: the group's rendezvous, kept up as long as the group."""

    def __init__(self, model, shards: list[torch.Tensor], block_size: int, layout: TpLayout, conns, procs,
                 store=None) -> None:
        super().__init__(model, shards[0], block_size)
        self.layout, self.shards, self.conns, self.procs, self.store = layout, shards, conns, procs, store
        self._failed_step = ""  # why a forward failed here ("": none did); after one the ranks are out of step
        self._told = False  # on_broken called

    @property
    def kv_parts(self) -> list[tuple[torch.Tensor, int, int]]:
        return [(s, *self.layout.kv_heads(r)) for r, s in enumerate(self.shards)]

    def execute(self, plan: StepPlan) -> StepOutput:
        """Send the plan (without callbacks, RNGs, the token histories and the bitmasks
        the sampler alone reads) to every rank, then run it here; see :meth:`ModelRunner.execute`.

        Raises:
            RuntimeError: a rank is gone (its pipe closed), a collective timed out (a rank hung: after
                :data:`STEP_TIMEOUT_S` by default), or an earlier step's forward failed.
        """
        reason = self.broken()
        if reason:
            self._tell_broken(reason)
            raise RuntimeError(f"{reason}; it cannot run steps")
        lean = StepPlan([replace(s, generator=None, prompt_token_ids=(), output_token_ids=(), stop_ids=(),
                                 token_bitmask=None, banned_ids=())
                         for s in plan.seqs])
        for c in self.conns:
            c.send(lean)
        return super().execute(plan)

    def forward_logits(self, plan: StepPlan):
        """:meth:`ModelRunner.forward_logits`, remembering a failure: the other ranks ran this forward's
        collectives without this one, or wait in one it never joins (a collective that timed out: a
        rank hung), so the group cannot run another step (:meth:`broken`)."""
        try:
            return super().forward_logits(plan)
        except Exception as e:
            self._failed_step = f"a tensor-parallel step failed on rank 0 ({type(e).__name__}: {e})"
            self._tell_broken(self.broken())
            raise

    def _tell_broken(self, reason: str) -> None:
        """``on_broken(reason)``, the first time only."""
        if self.on_broken is not None and not self._told:
            self._told = True
            self.on_broken(reason)

    def broken(self) -> str:
        """``"tensor-parallel ranks [r, ...] of this worker are gone"`` once a rank's process has exited
        (killed, or it failed a step: :func:`~engine.tp.executor.rank_main`), why a forward failed here
        once one did (a collective timed out, a hung rank), else ``""``."""
        dead = [r + 1 for r, p in enumerate(self.procs) if not p.is_alive()]
        return f"tensor-parallel ranks {dead} of this worker are gone" if dead else self._failed_step

    def close(self) -> None:
        """Stop the ranks (each exits on ``None``; killed after 5 s)."""
        stop_ranks(self.conns, self.procs)


def stop_ranks(conns, procs) -> None:
    """Tell each rank to stop, close its pipe, wait 5 s, then kill what is still alive."""
    for c in conns:
        try:
            c.send(None)
            c.close()
        except OSError:
            pass
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(1)


def _collect_shards(kv_queue, n: int, timeout_s: float) -> dict[int, torch.Tensor]:
    got: dict[int, torch.Tensor] = {}
    while len(got) < n:
        try:
            rank, kv = kv_queue.get(timeout=timeout_s)
        except queue.Empty:
            raise RuntimeError(f"tensor-parallel ranks {sorted(set(range(1, n + 1)) - set(got))} did not start "
                               f"within {timeout_s}s") from None
        if isinstance(kv, str):
            raise RuntimeError(f"tensor-parallel rank {rank} failed to start: {kv}")
        got[rank] = kv
    return got


STEP_TIMEOUT_S = 30.0
"""Seconds a step's collective waits for a peer rank before it raises (seconds; a rank that hung, e.g.
stopped with SIGSTOP): the step fails, the runner reports itself broken and its worker leaves the registry
to be started again (:mod:`serving.worker_host`). Ranks run the same layers in step, so a healthy peer is
late by one layer's imbalance at most; the ranks' start and model load have ``timeout_s`` instead."""


def start_tp_runner(model_cfg: ModelConfig, cache: CacheConfig, size: int, device: torch.device,
                    dtype: torch.dtype, num_threads: int, timeout_s: float = 300.0,
                    arch: DecoderArch | None = None, step_timeout_s: float = STEP_TIMEOUT_S) -> TpModelRunner:
    """Start ranks ``1..size-1`` (rank ``r`` on ``cuda:r`` when ``device`` is CUDA), load
    this rank's shard, and return rank 0's runner once every rank holds its KV share.

    ``timeout_s``: seconds the ranks' start, the group's rendezvous and the model load may take;
    ``step_timeout_s``: seconds a step's collective then waits for a peer (:data:`STEP_TIMEOUT_S`).

    ``arch``: the family's layer differences; None reads them here, once for every rank
    (:func:`engine.model.families.load_arch`).

    Raises:
        ConfigError: the model does not split over ``size`` ranks.
        RuntimeError: a rank failed or did not start within ``timeout_s`` seconds.
    """
    layout = TpLayout.of(model_cfg, size)
    arch = arch or load_arch(model_cfg.path)
    store = host_store(size, timeout_s)
    ctx = mp.get_context("spawn")
    kv_queue = ctx.Queue()
    conns, procs = [], []
    for r in range(1, size):
        dev = f"cuda:{r}" if device.type == "cuda" else str(device)
        spec = RankSpec(r, store.port, model_cfg, layout, cache, dev, dtype, num_threads, timeout_s, arch,
                        step_timeout_s)
        here, there = ctx.Pipe()
        p = ctx.Process(target=rank_main, args=(spec, there, kv_queue), daemon=True, name=f"tp-rank{r}")
        p.start()
        there.close()
        conns.append(here)
        procs.append(p)
    try:
        group = TpGroup(store, 0, size, device, timeout_s)
        model = load_tp_model(model_cfg, layout, group, device, dtype, arch=arch)
        own = allocate_kv_cache(layout.local_config(model_cfg), cache, device)  # read by this process only
        others = _collect_shards(kv_queue, size - 1, timeout_s)
        group.set_timeout(step_timeout_s)
    except BaseException:
        stop_ranks(conns, procs)
        raise
    log.info("tensor-parallel worker: %d ranks, %d/%d heads and %d KV heads per rank", size, layout.local_heads,
             layout.num_heads, layout.local_kv_heads)
    return TpModelRunner(model, [own] + [others[r] for r in range(1, size)], cache.block_size, layout, conns, procs,
                         store)
