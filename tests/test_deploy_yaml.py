"""The Ray cluster-launcher configurations in ``deploy/clusters/`` are valid for the installed
Ray: each passes Ray's own cluster-config JSON schema as written, and again after Ray's
launcher filled in its provider defaults; each installs pdcluster and its model on every
node, starts Ray with the pinning resources, and the ``pdcluster`` commands its header
documents parse with the real CLI."""

from __future__ import annotations

import copy
import json
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray.autoscaler
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from pdcluster.cli import build_parser

CLUSTERS = Path(__file__).resolve().parents[1] / "deploy" / "clusters"
CONFIGS = sorted(CLUSTERS.glob("*.yaml"))
SCHEMA = json.loads((Path(ray.autoscaler.__file__).parent / "ray-schema.json").read_text())


def _load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def _documented_commands(path: Path) -> list[list[str]]:
    """argv of every ``ray exec CONFIG '<pdcluster ...>'`` in the file's header comment."""
    header = "\n".join(line[1:].strip() if line.startswith("#") else "" for line in path.read_text().splitlines())
    header = re.sub(r"\\\n\s*", " ", header)  # shell line continuations
    return [shlex.split(cmd) for cmd in re.findall(r"ray exec \S+\s+'(pdcluster [^']*)'", header)]


def test_there_is_an_on_prem_and_a_cloud_config():
    providers = {_load(p)["provider"]["type"] for p in CONFIGS}
    assert "local" in providers and providers & {"aws", "gcp"}, providers


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_valid_against_rays_schema(path):
    config = _load(path)
    jsonschema.validate(config, SCHEMA)  # as written
    prepared = prepare_config(copy.deepcopy(config))  # what `ray up` feeds the launcher
    validate_config(prepared)
    assert prepared["head_node_type"] in prepared["available_node_types"]


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_installs_and_starts_what_pdcluster_needs(path):
    config = _load(path)
    setup = "\n".join(config["setup_commands"])
    assert "pip install" in setup or "scripts/install.sh" in setup, "pdcluster is not installed on the nodes"
    assert "resolve_model(" in setup, "the model is not prepared on every node"
    assert "~/pdcluster" in config["file_mounts"], "the checkout is not copied to the nodes"
    head = " ".join(config["head_start_ray_commands"])
    workers = " ".join(config["worker_start_ray_commands"])
    assert re.search(r"ray start --head --port=6379\b", head), head
    assert "ray start --address=$RAY_HEAD_IP:6379" in workers, workers
    # Ray's workers at normal priority: the router (an actor) must not run below other processes
    assert "RAY_worker_niceness=0 ray start" in head and "RAY_worker_niceness=0 ray start" in workers
    if config["provider"]["type"] == "local":
        # node kinds come from each machine's resources file, advertised by `ray start`
        assert "ray-resources.json" in setup and "ray-resources.json" in head and "ray-resources.json" in workers
    else:
        kinds = {name: t.get("resources", {}) for name, t in config["available_node_types"].items()}
        assert any("prefill_node" in r for r in kinds.values()) and any("decode_node" in r for r in kinds.values())
        types = [t["node_config"].get("InstanceType", "") for t in config["available_node_types"].values()]
        assert any(t.startswith(("g5.", "g6", "p4", "p5")) for t in types), f"no GPU instance type in {types}"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_documented_pdcluster_commands_parse(path):
    for argv in _documented_commands(path):
        build_parser().parse_args(argv[1:])


def _head_up_command(path: Path) -> list[str]:
    """argv of the ``pdcluster up`` the head's start commands run after Ray."""
    ups = [cmd for cmd in _load(path)["head_start_ray_commands"] if "pdcluster up" in cmd]
    assert len(ups) == 1, f"{path.name}: head_start_ray_commands should start pdcluster once"
    argv = shlex.split(ups[0][ups[0].index("pdcluster up"):].split(">")[0])
    return argv


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_head_starts_pdcluster_after_ray(path):
    cmds = _load(path)["head_start_ray_commands"]
    starts = [i for i, c in enumerate(cmds) if "ray start --head" in c]
    ups = [i for i, c in enumerate(cmds) if "pdcluster up" in c]
    assert starts and ups and starts[0] < ups[0], cmds
    assert "nohup" in cmds[ups[0]] and cmds[ups[0]].rstrip().endswith("&"), "up must not block `ray up`"
    args = build_parser().parse_args(_head_up_command(path)[1:])
    assert args.ray_address == "127.0.0.1:6379" and not args.local
    assert (args.prefill_resource, args.decode_resource) == ("prefill_node", "decode_node")
    assert args.host == "0.0.0.0" and args.api_key_file is not None  # exposed: keys required
    assert args.placement_timeout_s >= 600  # worker nodes join after the head
