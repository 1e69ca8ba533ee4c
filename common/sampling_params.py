"""The one declaration of every sampling / generation parameter of a request.

Each :class:`SamplingParam` in :data:`SAMPLING_PARAMS` describes one field of ``pdcluster.v1.SamplingParams``
(``proto/pdcluster/v1/common.proto``): its Python type, what an unset field resolves to, its valid range, its
help text, its shape (scalar, repeated, token-id map), whether the proto field is ``optional`` (has presence,
so an explicit ``0`` differs from unset) and which engine type consumes it. Everything else derives from it:

* the router's checks and resolved defaults (:mod:`router.validation`);
* the Python client's keyword arguments (:func:`pdcluster.client_types.build_request`);
* the ``pdcluster generate`` flags (:mod:`pdcluster.cli`);
* the proto -> engine conversion (:mod:`serving.convert`) and the range checks of
  :class:`engine.sampling.SamplingOptions`.

Adding a parameter touches this declaration, the proto and the sampler only
(``docs/adding_a_sampling_parameter.md``). Messages are read and written duck-typed
(``getattr`` / ``HasField``), so this module imports no wire stubs and no torch.
Derived code looks the declaration up through :func:`sampling_params` at call
time, never through a copy taken at import.
"""

from __future__ import annotations

import enum
import math
import numbers
import operator
import reprlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from common.param_range import Range, format_number

DEFAULT_MAX_TOKENS = 16
MAX_LOGPROBS = 20
MAX_ABS_PENALTY = 2.0       # presence / frequency penalty range (OpenAI)
MAX_ABS_LOGIT_BIAS = 100.0  # logit_bias value range (OpenAI)
MAX_STOP_STRINGS = 16       # stop strings per request
MAX_STOP_CHARS = 256        # characters per stop string
MAX_LOGIT_BIAS = 1024       # logit_bias entries per request
MAX_STOP_TOKEN_IDS, MAX_ALLOWED_TOKEN_IDS = 1024, 16384  # stop_token_ids / allowed_token_ids per request
MAX_BAD_WORDS = 128         # bad_words per request (characters each: MAX_STOP_CHARS)
UINT64_MAX = (1 << 64) - 1


class Shape(enum.Enum):
    """How a parameter's value is laid out in the proto."""

    SCALAR = "scalar"
    REPEATED = "repeated"  # a sequence of values (a single ``str`` counts as one)
    MAP = "map"            # token id -> value; engine form: pairs sorted by token id


class Target(enum.Enum):
    """Which engine type receives a parameter on the workers."""

    SAMPLER = "sampler"  # a field of engine.sampling.SamplingOptions
    REQUEST = "request"  # a field of engine.request.RequestParams (limits, stop ids)
    ROUTER = "router"    # read by the router only, never sent to the workers


@dataclass(frozen=True)
class SamplingParam:
    """One parameter: the proto field ``name`` of ``pdcluster.v1.SamplingParams``.

    Attributes:
        name: field name in the proto, the client keyword, ``SamplingOptions`` /
            ``RequestParams`` (the CLI flag is ``--name-with-dashes`` unless ``flag``).
        type: Python type of a value (of an element for ``REPEATED``, of a value for ``MAP``).
        default: what an unset field resolves to; ``None`` leaves it unset (``seed``).
        help: one line for the CLI and the docs (range and default are appended).
        range: valid values (elements, map values); ``None``: any.
        shape: scalar, repeated or token-id map.
        presence: the proto field is ``optional`` (``HasField`` tells unset from ``0``).
        target: the engine type that receives it.
        token_ids: elements (``REPEATED``) / keys (``MAP``) are token ids: ``>= 0``,
            and ``< vocab_size`` (checked by the router, which knows the vocabulary).
        nonempty: ``str`` elements must be non-empty.
        nonblank: ``str`` elements must hold a character other than whitespace.
        context_limited: counts against ``max_model_len``: prompt + value must fit;
            unset resolves to ``min(default, max_model_len - prompt tokens)``.
        cli: has a ``pdcluster generate`` flag; ``flag`` overrides its name.
        max_items: ``REPEATED`` / ``MAP``: at most this many entries (``None``: any number).
        max_len: ``str`` elements: at most this many characters each (``None``: any length).

    Raises:
        ValueError: the entry is inconsistent (e.g. a map with a CLI flag, a scalar with
            ``max_items``, ``max_len`` on non-string elements).
    """

    name: str
    type: type
    default: Any
    help: str
    range: Range | None = None
    shape: Shape = Shape.SCALAR
    presence: bool = False
    target: Target = Target.SAMPLER
    token_ids: bool = False
    nonempty: bool = False
    nonblank: bool = False
    context_limited: bool = False
    cli: bool = True
    flag: str = ""
    max_items: int | None = None
    max_len: int | None = None

    def __post_init__(self) -> None:
        if self.shape is not Shape.SCALAR and (self.presence or self.context_limited):
            raise ValueError(f"{self.name}: only a scalar can be optional or context-limited")
        if self.shape is Shape.SCALAR and not self.presence and self.default:
            raise ValueError(f"{self.name}: unset reads as 0 unless the field is optional (presence)")
        if self.context_limited and not self.presence:
            raise ValueError(f"{self.name}: a context-limited parameter must be optional (unset is clamped)")
        if self.shape is Shape.MAP and (self.cli or not self.token_ids):
            raise ValueError(f"{self.name}: a map is keyed by token id and has no CLI flag")
        if self.max_items is not None and (self.shape is Shape.SCALAR or self.max_items < 1):
            raise ValueError(f"{self.name}: max_items is a positive limit of a repeated field or a map")
        if self.max_len is not None and (self.shape is not Shape.REPEATED or self.type is not str or self.max_len < 1):
            raise ValueError(f"{self.name}: max_len is a positive limit of repeated strings")
        if self.nonblank and (self.shape is not Shape.REPEATED or self.type is not str or not self.nonempty):
            raise ValueError(f"{self.name}: nonblank applies to non-empty repeated strings")

    @property
    def cli_flag(self) -> str:
        return self.flag or "--" + self.name.replace("_", "-")

    @property
    def requirement(self) -> str:
        """The valid range in words (``"in [-2, 2]"``), ``""`` when any value is."""
        parts = [self.range.describe(self.type is float)] if self.range else []
        if self.nonblank:
            parts.append("not only whitespace")
        elif self.nonempty:
            parts.append("non-empty")
        if self.token_ids:
            parts.append("token id < vocab size")
        if self.max_items is not None:
            parts.append(f"at most {self.max_items} entries")
        if self.max_len is not None:
            parts.append(f"each at most {self.max_len} characters")
        return ", ".join(parts)

    def describe(self) -> str:
        """``help`` with the range, the unset value and repeatability, for the CLI and docs."""
        notes = [self.requirement] if self.requirement else []
        if self.shape is Shape.SCALAR and self.default is not None and self.type is not bool:
            unset = f"unset: {format_number(self.default)}"
            limited = ", clamped to what max_model_len leaves; a chat's: all it leaves"
            notes.append(unset + limited if self.context_limited else unset)
        if self.shape is Shape.REPEATED:
            notes.append("repeatable")
        return f"{self.help} ({'; '.join(notes)})" if notes else self.help

    # ---- reading and writing a SamplingParams message (duck-typed) ----

    def is_set(self, msg: Any) -> bool:
        """Whether ``msg`` carries a value (presence fields: ``HasField``; others: non-zero / non-empty)."""
        return msg.HasField(self.name) if self.presence else bool(getattr(msg, self.name))

    def read(self, msg: Any) -> Any:
        """The value in ``msg``; unset resolves to ``default``. Repeated -> tuple,
        map -> ``(token_id, value)`` pairs sorted by token id."""
        if self.shape is Shape.REPEATED:
            return tuple(getattr(msg, self.name))
        if self.shape is Shape.MAP:
            return tuple(sorted(getattr(msg, self.name).items()))
        if self.presence and not msg.HasField(self.name):
            return self.default
        return getattr(msg, self.name)

    def write(self, msg: Any, value: Any) -> None:
        """Set the field of ``msg`` to ``value``; ``None`` leaves it unset. A single
        ``str`` is one element of a repeated field; a map takes a mapping or pairs.

        Raises:
            TypeError, ValueError: from protobuf, the value does not fit the field
                (e.g. a negative uint, a non-integer token id).
        """
        if value is None:
            return
        if self.shape is Shape.REPEATED:
            getattr(msg, self.name).extend([value] if isinstance(value, str) else value)
        elif self.shape is Shape.MAP:
            field = getattr(msg, self.name)
            for key, v in _pairs(value):
                field[operator.index(key)] = v
        else:
            setattr(msg, self.name, value)

    # ---- checks ----

    def problem(self, value: Any) -> str | None:
        """What is wrong with an engine-form ``value`` (see :meth:`read`), or ``None``.

        The message starts with the field name (``"top_p must be in (0, 1], got 0.0"``,
        ``"stop has 17 entries; at most 16"``); token ids are checked only for ``>= 0``
        here (see :meth:`vocab_problem`).
        """
        if self.shape is Shape.SCALAR:
            if value is None:
                return None if self.default is None else f"{self.name} must be set"
            return self._value_problem(self.name, value)
        if self.max_items is not None and len(value) > self.max_items:
            return f"{self.name} has {len(value)} entries; at most {self.max_items}"
        if self.shape is Shape.REPEATED:
            for i, v in enumerate(value):
                if self.nonempty and not v:
                    return f"{self.name}[{i}] must be non-empty"
                if self.nonblank and not v.strip():
                    return f"{self.name}[{i}] is only whitespace"
                if self.max_len is not None and len(v) > self.max_len:
                    return f"{self.name}[{i}] has {len(v)} characters; at most {self.max_len}"
                if self.token_ids and v < 0:
                    return f"{self.name}: token id {v} must be >= 0"
                if (p := self._value_problem(f"{self.name}[{i}]", v)) is not None:
                    return p
            return None
        for key, v in sorted(_pairs(value)):
            if key < 0:
                return f"{self.name}: token id {key} must be >= 0"
            if (p := self._value_problem(f"{self.name}[{key}]", v)) is not None:
                return p
        return None

    def vocab_problem(self, value: Any, vocab_size: int) -> str | None:
        """For token-id parameters: the first id ``>= vocab_size``, in words, or ``None``."""
        if not self.token_ids:
            return None
        ids = [key for key, _ in _pairs(value)] if self.shape is Shape.MAP else list(value)
        bad = [t for t in sorted(ids) if t >= vocab_size]
        return f"{self.name}: token id {bad[0]} >= vocab_size {vocab_size}" if bad else None

    def type_problem(self, value: Any) -> str | None:
        """What is wrong with the type of a value given for this parameter (as JSON or a caller
        gives it: a list for ``REPEATED``, a mapping or pairs for ``MAP``), or ``None``. Strict, as
        the OpenAI schema: a bool is no integer (nor ``1`` a bool); an integer is a float."""
        noun = _TYPE_NAMES[self.type]
        if self.shape is Shape.SCALAR:
            ok, what = _fits(self.type, value), ("an " if noun[0] in "aeiou" else "a ") + noun
        elif self.shape is Shape.REPEATED:
            items = [value] if isinstance(value, str) and self.type is str else value
            ok, what = isinstance(items, (list, tuple)) and all(_fits(self.type, v) for v in items), f"a list of {noun}s"
        else:
            pairs = list(value.items()) if isinstance(value, Mapping) else value
            ok, what = isinstance(pairs, (list, tuple)) and all(
                isinstance(kv, tuple) and len(kv) == 2 and _fits(self.type, kv[1]) for kv in pairs), \
                f"a map of token ids to {noun}s"
        return None if ok else f"{self.name} must be {what}, got {reprlib.repr(value)}"

    def _value_problem(self, label: str, value: Any) -> str | None:
        if self.range is None or self.range.contains(value):
            return None
        return f"{label} must be {self.range.describe(self.type is float)}, got {value}"


_TYPE_NAMES = {bool: "boolean", int: "integer", float: "number", str: "string"}
_WIRE_RANGE = {1: (-(1 << 31), (1 << 31) - 1), 2: (-(1 << 63), (1 << 63) - 1), 3: (0, (1 << 32) - 1),
               4: (0, UINT64_MAX)}  # protobuf's cpp_type of an integer field -> the values it holds


def _beyond(value: int, low: int, high: int) -> str | None:
    """The wire limit ``value`` breaks (``">= low"`` or ``"<= high"``), or None within ``[low, high]``."""
    return None if low <= value <= high else (f">= {low}" if value < low else f"<= {high}")


def _fits(kind: type, value: Any) -> bool:
    if kind is bool or isinstance(value, bool):  # a bool is no number, nor a number a bool
        return kind is bool and isinstance(value, bool)
    return isinstance(value, {int: numbers.Integral, float: numbers.Real}.get(kind, kind))  # numpy's numbers too


def _pairs(value: Mapping | Iterable) -> Iterable[tuple[Any, Any]]:
    return value.items() if isinstance(value, Mapping) else value


_PENALTY = Range(-MAX_ABS_PENALTY, MAX_ABS_PENALTY)

#: Every sampling / generation parameter, in proto field order.
SAMPLING_PARAMS: tuple[SamplingParam, ...] = (
    SamplingParam("max_tokens", int, DEFAULT_MAX_TOKENS, "new tokens to generate", Range(1),
                  presence=True, target=Target.REQUEST, context_limited=True),
    SamplingParam("temperature", float, 1.0, "softmax temperature, 0 = greedy", Range(0.0), presence=True),
    SamplingParam("top_p", float, 1.0, "nucleus mass, 1 disables", Range(0.0, 1.0, low_open=True), presence=True),
    SamplingParam("top_k", int, 0, "keep the k most likely tokens, 0 or -1 (vLLM's) disables", Range(-1)),
    SamplingParam("seed", int, None, "per-request RNG seed: same seed and parameters give the same tokens",
                  Range(0, UINT64_MAX), presence=True),
    SamplingParam("stop", str, (), "stop string: generation ends at it, the text excludes it",
                  shape=Shape.REPEATED, target=Target.ROUTER, nonempty=True, max_items=MAX_STOP_STRINGS,
                  max_len=MAX_STOP_CHARS),
    SamplingParam("stop_token_ids", int, (), "token id that ends generation (in token_ids, its text not in the text)",
                  shape=Shape.REPEATED, target=Target.REQUEST, token_ids=True, flag="--stop-token-id",
                  max_items=MAX_STOP_TOKEN_IDS),
    SamplingParam("ignore_eos", bool, False, "keep generating past EOS until max_tokens", target=Target.REQUEST),
    SamplingParam("logprobs", int, 0, "top logprobs returned per generated token (raw model distribution)",
                  Range(0, MAX_LOGPROBS), cli=False),
    SamplingParam("min_p", float, 0.0, "keep tokens with probability >= min_p x the top token's, 0 disables",
                  Range(0.0, 1.0)),
    SamplingParam("repetition_penalty", float, 1.0,
                  "HF repetition penalty over prompt and output tokens, 1 disables",
                  Range(0.0, low_open=True), presence=True),
    SamplingParam("presence_penalty", float, 0.0, "OpenAI presence penalty over output tokens, 0 disables",
                  _PENALTY),
    SamplingParam("frequency_penalty", float, 0.0, "OpenAI frequency penalty over output tokens, 0 disables",
                  _PENALTY),
    SamplingParam("logit_bias", float, (), "token id -> bias added to its logit before every other step",
                  Range(-MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS), shape=Shape.MAP, token_ids=True, cli=False,
                  max_items=MAX_LOGIT_BIAS),
    SamplingParam("include_stop_str_in_output", bool, False, "keep the stop string or stop token text that ended "
                  "generation in the text (vLLM's)", target=Target.ROUTER),
    SamplingParam("min_tokens", int, 0, "tokens generated before EOS, a stop token id or a stop string may end "
                  "generation (vLLM's), 0 disables", Range(0)),
    SamplingParam("allowed_token_ids", int, (), "token id that may be sampled: given any, only those are (vLLM's)",
                  shape=Shape.REPEATED, token_ids=True, flag="--allowed-token-id", max_items=MAX_ALLOWED_TOKEN_IDS),
    SamplingParam("truncate_prompt_tokens", int, None, "keep only the prompt's last k tokens (vLLM's); -1: as many "
                  "as leave room for max_tokens", Range(-1), presence=True, target=Target.ROUTER),
    SamplingParam("skip_special_tokens", bool, True, "leave special tokens (EOS, chat markers) out of the text "
                  "(vLLM's)", presence=True, target=Target.ROUTER),
    SamplingParam("prompt_logprobs", int, None, "top logprobs returned per prompt token (vLLM's); 0: the prompt "
                  "token's own only", Range(0, MAX_LOGPROBS), presence=True, target=Target.REQUEST, cli=False),
    SamplingParam("bad_words", str, (), "word kept out of the output: its tokens as the tokenizer spells it, bare "
                  "and after a space, are banned (vLLM's)", shape=Shape.REPEATED,
                  target=Target.ROUTER, nonempty=True, nonblank=True, flag="--bad-word", max_items=MAX_BAD_WORDS,
                  max_len=MAX_STOP_CHARS),
)


def sampling_params(target: Target | None = None) -> tuple[SamplingParam, ...]:
    """The declared parameters (of one ``target``, or all), in declaration order."""
    return tuple(p for p in SAMPLING_PARAMS if target is None or p.target is target)


def sampling_param(name: str) -> SamplingParam:
    """The parameter called ``name``.

    Raises:
        KeyError: no such parameter.
    """
    for p in SAMPLING_PARAMS:
        if p.name == name:
            return p
    raise KeyError(f"no sampling parameter {name!r}")


def read_sampling(msg: Any, target: Target) -> dict[str, Any]:
    """``{name: value}`` of ``target``'s parameters in ``msg`` (unset -> default; see
    :meth:`SamplingParam.read`): the keyword arguments of that engine type."""
    return {p.name: p.read(msg) for p in sampling_params(target)}


def write_sampling(msg: Any, values: Mapping[str, Any]) -> None:
    """Set ``msg``'s fields from ``{name: value}``; ``None`` values stay unset.

    Raises:
        TypeError: a name is not a declared parameter, or a value has the wrong type
            (:meth:`SamplingParam.type_problem`; the message starts with the parameter's name).
        ValueError: a value its protobuf field cannot hold (an integer beyond the field's width,
            e.g. a negative seed; a float beyond float32; the message starts with the parameter's
            name; the declared range when the value is outside it too: the router checks those).
    """
    params = {p.name: p for p in SAMPLING_PARAMS}
    unknown = sorted(set(values) - set(params))
    if unknown:
        raise TypeError(f"unknown sampling parameter(s): {', '.join(unknown)}")
    for name, value in values.items():
        p = params[name]
        if value is None:
            continue
        if (problem := p.type_problem(value)) is not None:
            raise TypeError(problem)
        field = getattr(getattr(msg, "DESCRIPTOR", None), "fields_by_name", {}).get(name)
        wire = _WIRE_RANGE.get(field.cpp_type) if field is not None else None
        if wire and isinstance(value, int) and (limit := _beyond(value, *wire)):  # the declared range if tighter
            raise ValueError(p.problem(value) or f"{name} must be {limit}, got {value}")
        if wire and isinstance(value, (list, tuple)):  # a repeated integer field: each element named
            for i, v in enumerate(value):
                if isinstance(v, int) and (limit := _beyond(v, *wire)):
                    raise ValueError(f"{name}[{i}] must be {limit}, got {v}")
        try:
            p.write(msg, value)
            if isinstance(value, float) and math.isfinite(value) and math.isinf(getattr(msg, name)):
                raise ValueError("outside the range of a float32")  # protobuf stored it as inf
            if (isinstance(value, float) and value != 0.0 and getattr(msg, name) == 0.0
                    and p.problem(0.0) is not None):  # e.g. top_p=1e-300, where 0 is out of range
                raise ValueError("too small for a float32 (it would be stored as 0)")
        except (TypeError, ValueError) as exc:  # protobuf's own message does not say which field
            # not type(exc): a subclass such as UnicodeEncodeError (a lone surrogate) takes other arguments
            kind = TypeError if isinstance(exc, TypeError) else ValueError
            raise kind(f"{name}: {reprlib.repr(value)} does not fit the field: {exc}") from None
