"""Dataclass records read back from JSON someone else wrote (Redis), with their fields' types checked:
a record with a wrong-typed field is refused where it is read, not found later by a sort or a sum."""

from __future__ import annotations

import json
from dataclasses import fields


def typed_fields(cls: type, text: str) -> dict[str, object]:
    """The fields of dataclass ``cls`` found in the JSON object ``text``, each checked against
    its declared type (``int``: not a bool; ``float``: an int too).

    Raises:
        ValueError: ``text`` is not a JSON object.
        TypeError: a value not of its field's declared type.
    """
    d = json.loads(text)
    if not isinstance(d, dict):
        raise ValueError(f"{cls.__name__} must be a JSON object, got {text!r}")
    out = {}
    for f in fields(cls):
        if f.name not in d:
            continue
        v = d[f.name]
        want = {"int": (int,), "float": (int, float), "str": (str,), "bool": (bool,)}[str(f.type)]
        if not isinstance(v, want) or (isinstance(v, bool) and bool not in want):
            raise TypeError(f"{cls.__name__}.{f.name} must be {f.type}, got {v!r}")
        out[f.name] = v
    return out
