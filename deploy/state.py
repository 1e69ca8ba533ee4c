"""The state file ``pdcluster up`` writes (``<state-dir>/cluster.json``); no heavy imports."""

from __future__ import annotations

import json
from pathlib import Path

DEFAULT_STATE_DIR = Path.home() / ".pdcluster"


def state_path(state_dir: Path | str | None = None) -> Path:
    return Path(state_dir or DEFAULT_STATE_DIR).expanduser() / "cluster.json"


def read_state(state_dir: Path | str | None = None) -> dict:
    """The state ``up`` wrote. Raises FileNotFoundError when no cluster is up."""
    return json.loads(state_path(state_dir).read_text())
