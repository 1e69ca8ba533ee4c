"""Credentials carried as gRPC call metadata, for every client side of pdcluster.

A caller's channel adds fixed ``(key, value)`` pairs to each call it makes
(:func:`with_metadata`): the Python client its API key as ``authorization: Bearer KEY``
(:func:`bearer`), the router and the workers the cluster secret
(:mod:`serving.security`). Servers read the key back with :func:`bearer_token`.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

import grpc

AUTHORIZATION = "authorization"
"""The metadata key (gRPC) / header (HTTP) of an API key: ``Bearer KEY``."""
_SCHEME = "bearer"


def bearer(token: str) -> tuple[str, str]:
    """The ``("authorization", "Bearer <token>")`` metadata pair."""
    return AUTHORIZATION, f"Bearer {token}"


def bearer_token(value: str | None) -> str | None:
    """The token of an ``authorization`` value ``Bearer <token>`` (scheme case-insensitive),
    or ``None`` when ``value`` is absent or has another form."""
    if not value:
        return None
    scheme, _, token = value.partition(" ")
    token = token.strip()
    return token if scheme.lower() == _SCHEME and token else None


def metadata_value(metadata: Sequence[tuple[str, str]] | None, key: str) -> str | None:
    """The first value of ``key`` in a call's invocation metadata (``None`` when absent)."""
    for k, v in metadata or ():
        if k == key:
            return v
    return None


class _CallDetails(collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")),
        grpc.ClientCallDetails):
    pass


class _AddMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor,
                   grpc.StreamUnaryClientInterceptor, grpc.StreamStreamClientInterceptor):
    """Appends fixed pairs to the metadata of every call (after the caller's own)."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self._pairs = tuple(pairs)

    def _details(self, d: grpc.ClientCallDetails) -> _CallDetails:
        return _CallDetails(d.method, d.timeout, (*(d.metadata or ()), *self._pairs), d.credentials,
                            d.wait_for_ready, d.compression)

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._details(client_call_details), request)

    def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)

    def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return continuation(self._details(client_call_details), request_iterator)


def with_metadata(channel: grpc.Channel, pairs: Sequence[tuple[str, str]]) -> grpc.Channel:
    """``channel`` sending ``pairs`` with every call (``channel`` itself when ``pairs`` is empty);
    closing the result closes ``channel``."""
    return grpc.intercept_channel(channel, _AddMetadata(pairs)) if pairs else channel
