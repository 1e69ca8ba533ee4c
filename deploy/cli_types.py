"""argparse types of the ``pdcluster`` deploy commands' flags (:mod:`deploy.cli`): each parses one
flag's value or raises ``argparse.ArgumentTypeError`` with a message naming the limit (argparse
prefixes the flag)."""

from __future__ import annotations

import argparse
from pathlib import Path

from router.migration import check_max_migrations
from router.openai.cors import check_origins


def port(value: str) -> int:
    """argparse type: a TCP port number, 0 (any free port) to 65535."""
    port = parse_number(value, int)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in [0, 65535], got {port}")
    return port


def parse_number(value: str, kind: type) -> int | float:
    """``kind(value)`` (int or float), or the argparse error a flag's message shows (``argparse`` would
    otherwise name the type function: "invalid positive value")."""
    try:
        return kind(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {'an integer' if kind is int else 'a number'}, got {value!r}") \
            from None


def positive(value: str) -> int:
    """argparse type: an integer >= 1."""
    n = parse_number(value, int)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {n}")
    return n


def origins(value: str) -> tuple[str, ...]:
    """argparse type: comma-separated CORS origins (:func:`router.openai.cors.check_origins`)."""
    origins = tuple(o.strip() for o in value.split(",") if o.strip())
    try:
        check_origins(origins)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return origins


def max_migrations(value: str) -> int:
    """argparse type: ``--max-migrations``, checked by :func:`router.migration.check_max_migrations`."""
    n = parse_number(value, int)
    try:
        check_max_migrations(n)
    except ValueError as e:  # argparse names the flag: drop the config field's name from the message
        raise argparse.ArgumentTypeError(str(e).removeprefix("max_migrations ")) from None
    return n


def non_negative(value: str) -> int:
    """argparse type: an integer >= 0."""
    n = parse_number(value, int)
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def num_kv_blocks(value: str) -> int:
    """argparse type: ``--num-kv-blocks``, 0 (derive from ``--kv-cache-gb``) or >= 2 (block 0 is reserved)."""
    n = parse_number(value, int)
    if n != 0 and n < 2:
        raise argparse.ArgumentTypeError(f"must be 0 (derive from --kv-cache-gb) or >= 2, got {n}")
    return n


def positive_float(value: str) -> float:
    """argparse type: a number > 0."""
    x = parse_number(value, float)
    if not x > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return x


def key_value(value: str) -> tuple[str, str]:
    """argparse type: ``KEY=VALUE`` (a non-empty key; the value may be empty or hold ``=``)."""
    key, sep, val = value.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {value!r}")
    return key, val


def state_dir(value: str) -> Path:
    path = Path(value).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{value} is a file, not a directory (the state file lies inside it)")
    return path
