"""Conversions of :class:`TokenLogprobs` to the wire (protobuf and msgpack-able dicts)."""

from __future__ import annotations

from engine.step import TokenLogprobs
from pdcluster.v1 import common_pb2


def to_dict(lp: TokenLogprobs | None) -> dict | None:
    return None if lp is None else {"logprob": lp.logprob, "top": [[int(i), float(v)] for i, v in lp.top]}


def from_dict(d: dict | None) -> TokenLogprobs | None:
    return None if d is None else TokenLogprobs(float(d["logprob"]), [(int(i), float(v)) for i, v in d["top"]])


def to_proto(token_id: int, lp: TokenLogprobs | None) -> common_pb2.TokenLogprob:
    msg = common_pb2.TokenLogprob(token_id=token_id, logprob=lp.logprob if lp else 0.0)
    for i, v in (lp.top if lp else []):
        msg.top.add(token_id=i, logprob=v)
    return msg


def from_proto(msg: common_pb2.TokenLogprob) -> TokenLogprobs:
    return TokenLogprobs(msg.logprob, [(t.token_id, t.logprob) for t in msg.top])
