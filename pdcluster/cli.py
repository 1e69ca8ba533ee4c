"""The ``pdcluster`` command line.

Subcommands:

* ``generate`` - send one prompt to a router and print the completion (its
  sampling flags derive from :mod:`common.sampling_params`);
* ``up`` / ``down`` / ``status`` / ``scale`` - manage a deployment (flags in
  :mod:`deploy.cli`; the work in :mod:`deploy.local` / :mod:`deploy.scale`, imported
  when the command runs);
* ``top`` - a live view of a running cluster (:mod:`pdcluster.top`);
* ``loadtest`` - replay a trace against a router (:mod:`loadtest.cli`).

:func:`main` returns the process exit code (0 success, 1 request failure,
2 usage error, raised by argparse as ``SystemExit``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import grpc

from common.sampling_params import Shape, sampling_params
from pdcluster.client import API_KEY_ENV, GenerationResult, PdclusterClient, Usage, accumulate, rpc_error_text

FALLBACK_ADDRESS = "127.0.0.1:50051"
FALLBACK_HTTP = "127.0.0.1:8000"


def default_address(key: str = "router_address", fallback: str = FALLBACK_ADDRESS,
                    state_dir: Path | None = None) -> str:
    """The address ``key`` (the router's gRPC address by default) of the cluster state file
    ``pdcluster up`` wrote in ``state_dir``; with no ``state_dir``, that of the default state
    directory (``~/.pdcluster``), else ``fallback`` (``127.0.0.1:50051``).

    Raises:
        FileNotFoundError: ``state_dir`` is given and no cluster is up from it.
    """
    try:
        from deploy.state import read_state

        state = read_state(state_dir)
    except ImportError:
        return fallback
    except FileNotFoundError:
        if state_dir is not None:
            raise
        return fallback
    address = state.get(key) if state else None
    return address or fallback


def _address(args: argparse.Namespace, key: str, fallback: str) -> str | None:
    """``--address``, else the address ``key`` from ``--state-dir`` (:func:`default_address`);
    ``None`` (after one line on stderr) when ``--state-dir`` holds no cluster."""
    if args.address:
        return args.address
    try:
        return default_address(key, fallback, args.state_dir)
    except FileNotFoundError:
        print(f"error: no pdcluster is up from state dir {args.state_dir}; give --address", file=sys.stderr)
        return None


def _fallback_hint(args: argparse.Namespace, address: str, fallback: str) -> str:
    """What to add to "unreachable" when ``address`` is the ``fallback`` tried because no ``--address``
    was given and no cluster is up from the default state directory ("" otherwise)."""
    if args.address or args.state_dir is not None or address != fallback:
        return ""
    try:
        from deploy.state import read_state

        read_state(None)
        return ""
    except (ImportError, FileNotFoundError):
        return f" (no pdcluster is up from ~/.pdcluster, so {fallback} was tried: give --state-dir DIR or --address)"


def _add_state_dir(p: argparse.ArgumentParser) -> None:
    """``--state-dir`` of a command that calls the router: where its default ``--address`` comes from."""
    p.add_argument("--state-dir", type=Path, default=None, metavar="DIR",
                   help="state directory `up --state-dir` wrote: its router address is the default --address "
                        "(default: ~/.pdcluster, and the fallback address while no cluster is up from it)")


def _add_sampling_flags(p: argparse.ArgumentParser) -> None:
    """One flag per declared sampling parameter with ``cli`` set (``--max-tokens`` ...;
    ``dest`` is the parameter's name). Every default is ``None``: an absent flag
    leaves the field unset and the server applies its default."""
    for param in sampling_params():
        if not param.cli:
            continue
        kwargs: dict = {"dest": param.name, "default": None, "help": param.describe()}
        if param.type is bool:  # an optional one defaults to true: --name / --no-name
            kwargs["action"] = argparse.BooleanOptionalAction if param.presence else "store_true"
        elif param.shape is Shape.REPEATED:
            kwargs.update(action="append", type=param.type, metavar="ID" if param.token_ids else "STR")
        else:
            kwargs["type"] = param.type
        p.add_argument(param.cli_flag, **kwargs)


def _sampling_kwargs(args: argparse.Namespace) -> dict:
    """The client's sampling keyword arguments from the parsed flags (``None``: flag absent)."""
    return {param.name: getattr(args, param.name) for param in sampling_params() if param.cli}


def _add_api_key(p: argparse.ArgumentParser, env_api_key: str | None) -> None:
    """``--api-key`` of a command that calls the router; its default is ``$PDCLUSTER_API_KEY``."""
    p.add_argument("--api-key", default=env_api_key, metavar="KEY",
                   help=f"API key of the router, sent as 'authorization: Bearer KEY' (default: ${API_KEY_ENV})")


def _add_tls_ca(p: argparse.ArgumentParser) -> None:
    """``--tls-ca`` of a command that calls the router."""
    p.add_argument("--tls-ca", default=None, metavar="PATH",
                   help="PEM CA certificate to verify the router's TLS certificate with (the router serves TLS: "
                        "`up --tls-cert`); without it the connection is plaintext")


def _add_generate(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("generate", allow_abbrev=False, help="generate a completion for one prompt")
    p.add_argument("--address", default=None,
                   help=f"router HOST:PORT (default: from the cluster state in --state-dir, else {FALLBACK_ADDRESS})")
    _add_state_dir(p)
    p.add_argument("--stream", action="store_true", help="print text deltas as they arrive")
    _add_sampling_flags(p)
    p.add_argument("--request-id", default="", help="client-chosen request id")
    p.add_argument("--chat", action="store_true",
                   help="send PROMPT as a user chat message (server applies the chat template); with the router's "
                        "--reasoning-parser, the model's thinking is printed to stderr and the answer to stdout")
    p.add_argument("--system", default=None, metavar="TEXT", help="system message (requires --chat)")
    p.add_argument("--structured-outputs", type=_json_of(dict, "object"), default=None, metavar="JSON",
                   help='constrain the output (vLLM\'s structured_outputs), e.g. \'{"choice": ["yes", "no"]}\', '
                        '\'{"regex": "[0-9]+"}\', \'{"json": {"type": "object"}}\', \'{"json_object": true}\'')
    p.add_argument("--tools", type=_json_of(list, "array"), default=None, metavar="JSON",
                   help="OpenAI tool objects the model may call, a JSON array (requires --chat); the calls the "
                        "answer makes are printed after its text, one JSON object per line")
    p.add_argument("--tool-choice", default=None, metavar="CHOICE",
                   help="none, auto (needs the router's --tool-call-parser), required, or a function's name "
                        "(the answer is that call); default: OpenAI's (auto where the router reads calls)")
    p.add_argument("prompt", metavar="PROMPT")
    p.set_defaults(func=cmd_generate, usage_error=p.error)  # the subcommand's usage line with the error
    return p


def _json_of(kind: type, name: str):
    """An argparse ``type``: JSON text whose value is a ``kind`` (``--structured-outputs``: an object,
    ``--tools``: an array); argparse reports anything else as a usage error."""
    def parse(text: str):
        try:
            value = json.loads(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"must be a JSON {name}, got {type(value).__name__}")
        return value
    return parse


def _tool_options(args: argparse.Namespace) -> dict | None:
    """The ``chat_options`` of ``--tools`` / ``--tool-choice`` (None: neither)."""
    if args.tools is None:
        return None
    choice = args.tool_choice
    if choice is not None and choice not in ("none", "auto", "required"):
        choice = {"type": "function", "function": {"name": choice}}
    return {"tools": args.tools, "tool_choice": choice}


def _add_top(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser("top", allow_abbrev=False, help="live view of a running cluster from its Prometheus metrics")
    p.add_argument("--address", default=None,
                   help=f"router HTTP HOST:PORT (default: from the cluster state in --state-dir, else {FALLBACK_HTTP})")
    _add_state_dir(p)
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes")
    p.add_argument("--iterations", type=int, default=None, help="refresh this many times, then exit")
    p.set_defaults(func=cmd_top, usage_error=p.error)
    return p


def cmd_top(args: argparse.Namespace) -> int:
    """Run ``pdcluster top``; returns 0, or 1 when the router's HTTP server is unreachable or no cluster
    is up from ``--state-dir``."""
    from pdcluster.top import run_top

    address = _address(args, "router_http_address", FALLBACK_HTTP)
    if address is None:
        return 1
    base = address if address.startswith("http") else f"{'https' if args.tls_ca else 'http'}://{address}"
    return run_top(base, interval_s=args.interval, iterations=args.iterations, api_key=args.api_key,
                   tls_ca=args.tls_ca, unreachable_hint=_fallback_hint(args, address, FALLBACK_HTTP))


def _version() -> str:
    """The installed distribution's version (``unknown`` when run from a tree never installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("pdcluster")
    except PackageNotFoundError:
        return "unknown"


class _HelpWithDefaults(argparse.HelpFormatter):
    """Help that shows each option's default, as ``argparse.ArgumentDefaultsHelpFormatter`` does, where
    its own text does not already say it and there is one worth showing (not None, not a switch's)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or not action.option_strings or action.nargs == 0  # a switch
                or default is None or default is argparse.SUPPRESS or default in ([], "")):
            return text
        return f"{text} (default: %(default)s)"


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of all subcommands. ``$PDCLUSTER_API_KEY`` is read here, once: the
    default ``--api-key`` of ``generate``, ``top`` and ``loadtest``, and ``up``'s key when it is
    given none."""
    from deploy.cli import register as register_deploy
    from loadtest.cli import register as register_loadtest

    env_api_key = os.environ.get(API_KEY_ENV) or None
    parser = argparse.ArgumentParser(prog="pdcluster", description="pdcluster serving cluster",
                                     allow_abbrev=False)
    parser.add_argument("--version", action="version", version=f"pdcluster {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=partial(argparse.ArgumentParser, formatter_class=_HelpWithDefaults))
    clients = [_add_generate(sub), _add_top(sub)]
    register_deploy(sub, env_api_key)
    clients.append(register_loadtest(sub))
    for p in clients:
        _add_api_key(p, env_api_key)
        _add_tls_ca(p)
    return parser


def _summary(result: GenerationResult, elapsed_s: float) -> str:
    u = result.usage
    rate = u.completion_tokens / elapsed_s if elapsed_s > 0 else 0.0
    stop = f" stop_reason={result.stop_reason!r}" if result.stop_reason is not None else ""
    return (f"[finish={result.finish_reason}{stop} prompt_tokens={u.prompt_tokens} "
            f"completion_tokens={u.completion_tokens} cached_prompt_tokens={u.cached_prompt_tokens} "
            f"elapsed={elapsed_s:.3f}s tokens/s={rate:.1f} request_id={result.request_id}]")


def _stream_print(client: PdclusterClient, prompt, params: dict) -> GenerationResult:
    chunks = []
    stream = client.stream(prompt, **params)
    try:
        for chunk in stream:
            chunks.append(chunk)
            if chunk.reasoning_text:  # a reasoning model's thinking (the router's --reasoning-parser)
                sys.stderr.write(chunk.reasoning_text)
                sys.stderr.flush()
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
    except BaseException:
        stream.cancel()
        raise
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not chunks:
        return GenerationResult("", [], "", "UNSPECIFIED", Usage())
    return accumulate(chunks)


def cmd_generate(args: argparse.Namespace) -> int:
    """Run ``pdcluster generate``; returns 0, 1 on a gRPC error or a ``--state-dir`` no cluster is up from,
    or 2 on a value the client library refuses before sending (e.g. a negative ``--max-tokens``) or a
    ``--tls-ca`` that cannot be read; errors are one line on stderr."""
    prompt: object = args.prompt
    if args.chat:
        messages = [{"role": "system", "content": args.system}] if args.system is not None else []
        prompt = messages + [{"role": "user", "content": args.prompt}]
    params = {**_sampling_kwargs(args), "request_id": args.request_id,
              "structured_outputs": args.structured_outputs, "chat_options": _tool_options(args)}
    address = _address(args, "router_address", FALLBACK_ADDRESS)
    if address is None:
        return 1
    try:
        client = PdclusterClient(address, api_key=args.api_key, tls_ca=args.tls_ca)
    except OSError as exc:  # the --tls-ca file
        print(f"error: --tls-ca {args.tls_ca}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    start = time.monotonic()
    try:
        with client:
            if args.stream:
                result = _stream_print(client, prompt, params)
            else:
                result = client.generate(prompt, **params)
                if result.reasoning_text:
                    print(result.reasoning_text, file=sys.stderr, flush=True)
                print(result.text, flush=True)
            for call in result.tool_calls:
                print(json.dumps({"id": call.id, "name": call.name, "arguments": call.arguments}), flush=True)
    except grpc.RpcError as exc:
        hint = _fallback_hint(args, address, FALLBACK_ADDRESS) if exc.code() == grpc.StatusCode.UNAVAILABLE else ""
        print(f"error: {rpc_error_text(exc)}{hint}", file=sys.stderr)
        return 1
    except (TypeError, ValueError) as exc:  # refused by the client library before sending
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        if args.stream:  # end the streamed text's line first
            print(flush=True)
        print("error: interrupted", file=sys.stderr)
        return 130
    print(_summary(result, time.monotonic() - start), file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the subcommand, return its exit code.

    Raises:
        SystemExit: on usage errors (code 2) or ``--help`` (code 0).
        ImportError: ``up``/``down``/``status`` when :mod:`deploy.local` is missing.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "generate" and args.system is not None and not args.chat:
        args.usage_error("--system requires --chat")
    if args.command == "generate" and args.tools is not None and not args.chat:
        args.usage_error("--tools requires --chat")
    if args.command == "generate" and args.tool_choice is not None and args.tools is None:
        args.usage_error("--tool-choice requires --tools")
    if args.command == "top" and not args.interval > 0:
        args.usage_error(f"--interval must be > 0 (seconds), got {args.interval:g}")
    if args.command == "top" and args.iterations is not None and args.iterations < 1:
        args.usage_error(f"--iterations must be >= 1, got {args.iterations}")
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
