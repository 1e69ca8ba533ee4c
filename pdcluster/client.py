"""Python client for the public ``pdcluster.v1.Router`` gRPC API.

:class:`PdclusterClient` wraps one gRPC channel to a router (with ``api_key``, every call
carries ``authorization: Bearer KEY`` metadata; with ``tls_ca``, TLS verified against that CA)::

    with PdclusterClient("127.0.0.1:50051", timeout_s=60, api_key=key) as client:
        client.wait_ready(30)
        result = client.generate("Hello", max_tokens=32, temperature=0)
        for chunk in client.stream([{"role": "user", "content": "Hi"}]):
            print(chunk.text, end="", flush=True)

Errors reported by the server (and transport failures) propagate unchanged
as :class:`grpc.RpcError`; ``err.code()`` and ``err.details()`` carry the
status, e.g. ``INVALID_ARGUMENT`` for bad sampling parameters,
``ALREADY_EXISTS`` for a duplicate running request id, or ``UNAUTHENTICATED``
for a missing or wrong API key.
"""

from __future__ import annotations

import socket
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from common.grpc_metadata import bearer, with_metadata

# Also re-exported: callers import the result types and helpers from pdcluster.client.
from pdcluster.client_types import (
    ChatMessageLike,  # noqa: F401
    GenerationResult,
    Prompt,
    TokenLogprob,  # noqa: F401
    ToolCall,  # noqa: F401
    Usage,  # noqa: F401
    accumulate,
    build_request,
    finish_reason_name,  # noqa: F401
)
from pdcluster.v1 import router_pb2, router_pb2_grpc

ROUTER_SERVICE = "pdcluster.v1.Router"
API_KEY_ENV = "PDCLUSTER_API_KEY"
"""Where pdcluster's commands take an API key from when ``--api-key`` is not given (read by the
CLI, :func:`pdcluster.cli.build_parser`; this library reads no environment)."""
# Reconnect quickly after a router restart instead of gRPC's 120 s backoff cap.
_CHANNEL_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # a first message with prompt_logprobs 20 takes ~215 bytes per prompt token: past gRPC's 4 MiB
    # default at ~19k tokens
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
)
_HEALTH_POLL_S = 0.1
_HEALTH_CALL_S = 1.0


def rpc_error_text(exc: grpc.RpcError) -> str:
    """``CODE: details`` of a failed call, as the CLI prints it (not the error object's repr); an
    ``UNAUTHENTICATED`` one also says where the CLI takes the key from."""
    code = exc.code() if hasattr(exc, "code") else None
    details = exc.details() if hasattr(exc, "details") else str(exc)
    hint = f" (give the router's API key with --api-key or ${API_KEY_ENV})" \
        if code == grpc.StatusCode.UNAUTHENTICATED else ""
    return f"{code.name if code else 'UNKNOWN'}: {details}{hint}"


class GenerationStream:
    """Iterator over the ``GenerateResponse`` deltas of one streaming call.

    :meth:`cancel` (safe from any thread) cancels the gRPC call; the server
    sees the cancellation and frees the request. After a local cancel the
    iteration ends quietly instead of raising ``CANCELLED``. Any other
    failure raises :class:`grpc.RpcError` from ``next()``.
    """

    def __init__(self, call: Any):
        self._call = call
        self._cancelled = False

    def __iter__(self) -> GenerationStream:
        return self

    def __next__(self) -> router_pb2.GenerateResponse:
        if self._cancelled:
            raise StopIteration
        try:
            return next(self._call)
        except grpc.RpcError as exc:
            if self._cancelled and exc.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None
            raise

    def cancel(self) -> bool:
        """Cancel the call; returns False if it had already terminated."""
        self._cancelled = True
        return self._call.cancel()

    @property
    def cancelled(self) -> bool:
        """True once :meth:`cancel` was called."""
        return self._cancelled

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()


def read_ca(tls_ca: str | bytes) -> bytes:
    """PEM certificate(s) from ``tls_ca``: PEM text/bytes as given, anything else a file path.

    Raises:
        OSError: the file cannot be read.
    """
    if isinstance(tls_ca, bytes):
        return tls_ca
    if tls_ca.lstrip().startswith("-----BEGIN"):
        return tls_ca.encode()
    with open(tls_ca, "rb") as f:
        return f.read()


class PdclusterClient:
    """Blocking client of one router at ``address`` (``"host:port"``).

    ``timeout_s`` is the deadline in seconds of every RPC (for streams: of
    the whole stream); ``None`` means no deadline. Use as a context manager
    or call :meth:`close` to release the channel. All RPC methods raise
    :class:`grpc.RpcError` with the server's status code on failure
    (``DEADLINE_EXCEEDED`` when ``timeout_s`` elapses, ``UNAVAILABLE`` when
    the router cannot be reached, ``UNAUTHENTICATED`` when the router needs an
    API key and ``api_key`` is missing or wrong; health checks need none).
    With ``tls_ca`` (the PEM, or a path to it, of the CA that issued the router's
    certificate) the channel is TLS and the router's certificate is verified;
    a failed handshake (e.g. a plaintext router) reads as ``UNAVAILABLE``.

    Raises:
        OSError: ``tls_ca`` names a file that cannot be read.
    """

    def __init__(self, address: str, timeout_s: float | None = None, api_key: str | None = None,
                 tls_ca: str | bytes | None = None):
        self.address = address
        self.timeout_s = timeout_s
        channel = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS) if tls_ca is None else \
            grpc.secure_channel(address, grpc.ssl_channel_credentials(read_ca(tls_ca)), options=_CHANNEL_OPTIONS)
        self._channel = with_metadata(channel, (bearer(api_key),) if api_key else ())
        self._stub = router_pb2_grpc.RouterStub(self._channel)

    def close(self) -> None:
        """Close the channel; in-flight calls are cancelled."""
        self._channel.close()

    def __enter__(self) -> PdclusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompt: Prompt,
        *,
        request_id: str = "",
        **sampling: Any,
    ) -> GenerationResult:
        """Generate a whole completion (``stream=false``) and return it.

        ``sampling``: one keyword per declared sampling parameter, as in
        :func:`build_request`; ``None`` leaves a field unset (server default).
        A chat prompt also takes ``chat_options`` (:func:`build_request`).
        ``request_id`` empty: server-minted.

        Raises:
            grpc.RpcError: the server rejected or failed the request.
            TypeError, ValueError: see :func:`build_request`.
            RuntimeError: the server closed the call without a response.
        """
        req = build_request(prompt, request_id=request_id, stream=False, **sampling)
        call = self._stub.Generate(req, timeout=self.timeout_s)
        try:
            return accumulate(call)
        except ValueError:
            raise RuntimeError("router closed Generate without a response") from None

    def stream(
        self,
        prompt: Prompt,
        *,
        request_id: str = "",
        **sampling: Any,
    ) -> GenerationStream:
        """Start a streaming generation (``stream=true``); one chunk per step.

        Each chunk carries the new ``token_ids`` and ``text`` delta; the last
        one has ``finish_reason`` and ``usage``. Call ``.cancel()`` on the
        returned :class:`GenerationStream` to stop early. Parameters as in
        :meth:`generate`.

        Raises:
            TypeError, ValueError: see :func:`build_request` (at call time).
            grpc.RpcError: from iteration, when the call fails.
        """
        req = build_request(prompt, request_id=request_id, stream=True, **sampling)
        return GenerationStream(self._stub.Generate(req, timeout=self.timeout_s))

    def abort(self, request_id: str) -> bool:
        """Abort a running request; returns False if no running request has that id.

        Raises:
            grpc.RpcError: the call failed.
        """
        resp = self._stub.Abort(router_pb2.AbortRequest(request_id=request_id), timeout=self.timeout_s)
        return resp.found

    def model_info(self) -> router_pb2.ModelInfo:
        """Return the served model's ``ModelInfo`` (name, max_model_len, vocab, EOS ids, block size).

        Raises:
            grpc.RpcError: the call failed.
        """
        return self._stub.GetModelInfo(router_pb2.GetModelInfoRequest(), timeout=self.timeout_s)

    def wait_ready(self, timeout_s: float, *, service: str | None = None) -> None:
        """Block until the router's gRPC health status is ``SERVING``.

        Polls ``grpc.health.v1.Health/Check`` for ``service`` or, by default,
        for ``"pdcluster.v1.Router"`` falling back to the server-wide ``""``
        when the router service is not registered. Unreachable servers are
        retried until ``timeout_s`` seconds have passed.

        Raises:
            TimeoutError: not ``SERVING`` within ``timeout_s`` seconds.
            grpc.RpcError: the health check failed for another reason than
                unavailability/not-found (e.g. ``UNIMPLEMENTED``: no health service).
        """
        health = health_pb2_grpc.HealthStub(self._channel)
        names = (ROUTER_SERVICE, "") if service is None else (service,)
        deadline = time.monotonic() + timeout_s
        last = "no response"
        while (remaining := deadline - time.monotonic()) > 0:
            for name in names:
                try:
                    resp = health.Check(
                        health_pb2.HealthCheckRequest(service=name),
                        timeout=min(remaining, _HEALTH_CALL_S),
                        wait_for_ready=True,
                    )
                except grpc.RpcError as exc:
                    code = exc.code()
                    last = f"{code.name} for service {name!r}"
                    if code == grpc.StatusCode.NOT_FOUND:
                        continue
                    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                        break
                    raise
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = f"{health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)} for service {name!r}"
                break
            time.sleep(max(0.0, min(_HEALTH_POLL_S, deadline - time.monotonic())))
        if not _connects(self._channel):
            last = ("something listens there but does not speak gRPC: an HTTP port? give the router's gRPC "
                    "address (its HTTP API takes HTTP clients, e.g. `loadtest --backend openai --base-url`)"
                    if _tcp_open(self.address)
                    else "nothing answers there: connection refused, or the address unreachable")
        raise TimeoutError(f"router at {self.address} not SERVING after {timeout_s}s ({last})")


def _tcp_open(address: str, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to ``HOST:PORT`` opens (``[v6]:PORT`` too)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _connects(channel: grpc.Channel, timeout_s: float = 0.2) -> bool:
    """Whether ``channel`` reaches its server (a TCP and HTTP/2 connection within ``timeout_s``)."""
    try:
        grpc.channel_ready_future(channel).result(timeout=timeout_s)
        return True
    except grpc.FutureTimeoutError:
        return False
