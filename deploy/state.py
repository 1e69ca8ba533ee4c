"""The state file ``pdcluster up`` writes (``<state-dir>/cluster.json``); no heavy imports.

It holds the cluster's secrets (the cluster secret every internal call carries, a Redis
password), so it is written readable by its owner only (mode 0600).
"""

from __future__ import annotations

import json
import os
import shlex
from pathlib import Path

from deploy.ray_env import STATE_TOKEN_KEY

DEFAULT_STATE_DIR = Path.home() / ".pdcluster"


def state_path(state_dir: Path | str | None = None) -> Path:
    return Path(state_dir or DEFAULT_STATE_DIR).expanduser() / "cluster.json"


class AlreadyUpError(RuntimeError):
    """``up`` was asked to start a cluster from a state directory that another one is up from."""


def no_cluster_text(state_dir: Path | str | None) -> str:
    """The line saying no cluster is up from ``state_dir`` (``None``: the default one)."""
    return f"no pdcluster is up from state dir {state_dir or '~/.pdcluster'}"


def check_not_up(state_dir: Path | str | None = None) -> None:
    """Refuse a ``state_dir`` (default ``~/.pdcluster``) a cluster is up from.

    Raises:
        AlreadyUpError: its state file exists; the message names the directory and the
            ``pdcluster down --state-dir DIR`` that stops that cluster (or clears what is left
            of one that died).
    """
    path = state_path(state_dir)
    if path.exists():
        raise AlreadyUpError(f"a cluster is already up from state dir {path.parent} ({path.name} exists there); "
                             f"stop it (or clear what is left of it, if it died) first with "
                             f"`pdcluster down --state-dir {shlex.quote(str(path.parent))}`")


def read_state(state_dir: Path | str | None = None) -> dict:
    """The state ``up`` wrote. Raises FileNotFoundError when no cluster is up."""
    return json.loads(state_path(state_dir).read_text())


def write_state(state_dir: Path | str | None, state: dict) -> Path:
    """Write ``state`` as the state file, mode 0600 (also when it existed with another mode);
    returns its path.

    Raises:
        OSError: the file cannot be written.
    """
    path = state_path(state_dir)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)
        f.write(json.dumps(state, indent=2))
    return path


SECRET_KEYS = ("cluster_secret", STATE_TOKEN_KEY, "internal_ca_key")
"""Keys of the cluster state holding secrets (besides the worker template's ``security``): the
cluster secret, the Ray token (:data:`deploy.ray_env.STATE_TOKEN_KEY`), the cluster CA's key."""


def without_secrets(state: dict) -> dict:
    """A copy of the cluster ``state`` for where more can read it than the state file's owner (the
    controller's copy in Redis): no :data:`SECRET_KEYS`, and the worker template's ``security`` (API
    keys, cluster secret, TLS keys) emptied. :func:`with_secrets` puts them back."""
    out = {k: v for k, v in state.items() if k not in SECRET_KEYS}
    if "worker_template" in out:
        out["worker_template"] = {**out["worker_template"], "security": {}}
    return out


def with_secrets(stored: dict, original: dict) -> dict:
    """``stored`` (from :func:`without_secrets`) with the secrets of ``original`` (the state they
    were removed from, or one of the same cluster) put back."""
    out = {**stored, **{k: original[k] for k in SECRET_KEYS if k in original}}
    if "worker_template" in out and "worker_template" in original:
        out["worker_template"] = {**out["worker_template"],
                                  "security": original["worker_template"].get("security", {})}
    return out
