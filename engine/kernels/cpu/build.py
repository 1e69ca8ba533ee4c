"""Build and load the C++ CPU kernels in ``csrc/`` as torch extensions.

``python -m engine.kernels.cpu.build`` (run by ``scripts/install.sh``, and by ``pdcluster up --local``
through :func:`build_in_parallel`) compiles every ``csrc/<name>.cpp`` (with the shared headers
``csrc/*.h``), as many at a time as the machine has CPUs, once per machine into
``_build/<name>/`` next to this file (never outside the package), with ``-O3 -march=native``
(the kernels use the build machine's vector instructions: build where they run) and OpenMP, so
``at::parallel_for`` splits work over torch's intra-op threads (``torch.set_num_threads``).
:func:`load` imports a built extension; when it is missing or stale it builds it first (torch's
``cpp_extension.load`` rebuilds when the source or the flags changed; a digest of the headers is
one of the flags), and when no compiler is available it logs one warning and returns ``None``:
the caller falls back to its plain-torch path.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

from engine.kernels.cpu.trace import traced

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"
BUILD_ROOT = Path(__file__).parent / "_build"
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=fast")
LDFLAGS = ("-fopenmp",)


def kernel_names() -> list[str]:
    """Every extension in ``csrc/``: one per ``<name>.cpp``."""
    return sorted(p.stem for p in CSRC.glob("*.cpp"))


@functools.cache
def load(name: str) -> ModuleType | None:
    """The extension built from ``csrc/<name>.cpp`` (built now if missing or stale), or ``None``
    when it cannot be built here (the reason is logged once).

    Raises:
        FileNotFoundError: no ``csrc/<name>.cpp``.
    """
    source = CSRC / f"{name}.cpp"
    if not source.is_file():
        raise FileNotFoundError(f"no CPU kernel source {source}")
    build_dir = BUILD_ROOT / name
    build_dir.mkdir(parents=True, exist_ok=True)
    try:
        from torch.utils import cpp_extension
        _ninja_on_path()
        # torch's own lock (build_dir/lock, a plain file) stays behind when a process is killed while it
        # holds it, and every later load then waits for it forever. Our flock is released by the kernel when
        # its holder dies; holding it, any torch lock file left is stale.
        with open(build_dir / "pdcluster.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            (build_dir / "lock").unlink(missing_ok=True)
            built = _library(name)
            stale = _needs_build(source, built)
            if stale:  # up to minutes on 2 cores: say so, or a worker's start looks hung
                log.warning("building CPU kernel %s if its source changed (once per checkout and machine; "
                            "about a minute)", name)
            mod = cpp_extension.load(name=f"pdcluster_{name}", sources=[str(source)],
                                     build_directory=str(build_dir),
                                     extra_cflags=[*CFLAGS, f"-DPDC_HEADERS={_headers_digest()}"],
                                     extra_ldflags=list(LDFLAGS), verbose=False)
            if stale:  # current now by torch's own check (a touched but unchanged source is not rebuilt)
                os.utime(built)
            return mod
    except Exception as e:  # no compiler, no ninja, a compile error: fall back to torch
        log.warning("CPU kernel %s is not available (%s: %s); using the plain-torch path",
                    name, type(e).__name__, str(e).strip().splitlines()[-1] if str(e).strip() else "")
        return None


@functools.cache
def load_function(name: str, fn: str, trace_name: str | None = None) -> Callable[..., Any] | None:
    """Function ``fn`` of the extension built from ``csrc/<name>.cpp`` (:func:`load`), shown in
    ``torch.profiler`` traces as ``trace_name`` (default ``pdcluster::<fn>``:
    :func:`engine.kernels.cpu.trace.traced`), or None when the extension cannot be built here or has
    no ``fn``.

    Raises:
        FileNotFoundError: no ``csrc/<name>.cpp``.
    """
    ext = load(name)
    if ext is None or not hasattr(ext, fn):
        return None
    return traced(trace_name or f"pdcluster::{fn}", getattr(ext, fn))


def _library(name: str) -> Path:
    """Where torch's ``cpp_extension.load`` puts the built library of ``csrc/<name>.cpp``."""
    return BUILD_ROOT / name / f"pdcluster_{name}.so"


def _needs_build(source: Path, built: Path) -> bool:
    """Whether the library ``built`` is missing or older than its source or a shared header (a
    guess for the log line: torch's own check, of the sources' contents and the flags, decides)."""
    if not built.is_file():
        return True
    newest = max(p.stat().st_mtime for p in (source, *CSRC.glob("*.h")))
    return built.stat().st_mtime < newest


def load_all() -> dict[str, bool]:
    """Build (where missing or stale) and load every kernel now; whether each is available. A
    worker calls this before it serves: built lazily, the first request would wait for the
    compiler (~25 s per kernel on these 2 cores, one after another; ``main`` builds them in parallel)."""
    return {name: load(name) is not None for name in kernel_names()}


def build_in_parallel(jobs: int | None = None) -> None:
    """Build every kernel, ``jobs`` at a time (default: the CPU count), each in its own Python process
    (one compiler each: torch's ``cpp_extension.load`` compiles one source at a time); :func:`load`'s
    per-kernel lock keeps them from building the same one twice. A build that fails here is retried,
    and its reason logged, by the next :func:`load` of it (``main``'s :func:`load_all`, a worker's)."""
    import subprocess
    from concurrent.futures import ThreadPoolExecutor

    code = "import sys; from engine.kernels.cpu.build import load; sys.exit(load(sys.argv[1]) is None)"
    root = Path(__file__).resolve().parents[3]  # the repository root: the package imports from it

    def build(name: str) -> None:
        subprocess.run([sys.executable, "-c", code, name], cwd=root, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL, check=False)

    jobs = jobs or os.cpu_count() or 1
    todo = [n for n in kernel_names() if _needs_build(CSRC / f"{n}.cpp", _library(n))]
    if todo:
        log.warning("building %d CPU kernels, %d at a time (about half a minute each)", len(todo), jobs)
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        list(pool.map(build, todo))


def _headers_digest() -> str:
    """A digest of the shared headers (``csrc/*.h``). torch rebuilds an extension when its source or
    its flags change, not its headers: the digest, passed as a flag, makes a header change count."""
    h = hashlib.sha256()
    for header in sorted(CSRC.glob("*.h")):
        h.update(header.name.encode() + b"\0" + header.read_bytes())
    return h.hexdigest()[:16]


def _ninja_on_path() -> None:
    """torch runs ``ninja`` from PATH: a process started outside the venv (a Ray worker) finds the
    ``ninja`` package's binary this way."""
    if shutil.which("ninja") is None:
        import ninja
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def main() -> int:
    """Build every kernel; exit status 0 even when some cannot be built (they fall back)."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build_in_parallel()
    for name, ok in load_all().items():
        print(f"cpu kernel {name}: {'built' if ok else 'NOT built (plain-torch fallback)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
