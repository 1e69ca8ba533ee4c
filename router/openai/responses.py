"""The router's ``GenerateResponse`` messages -> OpenAI response and stream-chunk bodies.

Shapes from the OpenAI API reference: ``text_completion`` / ``chat.completion`` objects,
``chat.completion.chunk`` stream chunks (the first of each choice carrying only ``role``), ``usage`` with
``prompt_tokens_details.cached_tokens``, completions ``logprobs`` as ``tokens`` /
``token_logprobs`` / ``top_logprobs`` / ``text_offset``, chat ``logprobs.content`` entries
with ``token``, ``logprob``, ``bytes`` and ``top_logprobs``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from pdcluster.v1 import common_pb2
from router.openai.echo import Echo, echo_of
from router.answer import AnswerReader, AnswerReading
from router.tool_parsers import CallDelta
from router.openai.chat import answer_role

FINISH = {common_pb2.FINISH_REASON_STOP: "stop", common_pb2.FINISH_REASON_LENGTH: "length",
          common_pb2.FINISH_REASON_ABORT: "abort"}


def finish_reason(msg) -> str | None:
    return FINISH.get(msg.finish_reason)


def stop_reason(msg) -> str | int | None:
    """vLLM's ``stop_reason`` of a choice: the stop string or stop token id that ended it, ``None``
    otherwise (an EOS token, a length limit, a message before the last)."""
    which = msg.WhichOneof("stop_reason")
    return None if which is None else getattr(msg, which)


def usage(prompt: int, completion: int, cached: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


@dataclass
class StreamUsage:
    """What a stream reports of its usage.

    Attributes:
        final: a last chunk with the request's usage (``stream_options.include_usage``).
        prompts: each choice's prompt tokens when every chunk carries its choice's usage so far
            (vLLM's ``stream_options.continuous_usage_stats``, with ``include_usage``); ``None``: off.
    """

    final: bool = False
    prompts: list[int] | None = None
    _completion: dict[int, int] = field(default_factory=dict)

    def add(self, index: int, tokens: int) -> dict | None:
        """Count ``tokens`` more of choice ``index``; returns the usage its chunk carries (``None``: off,
        nothing counted)."""
        if self.prompts is None:
            return None
        self._completion[index] = done = self._completion.get(index, 0) + tokens
        prompt = self.prompts[index]
        return {"prompt_tokens": prompt, "completion_tokens": done, "total_tokens": prompt + done}


def totals(usages: dict[int, common_pb2.Usage], n: int) -> tuple[int, int, int]:
    """Prompt, completion and cached tokens of a request: each prompt counted once (its
    ``n`` samples share it; cached = the most any sample found in the prefix cache),
    completions summed over every choice."""
    prompt = cached = 0
    for p in range((max(usages) // n) + 1 if usages else 0):
        samples = [usages[i] for i in range(p * n, p * n + n) if i in usages]
        if samples:
            prompt += samples[0].prompt_tokens
            cached += max(u.cached_prompt_tokens for u in samples)
    return prompt, sum(u.completion_tokens for u in usages.values()), cached


class LogprobText:
    """Token strings for logprobs: each token decoded alone, as vLLM reports them, or with
    ``token_ids`` as ``"token_id:<id>"`` (vLLM's ``return_tokens_as_token_ids``, for clients that
    need the ids of tokens that do not decode alone)."""

    def __init__(self, tokenizer, token_ids: bool = False) -> None:
        self.tokenizer = tokenizer
        self.token_ids = token_ids

    def token(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.token_ids else self.tokenizer.decode([token_id])

    def chat(self, logprobs, top_n: int) -> list[dict]:
        """``logprobs.content`` entries of chat for ``TokenLogprob`` messages."""
        out = []
        for lp in logprobs:
            text = self.token(lp.token_id)
            tops = [{"token": (t := self.token(x.token_id)), "logprob": x.logprob, "bytes": list(t.encode())}
                    for x in list(lp.top)[:top_n]]
            out.append({"token": text, "logprob": lp.logprob, "bytes": list(text.encode()), "top_logprobs": tops})
        return out

    def prompt_entry(self, lp) -> dict:
        """One entry of vLLM's ``prompt_logprobs`` for a prompt token's ``TokenLogprob``: token id ->
        ``{"logprob", "rank", "decoded_token"}``, the prompt token first (its rank), then each other
        alternative (ranks 1, 2, ... in order), as vLLM orders them."""
        entry = {lp.token_id: {"logprob": lp.logprob, "rank": lp.rank or None, "decoded_token": self.token(lp.token_id)}}
        for rank, x in enumerate(lp.top, 1):
            entry.setdefault(x.token_id, {"logprob": x.logprob, "rank": rank, "decoded_token": self.token(x.token_id)})
        return entry

    def completion(self, logprobs, offset: int, top_n: int) -> dict:
        """Completions-style ``logprobs`` for ``TokenLogprob`` messages whose text starts at ``offset``;
        each ``top_logprobs`` entry holds the ``top_n`` most likely tokens and the sampled one (``top_n``
        + 1 entries when it is not among them; with ``top_n`` 0 the sampled one alone), as OpenAI's API
        defines it and vLLM answers (``serving_completion.py``, ``_create_completion_logprobs``)."""
        tokens, lps, tops, offsets = [], [], [], []
        for lp in logprobs:
            text = self.token(lp.token_id)
            tokens.append(text)
            lps.append(lp.logprob)
            top = {self.token(x.token_id): x.logprob for x in list(lp.top)[:top_n]}
            top.setdefault(text, lp.logprob)
            tops.append(top)
            offsets.append(offset)
            offset += len(self.tokenizer.decode([lp.token_id])) if self.token_ids else len(text)  # as without ids
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


class ResponseBuilder:
    """Bodies of one HTTP request (``kind``: ``"chat"`` or ``"completion"``; ``role``: the chat
    answer's, ``assistant`` unless the request continued another role's message, as vLLM names it).
    A non-streamed body carries vLLM's ``prompt_logprobs`` (``null`` unless asked for): ``None`` for the
    first prompt token, then one :meth:`LogprobText.prompt_entry` per token; on each completions
    choice, once at the top of a chat body (its choices share the prompt). With ``echo``
    (:class:`router.openai.echo.Echo`) a completions choice's text starts with its prompt's (a
    stream's first chunk of the choice), and so do its logprobs (the first prompt token's logprob and
    top entries are ``None``, as vLLM's). With a ``reading`` a chat answer's text is read into
    ``reasoning_content``, content and ``tool_calls`` (:meth:`_message`, streamed by :meth:`_delta`)."""

    def __init__(self, kind: str, request_id: str, model: str, tokenizer, logprobs: bool,
                 token_ids: bool = False, role: str = "assistant", prompt_logprobs: bool = False,
                 echo: Echo | None = None, reading: AnswerReading | None = None) -> None:
        self.kind, self.id, self.model, self.role = kind, request_id, model, role
        self.created = int(time.time())
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.echo = echo
        self._echoed: set[int] = set()  # streamed choices whose prompt went out
        self.reading = reading
        self._readers: dict[int, AnswerReader] = {}  # a streamed choice's
        self.text = LogprobText(tokenizer, token_ids)
        self.tokenizer = tokenizer
        self.object = "chat.completion" if kind == "chat" else "text_completion"

    def _envelope(self, obj: str, choices: list[dict]) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def _logprobs(self, msgs, top_n: int, offset: int = 0):
        lps = [lp for m in msgs for lp in m.logprobs]
        if not self.logprobs:
            return None
        if self.kind == "chat":
            return {"content": self.text.chat(lps, top_n)}
        return self.text.completion(lps, offset, top_n)

    def _prompt_logprobs(self, msgs) -> list[dict | None]:
        entries = [lp for m in msgs for lp in m.prompt_logprobs]
        return [None] + [self.text.prompt_entry(lp) for lp in entries[1:]]

    def whole(self, choices: dict[int, list], top_n: int, n: int) -> dict:
        """The non-streamed body from every choice's messages (index -> messages in order;
        choice ``index`` is sample ``index % n`` of prompt ``index // n``)."""
        out = []
        for index in sorted(choices):
            msgs = choices[index]
            text = "".join(m.text for m in msgs)
            body = {"index": index, "logprobs": self._logprobs(msgs, top_n), "finish_reason": finish_reason(msgs[-1]),
                    "stop_reason": stop_reason(msgs[-1])}
            if self.kind == "chat":
                body["message"], body["finish_reason"] = self._message(text, body["finish_reason"])
            else:
                body["text"] = text
                if self.echo is not None:
                    self._echo_whole(body, index, msgs, top_n)
                body["prompt_logprobs"] = self._prompt_logprobs(msgs) if self.prompt_logprobs else None
            out.append(body)
        doc = self._envelope(self.object, out)
        if self.kind == "chat":
            doc["prompt_logprobs"] = self._prompt_logprobs(choices[min(choices)]) if self.prompt_logprobs else None
        doc["usage"] = usage(*totals({i: msgs[-1].usage for i, msgs in choices.items()}, n))
        return doc

    def _echo_whole(self, body: dict, index: int, msgs, top_n: int) -> None:
        """Put the prompt of choice ``index`` before its text and logprobs (only it with ``echo.only``)."""
        prompt = self.echo.prompts[index]
        body["text"] = prompt + ("" if self.echo.only else body["text"])
        if not self.logprobs:
            return
        entries = [lp for m in msgs for lp in m.prompt_logprobs]
        part = self.text.completion(entries, 0, top_n)
        if entries:  # nothing precedes the first prompt token
            part["token_logprobs"][0] = part["top_logprobs"][0] = None
        if not self.echo.only:
            offset = sum(len(self.tokenizer.decode([e.token_id])) for e in entries)
            for key, values in self.text.completion([lp for m in msgs for lp in m.logprobs], offset, top_n).items():
                part[key] += values
        body["logprobs"] = part

    def _message(self, text: str, finish: str | None) -> tuple[dict, str | None]:
        """A whole chat answer's ``message`` and ``finish_reason``: with a reading
        (:mod:`router.answer`), its ``reasoning_content`` (with a reasoning parser), its calls as
        ``tool_calls`` and the rest as content (``None`` when nothing but them is left)."""
        if self.reading is None:
            return {"role": self.role, "content": text}, finish
        reader = AnswerReader(self.reading)
        got = reader.feed(text) + reader.finish()
        message = {"role": self.role, "content": got.content or None if got.calls or got.reasoning else got.content}
        if self.reading.reasoning is not None:
            message["reasoning_content"] = got.reasoning or None
        if got.calls:
            message["tool_calls"] = whole_calls(got.calls)
        return message, reader.finish_reason(finish)

    def _delta(self, index: int, msg, finish: str | None) -> tuple[dict, str | None]:
        """A chat stream chunk's ``delta`` and ``finish_reason`` for ``msg`` of choice ``index`` (with a
        reading, the reasoning, content and call pieces its reader completes)."""
        if self.reading is None:
            return ({"content": msg.text} if msg.text else {}), finish
        reader = self._readers.setdefault(index, AnswerReader(self.reading))
        got = reader.feed(msg.text)
        if finish is not None:
            got += reader.finish()
        delta: dict = {"reasoning_content": got.reasoning} if got.reasoning else {}
        if got.content:
            delta["content"] = got.content
        if got.calls:
            delta["tool_calls"] = [c.openai() for c in got.calls]
        return delta, reader.finish_reason(finish)

    def chunk(self, index: int, msg, top_n: int, offset: int) -> dict | None:
        """One stream chunk for ``msg`` of choice ``index`` (``None``: nothing to send yet)."""
        finish = finish_reason(msg)
        if self.kind == "chat":
            delta, finish = self._delta(index, msg, finish)
            if not delta and finish is None and not len(msg.logprobs):
                return None  # text a tool parser holds back: nothing to send yet
            choice = {"index": index, "delta": delta}
        else:
            echo = self.echo.prompts[index] if self.echo is not None and index not in self._echoed else ""
            self._echoed.add(index)
            choice = {"index": index, "text": echo + msg.text}
        choice["logprobs"] = self._logprobs([msg], top_n, offset)
        choice["finish_reason"] = finish
        choice["stop_reason"] = stop_reason(msg)
        return self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [choice])

    def role_chunk(self, index: int) -> dict:
        """The first chunk of chat choice ``index``: the role and empty content, before any token
        (as OpenAI and vLLM stream a chat answer)."""
        choice = {"index": index, "delta": {"role": self.role, "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, prompt: int, completion: int, cached: int) -> dict:
        """The final chunk of ``stream_options.include_usage``: no choices, the request's usage."""
        doc = self._envelope("chat.completion.chunk" if self.kind == "chat" else "text_completion", [])
        doc["usage"] = usage(prompt, completion, cached)
        return doc


def builder_for(kind: str, request_id: str, model: str, tokenizer, body, subs) -> ResponseBuilder:
    """The :class:`ResponseBuilder` of an HTTP request's ``body`` and its sub-requests ``subs``."""
    first = subs[0]
    return ResponseBuilder(kind, request_id, model, tokenizer,
                           logprobs=bool(first.top_logprobs or first.request.sampling.logprobs),
                           token_ids=body.return_tokens_as_token_ids, role=answer_role(body),
                           prompt_logprobs=(body.model_extra or {}).get("prompt_logprobs") is not None,
                           echo=echo_of(body, subs, tokenizer), reading=first.reading)


def whole_calls(pieces: list[CallDelta]) -> list[dict]:
    """A message's ``tool_calls`` from the call pieces of its answer (joined per call)."""
    calls: dict[int, dict] = {}
    for piece in pieces:
        call = calls.setdefault(piece.index, {"id": piece.id, "type": "function",
                                              "function": {"name": piece.name, "arguments": ""}})
        call["function"]["arguments"] += piece.arguments
    return [calls[i] for i in sorted(calls)]
