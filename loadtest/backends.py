"""Where the load tester sends its requests, by name: ``grpc`` (a pdcluster router) or ``openai``
(any OpenAI-compatible server: pdcluster's HTTP port, vLLM, SGLang, ...).

A backend opens a session that streams one request at a time per thread: prompt token ids in,
``(new tokens, finish reason)`` chunks out, cancellable from another thread. Failures are
:class:`BackendError` with a status name (gRPC code names; HTTP statuses as ``HTTP_<n>``).
Only the given address is ever contacted.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

BACKENDS = ("grpc", "openai")


class BackendError(Exception):
    """A request failed; ``status`` names how (``UNAVAILABLE``, ``HTTP_503``, ...)."""

    def __init__(self, status: str, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Chunk:
    """Part of a streamed response: ``num_tokens`` new tokens; ``finish_reason`` on the last
    (``STOP``, ``LENGTH``, ``ABORT`` or ``""``)."""

    num_tokens: int
    finish_reason: str = ""


class GrpcSession:
    """Streams through :class:`pdcluster.client.PdclusterClient`."""

    def __init__(self, address: str, timeout_s: float, api_key: str | None = None, tls_ca: str | None = None) -> None:
        from pdcluster.client import PdclusterClient

        self.client = PdclusterClient(address, timeout_s=timeout_s, api_key=api_key, tls_ca=tls_ca)

    def wait_ready(self, timeout_s: float) -> None:
        self.client.wait_ready(timeout_s)

    def stream(self, prompt: Sequence[int], max_tokens: int, temperature: float, request_id: str):
        """A handle with ``cancel()``, ``cancelled`` and iteration over :class:`Chunk`."""
        return _GrpcStream(self.client.stream(list(prompt), max_tokens=max_tokens, temperature=temperature,
                                              ignore_eos=True, request_id=request_id))

    def close(self) -> None:
        self.client.close()


class _GrpcStream:
    def __init__(self, stream) -> None:
        self._s = stream

    @property
    def cancelled(self) -> bool:
        return self._s.cancelled

    def cancel(self) -> None:
        self._s.cancel()

    def __iter__(self) -> Iterator[Chunk]:
        import grpc

        from pdcluster.client import finish_reason_name

        try:
            for c in self._s:
                reason = finish_reason_name(c.finish_reason) if c.finish_reason else ""
                yield Chunk(len(c.token_ids), reason)
        except grpc.RpcError as e:
            code = e.code() if hasattr(e, "code") else None
            raise BackendError(code.name if code else "UNKNOWN", e.details() if hasattr(e, "details") else str(e))


class OpenAISession:
    """Streams ``/v1/completions`` with the official ``openai`` package (token-id prompts,
    ``ignore_eos``, usage in the last chunk). Each text chunk counts as one token until the
    final usage says how many there were."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None, tls_ca: str | None = None) -> None:
        import openai

        self.openai = openai
        self.client = openai_client(base_url, api_key, timeout_s, max_retries=0, tls_ca=tls_ca)
        self.model = ""

    def wait_ready(self, timeout_s: float) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.model = self.client.models.list().data[0].id
                return
            except (self.openai.APIError, IndexError) as e:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no model served at {self.client.base_url} within {timeout_s}s: {e}")
                time.sleep(0.5)

    def stream(self, prompt: Sequence[int], max_tokens: int, temperature: float, request_id: str):
        return _OpenAIStream(self, prompt, max_tokens, temperature, request_id)

    def close(self) -> None:
        self.client.close()


class _OpenAIStream:
    def __init__(self, session: OpenAISession, prompt, max_tokens: int, temperature: float, request_id: str):
        self._args = dict(model=session.model, prompt=list(prompt), max_tokens=max_tokens, temperature=temperature,
                          stream=True, stream_options={"include_usage": True}, user=request_id,
                          extra_body={"ignore_eos": True})
        self._session = session
        self._stream = None
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        if self._stream is not None:
            self._stream.close()

    def __iter__(self) -> Iterator[Chunk]:
        openai = self._session.openai
        counted = 0
        try:
            self._stream = self._session.client.completions.create(**self._args)
            for c in self._stream:
                if c.choices and c.choices[0].text:
                    counted += 1
                    yield Chunk(1)
                if c.usage is not None and c.usage.completion_tokens > counted:
                    yield Chunk(c.usage.completion_tokens - counted)  # tokens that arrived without text
                if c.choices and c.choices[0].finish_reason:
                    reason = c.choices[0].finish_reason.upper()
                    yield Chunk(0, reason)
        except openai.APIStatusError as e:
            raise BackendError(f"HTTP_{e.status_code}", str(e.message))
        except (openai.APIConnectionError, openai.APITimeoutError) as e:
            if self.cancelled:
                return
            raise BackendError("UNAVAILABLE", str(e))


def openai_client(base_url: str, api_key: str | None, timeout_s: float, max_retries: int,
                  tls_ca: str | None = None):
    """The ``openai`` SDK's client of ``base_url`` (``/v1`` appended when missing); without an
    ``api_key`` it sends a placeholder (the SDK requires one; an open server ignores it); with
    ``tls_ca`` (a PEM CA file) an ``https://`` server's certificate is verified against that CA.

    Raises:
        OSError: ``tls_ca`` cannot be read.
    """
    import openai

    base = base_url.rstrip("/")
    http = {} if tls_ca is None else {"http_client": openai.DefaultHttpxClient(
        verify=ssl.create_default_context(cafile=tls_ca), timeout=timeout_s)}
    return openai.OpenAI(base_url=base if base.endswith("/v1") else base + "/v1", api_key=api_key or "unused",
                         timeout=timeout_s, max_retries=max_retries, **http)


def open_session(backend: str, address: str, timeout_s: float, api_key: str | None = None,
                 tls_ca: str | None = None):
    """A session of ``backend`` at ``address`` (``HOST:PORT`` for grpc, a base URL for openai)
    presenting ``api_key`` (none: no key), verifying a TLS server with the CA file ``tls_ca``.

    Raises:
        ValueError: unknown backend.
    """
    if backend == "grpc":
        return GrpcSession(address, timeout_s, api_key, tls_ca)
    if backend == "openai":
        return OpenAISession(address, timeout_s, api_key, tls_ca)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
