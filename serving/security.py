"""Who may call which port: every gRPC server and every internal gRPC channel is made here.

Two planes:

* **public**: the router's gRPC port (and its HTTP port, :mod:`router.openai.auth`). With
  API keys configured every call needs ``authorization: Bearer KEY`` naming one of them;
  without any the port is open.
* **internal**: the workers' RPC ports and the decode workers' KV ports. With a cluster
  secret configured every call needs it in the ``x-pdcluster-cluster-secret`` metadata, which
  every internal channel made here (:func:`internal_channel`) sends.

A call without the credential is refused with ``UNAUTHENTICATED`` by a server interceptor,
before its handler runs (nothing is read from the request, nothing allocated). The standard
health service (``grpc.health.v1.Health``) answers without credentials. Keys and secrets are
compared in constant time (:func:`hmac.compare_digest`).
"""

from __future__ import annotations

import enum
import hmac
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, field, replace
from typing import Any

import grpc

from common.grpc_metadata import AUTHORIZATION, bearer_token, metadata_value, with_metadata
from serving.rpc import GRPC_OPTIONS

CLUSTER_SECRET_METADATA = "x-pdcluster-cluster-secret"
"""The metadata key internal callers send the cluster secret under."""
HEALTH_PREFIX = "/grpc.health.v1.Health/"
"""Methods answered without credentials."""


class Plane(enum.Enum):
    """Which credential a server requires: API keys (``PUBLIC``) or the cluster secret (``INTERNAL``)."""

    PUBLIC = "public"
    INTERNAL = "internal"


def check_credential(value: str, what: str) -> None:
    """Refuse a key or secret that cannot travel as ``Bearer <value>`` in a header / metadata.

    Raises:
        ValueError: ``value`` is empty, or holds a character outside printable ASCII or whitespace.
    """
    if not value or not all("!" <= c <= "~" for c in value):
        raise ValueError(f"{what} must be non-empty printable ASCII without spaces")


def _matches(given: str | None, expected: Sequence[str]) -> bool:
    """Whether ``given`` equals one of ``expected``; every candidate is compared in constant time."""
    if given is None:
        return False
    data = given.encode("utf-8", "surrogateescape")
    found = False
    for candidate in expected:
        found |= hmac.compare_digest(data, candidate.encode())
    return found


@dataclass(frozen=True)
class SecurityConfig:
    """The credentials of one process (``pdcluster up`` builds them: :func:`deploy.spec.spec_from_args`).

    Attributes:
        api_keys: keys clients may present on the public plane (the router's ports);
            empty: the public plane is open. Workers get none (:meth:`for_workers`).
        cluster_secret: the internal plane's shared secret (``up`` generates one per
            cluster); empty: internal ports are open and internal channels send none.

    Raises:
        ValueError: a key or the secret is not printable ASCII without spaces
            (:func:`check_credential`).
    """

    api_keys: tuple[str, ...] = field(default=(), repr=False)
    cluster_secret: str = field(default="", repr=False)

    def __post_init__(self) -> None:
        keys = tuple(dict.fromkeys(self.api_keys))  # a list from JSON, duplicates dropped
        for key in keys:
            check_credential(key, "an API key")
        if self.cluster_secret:
            check_credential(self.cluster_secret, "the cluster secret")
        object.__setattr__(self, "api_keys", keys)

    def for_workers(self) -> "SecurityConfig":
        """The credentials a worker needs: the cluster secret only."""
        return replace(self, api_keys=())

    def accepts_api_key(self, key: str | None) -> bool:
        """Whether a public call presenting ``key`` (``None``: none) may proceed."""
        return not self.api_keys or _matches(key, self.api_keys)

    def accepts_cluster_secret(self, secret: str | None) -> bool:
        """Whether an internal call presenting ``secret`` (``None``: none) may proceed."""
        return not self.cluster_secret or _matches(secret, (self.cluster_secret,))


class RequireCredential(grpc.ServerInterceptor):
    """Refuses with ``UNAUTHENTICATED`` every call whose metadata ``accepts`` rejects, except
    health checks. The refusal replaces the method's handler (same streaming kind, no request
    deserializer), so the real handler and later interceptors never run.

    Args:
        accepts: ``f(invocation metadata) -> bool``.
        refusal: the status details of a refused call.
    """

    def __init__(self, accepts: Callable[[Sequence[tuple[str, str]]], bool], refusal: str) -> None:
        self._accepts = accepts
        self._refusal = refusal

    def intercept_service(self, continuation, handler_call_details):
        if handler_call_details.method.startswith(HEALTH_PREFIX) or self._accepts(
                handler_call_details.invocation_metadata):
            return continuation(handler_call_details)
        handler = continuation(handler_call_details)
        if handler is None:
            return None

        def refuse(request_or_iterator, context):
            context.abort(grpc.StatusCode.UNAUTHENTICATED, self._refusal)

        if handler.request_streaming:
            make = grpc.stream_stream_rpc_method_handler if handler.response_streaming \
                else grpc.stream_unary_rpc_method_handler
        else:
            make = grpc.unary_stream_rpc_method_handler if handler.response_streaming \
                else grpc.unary_unary_rpc_method_handler
        return make(refuse)


def credential_check(security: SecurityConfig, plane: Plane) -> RequireCredential | None:
    """The interceptor a server of ``plane`` needs (``None`` when that plane is open)."""
    if plane is Plane.PUBLIC:
        if not security.api_keys:
            return None
        return RequireCredential(
            lambda md: security.accepts_api_key(bearer_token(metadata_value(md, AUTHORIZATION))),
            "missing or invalid API key: send 'authorization: Bearer KEY' metadata")
    if not security.cluster_secret:
        return None
    return RequireCredential(
        lambda md: security.accepts_cluster_secret(metadata_value(md, CLUSTER_SECRET_METADATA)),
        "missing or invalid cluster secret: internal ports serve the cluster's own processes only")


def make_server(security: SecurityConfig, plane: Plane, *, max_workers: int,
                options: Sequence[tuple[str, Any]] = GRPC_OPTIONS,
                interceptors: Sequence[grpc.ServerInterceptor] = ()) -> grpc.Server:
    """A threaded gRPC server of ``plane``: its credential check runs first, then ``interceptors``."""
    check = credential_check(security, plane)
    return grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers), options=list(options),
                       interceptors=[*([check] if check else []), *interceptors])


def bind(server: grpc.Server, host: str, port: int) -> int:
    """Bind a plaintext port (0 = any free port); returns the bound port.

    Raises:
        RuntimeError: the address could not be bound.
    """
    bound = server.add_insecure_port(f"{host}:{port}")
    if bound == 0:
        raise RuntimeError(f"could not bind gRPC server to {host}:{port}")
    return bound


def internal_channel(security: SecurityConfig, target: str,
                     options: Sequence[tuple[str, Any]] = GRPC_OPTIONS) -> grpc.Channel:
    """A channel to an internal port (``host:port``) that sends the cluster secret with every call.

    Its signature is :class:`kvtransfer.transport.ChannelFactory`'s once ``security`` is bound
    (``functools.partial(internal_channel, security)``), so KV senders open theirs here too.
    """
    channel = grpc.insecure_channel(target, options=list(options))
    return with_metadata(channel, ((CLUSTER_SECRET_METADATA, security.cluster_secret),)
                         if security.cluster_secret else ())
