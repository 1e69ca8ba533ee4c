"""Helpers for tests that run a real local cluster (Ray + Redis + router + workers)."""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import grpc
import torch
from ray._common.utils import get_ray_address_file

from deploy import local
from pdcluster.cli import build_parser
from pdcluster.client import PdclusterClient
from pdcluster.v1 import worker_pb2, worker_pb2_grpc
from router.chat import render_chat
from serving.registry import WorkerRegistry
from serving.security import SecurityConfig, internal_channel


@contextmanager
def running_cluster(state_dir, *extra_args: str):
    """``pdcluster up --local`` with the CLI's own parser, then ``down`` at exit (which leaves no Redis files,
    and no Ray "current cluster" file naming the head it stopped)."""
    args = build_parser().parse_args(["up", "--local", "--port", "0", "--http-port", "0", "--state-dir", str(state_dir),
                                      *extra_args])
    state = local.up(args)
    try:
        yield state
    finally:
        local.down(state_dir)
        assert not state.get("redis_dir") or not Path(state["redis_dir"]).exists(), "down left Redis files behind"
        current = Path(get_ray_address_file(None))
        assert not (current.exists() and current.read_text().strip() == state["ray_address"]), \
            f"down left {current} naming the stopped head {state['ray_address']}"
        left = live_session_members(state["ray_head_pid"]) if state.get("started_ray") else []
        assert not left, f"down left processes of the Ray head's session running: {left}"


def children(pid: int) -> set[int]:
    """Processes whose parent is ``pid`` (from /proc)."""
    kids = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = open(f"/proc/{entry}/stat").read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                kids.add(int(entry))
    return kids


def live_session_members(sid: int, timeout_s: float = 10.0) -> list[str]:
    """Processes of session ``sid`` (a Ray head started by ``up --local`` leads its own session,
    and its workers join it) still running after up to ``timeout_s`` seconds; zombies waiting to
    be reaped do not count. Returns ``["pid command", ...]``."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                text = stat.read_text()
            except OSError:  # exited meanwhile
                continue
            comm, fields = text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session, ...
                left.append(f"{stat.parent.name} {comm}")
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


@contextmanager
def router_client(state: dict, timeout_s: float = 300.0, ready_s: float = 30.0, api_key: str | None = None,
                  tls_ca: bytes | str | None = None):
    """A :class:`PdclusterClient` of the cluster's router (per-call deadline ``timeout_s``
    seconds, presenting ``api_key``, verifying the router's TLS certificate with ``tls_ca``),
    once the router reports SERVING (within ``ready_s`` seconds)."""
    with PdclusterClient(state["router_address"], timeout_s=timeout_s, api_key=api_key, tls_ca=tls_ca) as client:
        client.wait_ready(ready_s)
        yield client


def worker_connect(state: dict):
    """The internal channel factory of the cluster ``state`` describes: ``f(address, options=...)``
    opening a channel to a worker (or KV) port that sends the cluster secret and, with internal TLS,
    presents a certificate of the cluster CA (a KV sender's ``connect``)."""
    return partial(internal_channel, SecurityConfig(cluster_secret=state["cluster_secret"],
                                                    internal_ca_cert=state.get("internal_ca_cert", ""),
                                                    internal_ca_key=state.get("internal_ca_key", "")))


def worker_channel(state: dict, address: str) -> grpc.Channel:
    """A channel to a worker (or KV) port of the cluster ``state`` describes, with its credentials."""
    return worker_connect(state)(address)


def worker_loads(state: dict) -> list[worker_pb2.WorkerLoad]:
    """GetLoad of every live worker, straight from the workers."""
    reg = WorkerRegistry(state["redis_url"], state["cluster"])
    loads = []
    for info, _ in reg.live_workers():
        # a colocated worker's KV lives in its decode-side pool: ask that service
        stub_cls = worker_pb2_grpc.PrefillWorkerStub if info.role == "prefill" else worker_pb2_grpc.DecodeWorkerStub
        loads.append(stub_cls(worker_channel(state, info.address)).GetLoad(worker_pb2.GetLoadRequest(), timeout=5))
    return loads


def assert_no_leak(state: dict, timeout_s: float = 2.0) -> None:
    """Every worker's KV pool is back at its baseline (all blocks free, nothing running)
    within ``timeout_s`` seconds; a registered worker that cannot be reached (killed, its
    record not yet expired) is waited for within the same time."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            loads = worker_loads(state)
        except grpc.RpcError as e:
            # a worker killed just before (a chaos test) stays registered until its heartbeat
            # TTL runs out: wait for the registry to drop it, up to the same deadline
            if e.code() != grpc.StatusCode.UNAVAILABLE or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
            continue
        held = {w.worker_id: (w.num_total_blocks - w.num_free_blocks, w.num_running, w.num_waiting) for w in loads
                if w.num_free_blocks != w.num_total_blocks or w.num_running or w.num_waiting}
        if not held:
            assert loads, "no live worker to check"
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"KV blocks / requests still held after {timeout_s}s: {held}")
        time.sleep(0.05)


def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> tuple[list[int], list[float]]:
    """HF transformers float32 greedy continuation and, per step, the gap between its
    top-2 logits (one prompt: :func:`hf_greedy_batch` with nothing to pad)."""
    return hf_greedy_batch(hf_model, [prompt_ids], max_new_tokens)[0]


def hf_greedy_batch(hf_model, prompts: list[list[int]], max_new_tokens: int, group: int = 10,
                    pad_id: int = 2) -> list[tuple[list[int], list[float]]]:
    """:func:`hf_greedy` of every prompt, ``group`` prompts of similar length per HF ``generate`` call
    (left-padded, masked): at batch 1 each HF decode step streams all the weights for one token, so
    this is ~3x faster for 20 prompts. Padding changes HF's logits only by float rounding (~1e-5
    here), far inside the 1e-2 near-tie rule; each row is cut after its first EOS, as unbatched
    ``generate`` stops there. ``pad_id`` fills the masked positions (any id: they are not attended
    to). Returns one ``(tokens, gaps)`` per prompt, in order (``tests/test_hf_oracle.py``)."""
    eos = hf_model.generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list = [None] * len(prompts)
    for start in range(0, len(order), group):
        rows = order[start:start + group]
        width = max(len(prompts[i]) for i in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for r, i in enumerate(rows):
            ids[r, width - len(prompts[i]):] = torch.tensor(prompts[i])
            mask[r, width - len(prompts[i]):] = 1
        with torch.no_grad():
            gen = hf_model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                                    output_logits=True, return_dict_in_generate=True, pad_token_id=pad_id)
        top2 = torch.stack([step.float().topk(2).values for step in gen.logits], dim=1)  # [rows, steps, 2]
        for r, i in enumerate(rows):
            tokens = gen.sequences[r, width:].tolist()
            n = next((k + 1 for k, t in enumerate(tokens) if t in eos), len(tokens))
            out[i] = (tokens[:n], (top2[r, :n, 0] - top2[r, :n, 1]).tolist())
    return out


def hf_constrained_greedy(hf_model, tokenizer, model_config, prompt_ids, compiled, max_new):
    """HF float32 greedy under xgrammar's own mask (``apply_token_bitmask_inplace``): the oracle of a
    structured output; per step the gap between the masked top-2 logits."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    tokens, gaps = [], []
    hf = HfSteps(hf_model, prompt_ids)
    while len(tokens) < max_new and not matcher.is_terminated():
        logits = hf.logits[None].clone()
        mask = xgr.allocate_token_bitmask(1, model_config.vocab_size)
        matcher.fill_next_token_bitmask(mask)
        xgr.apply_token_bitmask_inplace(logits, mask)
        top2 = logits[0].topk(2).values
        gaps.append(float(top2[0] - top2[1]))
        tokens.append(int(logits[0].argmax()))
        assert matcher.accept_token(tokens[-1])
        hf.append(tokens[-1])
    return tokens, gaps


class HfSteps:
    """HF transformers float32 over a growing sequence, one token per forward through HF's own KV
    cache (as its ``generate``): :attr:`logits` (``[vocab]`` float32) are the next-token logits after
    ``prompt_ids`` and every token :meth:`append` added."""

    def __init__(self, hf_model, prompt_ids: list[int]) -> None:
        self._model = hf_model
        with torch.inference_mode():
            self._out = hf_model(torch.tensor([prompt_ids]), use_cache=True)
        self.logits = self._out.logits[0, -1].float()

    def append(self, token: int) -> None:
        with torch.inference_mode():
            self._out = self._model(torch.tensor([[token]]), cache=self._out.cache, use_cache=True)
        self.logits = self._out.logits[0, -1].float()


def assert_greedy_matches(ours: list[int], ref: list[int], gaps: list[float], label: str = "") -> None:
    """Token-exact, except a divergence where HF's top-2 logits differ by < 1e-2
    (a near tie); after such a divergence the rest is not compared."""
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            assert gaps[i] < 1e-2, (
                f"{label}: token {i} differs (ours {a}, HF {b}) with HF top-2 gap {gaps[i]:.4f} >= 1e-2;"
                f" ours={ours} ref={ref}")
            return
    assert len(ours) == len(ref), f"{label}: length {len(ours)} != HF {len(ref)}; ours={ours} ref={ref}"


__all__ = ["running_cluster", "router_client", "worker_channel", "worker_connect", "worker_loads", "assert_no_leak", "hf_greedy", "hf_greedy_batch", "hf_constrained_greedy",
           "assert_greedy_matches",
           "render_chat", "grpc"]
