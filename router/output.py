"""Turns a decode worker's token deltas into client responses.

Detokenizes incrementally, matches stop strings (holding back text that may be
the start of one) and builds ``GenerateResponse`` messages: one per delta when
streaming, one in total otherwise. The concatenated streamed text equals the
non-streamed text and never contains a stop string. As in vLLM v1, the text also leaves
out the token that ended generation on the worker (EOS or a stop token id: its id stays in
``token_ids`` and counts in the usage); ``include_stop_str_in_output`` keeps both in the text.
Special tokens are left out of the text unless ``skip_special_tokens`` is false (vLLM's). The last message names
the stop that ended generation (``stop_string`` or ``stop_token_id``: vLLM's ``stop_reason``;
the tokenizer's EOS id is not named, also when ``stop_token_ids`` lists it, unless ``ignore_eos``).
"""

from __future__ import annotations

from collections.abc import Collection

from common.detokenizer import IncrementalDetokenizer, StopStringMatcher
from pdcluster.v1 import common_pb2, router_pb2, worker_pb2


class OutputAssembler:
    """Per-request output state on the router.

    Args:
        tokenizer: the model's HF tokenizer.
        request_id: echoed in every response.
        prompt_token_ids: the prompt (detokenizer context, usage).
        stop: stop strings.
        stop_token_ids: the request's stop token ids.
        include_stop: keep the stop string or stop token that ended generation in the text.
        ignore_eos: the request ignores EOS (then an EOS id of ``stop_token_ids`` is named as a stop).
        min_tokens: a stop string ends generation only where it ends in the text of a token after
            the first ``min_tokens`` (vLLM's ``min_tokens``: it may begin earlier; one completed
            earlier is text).
        skip_special_tokens: leave special tokens out of the text.

    The prompt logprobs (:meth:`set_prompt_logprobs`, before the first tokens arrive) go on the first
    message that carries tokens (and on :meth:`whole`).
    """

    def __init__(self, tokenizer, request_id: str, prompt_token_ids: list[int], stop: list[str],
                 stop_token_ids: Collection[int] = (), include_stop: bool = False, min_tokens: int = 0,
                 ignore_eos: bool = False, skip_special_tokens: bool = True) -> None:
        self.request_id = request_id
        self.num_prompt = len(prompt_token_ids)
        self.first_prompt_token = prompt_token_ids[0] if prompt_token_ids else 0
        self.detok = IncrementalDetokenizer(tokenizer, prompt_token_ids, skip_special_tokens)
        self.stops = StopStringMatcher(stop, include_stop) if stop else None
        self.include_stop = include_stop
        eos = None if ignore_eos else getattr(tokenizer, "eos_token_id", None)
        self.request_stop_ids = frozenset(stop_token_ids) - {eos}  # EOS first, as vLLM's check_stop: no stop_reason
        self.stop_reason: dict[str, str | int] = {}  # GenerateResponse's stop_reason field, once one stop ended it
        self.min_tokens = min_tokens
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.logprobs: list[common_pb2.TokenLogprob] = []
        self.finish_reason = common_pb2.FINISH_REASON_UNSPECIFIED
        self.cached_prompt_tokens = 0
        self.prompt_logprobs: list[common_pb2.TokenLogprob] | None = None  # set before the first tokens

    @property
    def finished(self) -> bool:
        return self.finish_reason != common_pb2.FINISH_REASON_UNSPECIFIED

    def add(self, delta: worker_pb2.TokenDelta) -> router_pb2.GenerateResponse:
        """Consume one delta; returns the response carrying its tokens and text.

        When a stop string matches, ``finished`` becomes True with reason STOP and the
        text is cut before the stop string (the caller aborts the decode worker).
        """
        ids = list(delta.token_ids)
        context = min(len(ids), max(0, self.min_tokens - len(self.token_ids)))
        self.token_ids.extend(ids)
        self.logprobs.extend(delta.logprobs)
        reason = delta.finish_reason
        # a worker's STOP is its last token's (EOS or a stop token id; stop strings are matched here)
        shown = ids[:-1] if reason == common_pb2.FINISH_REASON_STOP and not self.include_stop else ids
        early, text = self.detok.add(shown[:context]), self.detok.add(shown[context:])
        if reason != common_pb2.FINISH_REASON_UNSPECIFIED:
            text += self.detok.finish()
        if self.stops is not None:
            early, _ = self.stops.feed(early, match=False)
            text, stopped = self.stops.feed(text)
            text = early + text
            if stopped:
                reason = common_pb2.FINISH_REASON_STOP
                self.stop_reason = {"stop_string": self.stops.matched}
            elif reason != common_pb2.FINISH_REASON_UNSPECIFIED:
                text += self.stops.flush()
        else:
            text = early + text
        if reason == common_pb2.FINISH_REASON_STOP and not self.stop_reason and ids and ids[-1] in self.request_stop_ids:
            self.stop_reason = {"stop_token_id": ids[-1]}
        self.text_parts.append(text)
        self.finish_reason = reason
        first = len(self.token_ids) == len(ids) and bool(ids)
        msg = router_pb2.GenerateResponse(request_id=self.request_id, token_ids=ids, text=text,
                                          finish_reason=reason, logprobs=delta.logprobs, **self.stop_reason,
                                          prompt_logprobs=self.prompt_logprobs if first else None)
        if self.finished:
            msg.usage.CopyFrom(self.usage())
        return msg

    def set_prompt_logprobs(self, entries) -> None:
        """Keep the prefill worker's prompt logprobs (``entries``: prompt token ``i + 1``'s at ``i``) as
        the client's: one per prompt token, the first with its id alone (no logprob, rank 0)."""
        self.prompt_logprobs = [common_pb2.TokenLogprob(token_id=self.first_prompt_token), *entries]

    def usage(self) -> common_pb2.Usage:
        return common_pb2.Usage(prompt_tokens=self.num_prompt, completion_tokens=len(self.token_ids),
                                cached_prompt_tokens=self.cached_prompt_tokens)

    def whole(self) -> router_pb2.GenerateResponse:
        """The single message of a non-streamed request."""
        return router_pb2.GenerateResponse(
            request_id=self.request_id, token_ids=self.token_ids, text="".join(self.text_parts),
            finish_reason=self.finish_reason, usage=self.usage(), logprobs=self.logprobs, **self.stop_reason,
            prompt_logprobs=self.prompt_logprobs)
