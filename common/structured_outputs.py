"""The one declaration of structured outputs: the constraint kinds, their limits, the router's checks.

A request may constrain its output to exactly one of (vLLM's ``structured_outputs``, OpenAI's JSON
``response_format``):

* ``json``: a JSON schema (JSON text): the output is one JSON value that satisfies it;
* ``regex``: a regular expression the whole output matches;
* ``choice``: the output is exactly one of these strings;
* ``grammar``: an EBNF grammar (GBNF syntax as llama.cpp's, root rule ``root``);
* ``json_object``: the output is one JSON object (OpenAI's JSON mode).

``disable_any_whitespace`` (``json``, ``json_object``): JSON without free whitespace: only the fixed
separators ``", "`` and ``": "`` (xgrammar's, as vLLM's), no line breaks or indentation.

The wire form is ``pdcluster.v1.StructuredOutputs`` (``proto/pdcluster/v1/common.proto``). The router
checks shapes and sizes here (:func:`structured_problem`: it loads no torch, so it cannot compile);
the workers compile the constraint with xgrammar (:mod:`engine.structured_output`) and refuse one that
does not compile with INVALID_ARGUMENT naming the field. Messages are read duck-typed (``HasField`` /
``getattr``), so this module imports no wire stubs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

KINDS = ("json", "regex", "choice", "grammar", "json_object")
"""The constraint kinds, in proto field order; exactly one is given."""
MAX_STRUCTURED_BYTES = 64 * 1024
"""UTF-8 bytes of a constraint's text (the schema, regex or grammar; the choices together)."""
MAX_CHOICES = 256
"""Strings of a ``choice`` constraint."""
MAX_SCHEMA_DEPTH = 64
"""Nesting of a JSON schema's arrays and objects (the compiler walks it recursively)."""
JSON_OBJECT_SCHEMA = '{"type": "object", "additionalProperties": true}'
"""The schema ``json_object`` compiles to: any JSON object."""


@dataclass(frozen=True)
class StructuredOutput:
    """A checked constraint, the engine's form (:func:`read_structured`).

    Attributes:
        kind: one of :data:`KINDS`.
        text: the schema (``json``; :data:`JSON_OBJECT_SCHEMA` for ``json_object``), the regex, or
            the grammar (``grammar``; the grammar :func:`choice_grammar` builds for ``choice``).
        any_whitespace: JSON may hold any whitespace between tokens (``json``, ``json_object``); false:
            the fixed separators only.
    """

    kind: str
    text: str
    any_whitespace: bool = True


def choice_grammar(choices: tuple[str, ...] | list[str]) -> str:
    """An EBNF grammar whose language is exactly ``choices``: ``root ::= "a" | "b"``; each string is
    written as a JSON string literal (xgrammar's EBNF reads the same escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def read_structured(msg: Any) -> StructuredOutput | None:
    """The constraint in ``msg`` (a ``StructuredOutputs``; ``None`` or an empty one: none). Assumes
    :func:`structured_problem` found nothing wrong with it."""
    if msg is None:
        return None
    kind = next((k for k in KINDS if _is_given(msg, k)), None)
    if kind is None:
        return None
    any_ws = not msg.disable_any_whitespace
    if kind == "json_object":
        return StructuredOutput(kind, JSON_OBJECT_SCHEMA, any_ws)
    if kind == "choice":
        return StructuredOutput(kind, choice_grammar(list(msg.choice)))
    return StructuredOutput(kind, getattr(msg, kind), any_ws)


def _is_given(msg: Any, kind: str) -> bool:
    value = getattr(msg, kind)
    return len(value) > 0 if kind == "choice" else bool(value)


def structured_problem(msg: Any, field: str = "structured_outputs") -> str | None:
    """What is wrong with the ``StructuredOutputs`` ``msg``, naming ``field.<name>`` and the limit, or
    None: not exactly one kind given, a text over :data:`MAX_STRUCTURED_BYTES`, more than
    :data:`MAX_CHOICES` choices, a ``json`` that is not JSON or nests deeper than
    :data:`MAX_SCHEMA_DEPTH`, ``disable_any_whitespace`` on a kind that is not JSON."""
    given = [k for k in KINDS if _is_given(msg, k)]
    if len(given) != 1:
        what = "none (an empty string or list, or json_object false, asks for nothing)" if not given \
            else ", ".join(given)
        return f"{field} must give exactly one of {', '.join(KINDS)} (a non-empty value), got {what}"
    kind = given[0]
    if msg.disable_any_whitespace and kind not in ("json", "json_object"):
        return f"{field}.disable_any_whitespace applies to json and json_object only, not {kind}"
    if kind == "choice" and len(msg.choice) > MAX_CHOICES:
        return f"{field}.choice has {len(msg.choice)} strings; at most {MAX_CHOICES}"
    size = sum(len(c.encode()) for c in msg.choice) if kind == "choice" else len(str(getattr(msg, kind)).encode())
    if size > MAX_STRUCTURED_BYTES:
        return f"{field}.{kind} is {size} bytes (UTF-8); at most {MAX_STRUCTURED_BYTES}"
    if kind == "json":
        return _schema_problem(msg.json, f"{field}.json")
    return None


def _schema_problem(text: str, field: str) -> str | None:
    try:
        schema = json.loads(text)
    except RecursionError:
        return f"{field} nests deeper than {MAX_SCHEMA_DEPTH} levels"
    except ValueError as e:
        return f"{field} is not JSON: {e}"
    if not isinstance(schema, (dict, bool)):
        return f"{field} must be a JSON schema (an object or a boolean), got {type(schema).__name__}"
    if schema_depth(schema) > MAX_SCHEMA_DEPTH:
        return f"{field} nests deeper than {MAX_SCHEMA_DEPTH} levels"
    return None


def schema_depth(value: Any) -> int:
    """Levels of nested objects and arrays in ``value`` (a scalar: 0), counted up to
    :data:`MAX_SCHEMA_DEPTH` + 1."""
    depth, level = 0, [value] if isinstance(value, (dict, list)) else []
    while level and depth <= MAX_SCHEMA_DEPTH:
        depth += 1
        level = [v for x in level for v in (x.values() if isinstance(x, dict) else x) if isinstance(v, (dict, list))]
    return depth


_ALREADY_SO = ("disable_fallback", "disable_additional_properties")
"""vLLM options that hold with one backend and its defaults, taken and ignored: there is no other backend
to fall back to, and a schema's object admits no property it does not declare unless it says so
(xgrammar's strict mode, vLLM's default with xgrammar)."""


def write_structured(msg: Any, spec: Mapping[str, Any], field: str = "structured_outputs") -> None:
    """Fill the ``StructuredOutputs`` ``msg`` from vLLM's dict form: ``{"json": schema}`` (a dict or
    JSON text), ``{"regex": str}``, ``{"choice": [str, ...]}``, ``{"grammar": str}``,
    ``{"json_object": true}``, with ``"disable_any_whitespace": bool``; ``None`` values are absent;
    the booleans of :data:`_ALREADY_SO` are accepted and change nothing.

    Raises:
        TypeError: a key that is not a field (vLLM's other options are not served), a value of
            the wrong type (the message names ``field.<key>``), or a string that is not valid Unicode.
    """
    if not isinstance(spec, Mapping):
        raise TypeError(f"{field} must be an object, got {type(spec).__name__}")
    msg.SetInParent()  # given, even empty: the router then refuses it as asking for nothing
    try:
        _write(msg, spec, field)
    except UnicodeEncodeError as e:  # a lone surrogate, which JSON escapes allow and protobuf refuses
        raise TypeError(f"{field} is not valid Unicode: {e.reason}") from None


def _write(msg: Any, spec: Mapping[str, Any], field: str) -> None:
    for key, value in spec.items():
        if value is None:
            continue
        name = f"{field}.{key}"
        if key == "json":
            if not isinstance(value, (str, dict, bool)):
                raise TypeError(f"{name} must be a JSON schema (an object, or its JSON text)")
            msg.json = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
        elif key in ("regex", "grammar"):
            _check(isinstance(value, str), name, "a string")
            setattr(msg, key, value)
        elif key == "choice":
            _check(isinstance(value, list) and all(isinstance(c, str) for c in value), name, "a list of strings")
            msg.choice[:] = value
        elif key in ("json_object", "disable_any_whitespace"):
            _check(isinstance(value, bool), name, "a boolean")
            setattr(msg, key, value)
        elif key in _ALREADY_SO:
            _check(isinstance(value, bool), name, "a boolean")
        else:
            raise TypeError(f"{name} is not served (structured outputs take {', '.join(KINDS)} and "
                            "disable_any_whitespace)")


def _check(ok: bool, name: str, what: str) -> None:
    if not ok:
        raise TypeError(f"{name} must be {what}")
