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
    commands = _documented_commands(path)
    assert any(argv[1] == "up" for argv in commands), f"{path.name} documents no `pdcluster up`"
    for argv in commands:
        args = build_parser().parse_args(argv[1:])
        if argv[1] == "up":
            assert args.ray_address == "auto" and not args.local
            assert (args.prefill_resource, args.decode_resource) == ("prefill_node", "decode_node")
            assert args.host == "0.0.0.0"
