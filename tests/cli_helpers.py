"""``pdcluster up``'s flags parsed as the CLI parses them, for tests of flags -> configs."""

from __future__ import annotations

import argparse

from deploy.cli import register


def parse_up(*argv: str) -> argparse.Namespace:
    """``pdcluster up ARGV...`` parsed (a bad value exits with status 2 and its message on stderr)."""
    parser = argparse.ArgumentParser(prog="pdcluster", exit_on_error=False)
    register(parser.add_subparsers(dest="command"), env_api_key=None)
    return parser.parse_args(["up", *argv])
