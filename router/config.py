"""The router's settings (:class:`RouterConfig`), apart from the server that runs them
(:mod:`router.server`): what builds a cluster (``deploy``) or recreates a router (the cluster
controller) reads this module without loading the tokenizer or the request path."""

from __future__ import annotations

from dataclasses import dataclass, field

from router.admission import AdmissionConfig
from router.breaker import BreakerConfig
from router.chat import check_chat_template
from router.limits import (
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_GRPC_MAX_CONNECTIONS,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_HTTP_MAX_CONNECTIONS,
    DEFAULT_MAX_REQUEST_BYTES,
)
from router.migration import DEFAULT_MAX_MIGRATIONS, check_max_migrations
from router.openai.cors import check_origins
from router.policy_names import DEFAULT_POLICY, check_policy
from router.reasoning_parsers import check_reasoning_parser
from router.tool_parsers import check_tool_parser
from serving.logs import LogConfig
from serving.security import SecurityConfig


@dataclass(frozen=True)
class RouterConfig:
    """Router settings.

    Attributes:
        model: model name, as clients see it (``GetModelInfo``).
        model_path: the model's resolved HF folder (``deploy`` resolves the spec once,
            :func:`engine.model_loader.resolve_model`); the router reads only its
            ``config.json`` and tokenizer, so it never loads torch.
        redis_url / cluster: the worker registry.
        host / port: where clients connect (port 0 = any free port).
        max_model_len: prompt + max_tokens limit (tokens).
        block_size: decode workers' KV block size, reported by GetModelInfo.
        policy: the worker choice for every role, one of
            :data:`router.policy_names.POLICY_NAMES` (``pdcluster up --router-policy``):
            ``cache_aware`` (prefill workers by least expected prefill work given their
            published prefix caches, decode and colocated workers least loaded),
            ``least_loaded`` or ``round_robin``.
        view_period_s: how often the registry view refreshes (seconds).
        log: log format and level of the router process.
        http_port: the OpenAI-compatible HTTP port on ``host`` (0 = any free port,
            ``None`` = no HTTP server).
        security: the API keys clients must present on both ports (none: open), the TLS
            certificate both ports serve (none: plaintext), and the cluster secret and CA the
            router's channels to the workers use (:mod:`serving.security`).
        max_request_bytes: the largest gRPC message and HTTP body the public ports accept
            (bytes; ``pdcluster up --max-request-bytes``); larger ones are refused with
            RESOURCE_EXHAUSTED / HTTP 413.
        http_body_timeout_s: seconds an HTTP request's whole body may take to arrive
            (``pdcluster up --http-body-timeout``); later: 408 (:mod:`router.openai.body`).
        http_header_timeout_s: seconds an HTTP request's head may take to arrive, from the
            connection's start or the previous response's end (``pdcluster up
            --http-header-timeout``); later: the connection is closed (:mod:`router.http_protocol`).
        http_max_connections: open connections the HTTP port holds at most (``pdcluster up
            --http-max-connections``); one more gets 503 and is closed. With TLS, connections
            still in their handshake are held to the same number apart (:mod:`router.tls_gate`).
        grpc_max_connections: connections the gRPC port holds at once, handshakes included
            (``pdcluster up --grpc-max-connections``); one more is closed at accept.
        allowed_origins: origins browser pages may call the HTTP port from (CORS; ``pdcluster up
            --allowed-origins``; ``*``: any; none: CORS off): :mod:`router.openai.cors`.
        tool_call_parser: the registered parser reading tool calls out of answers to
            ``tool_choice: "auto"`` (``pdcluster up --tool-call-parser``; :mod:`router.tool_parsers`);
            ``None``: ``auto`` is refused.
        reasoning_parser: the registered parser splitting a chat answer's thinking into
            ``reasoning_content`` (``pdcluster up --reasoning-parser``; :mod:`router.reasoning_parsers`).
        chat_template: a Jinja chat template the router renders chats with instead of the model's
            own (``pdcluster up --chat-template``, vLLM's); ``None``: the model's.
        max_prompt_bytes: a prompt's bytes (text, or chat roles and contents), checked
            before tokenization; ``None``: :func:`router.validation.prompt_byte_cap`
            (``max_model_len`` x the longest token), so a prompt that fits is never refused.
        max_migrations: how often one request may resume on other workers after a worker
            failed it (``pdcluster up --max-migrations``; :mod:`router.migration`); 0: never.
        admission: the admission limits (:class:`router.admission.AdmissionConfig`); the gRPC
            pool has ``admission.max_admitted_requests`` + :data:`serving.rpc.SPARE_THREADS` threads.
        breaker: the circuit breaker's thresholds (:class:`router.breaker.BreakerConfig`).
        index: this router's index among the cluster's routers (``pdcluster up --routers N``:
            0 .. N-1); its id (metrics ``worker_id``, service discovery) is ``router-<index>``.
        reuse_port: bind the public gRPC and HTTP ports with SO_REUSEPORT, so the cluster's
            routers share them and the kernel spreads client connections over them (on with
            ``--routers`` > 1 only: with it, a second cluster started on the same fixed port by
            the same user would share the port silently instead of failing).
        advertise_host: the host other processes reach this router's private ``/metrics`` at
            (``""``: ``host``; the Ray actor gives its node's IP when ``host`` is ``0.0.0.0``).

    Raises:
        ValueError: a non-positive ``max_model_len``, ``view_period_s``, ``max_request_bytes``,
            ``http_body_timeout_s``, ``http_header_timeout_s``, ``http_max_connections`` or
            ``max_prompt_bytes``, an unregistered ``policy``, ``tool_call_parser`` or ``reasoning_parser`` (the
            message lists the registered names), a ``chat_template`` that is no Jinja, ``max_migrations`` outside ``[0, 100]``, a
            negative ``index`` or an allowed origin that is not one.
    """

    model: str
    model_path: str
    redis_url: str
    cluster: str = "default"
    host: str = "127.0.0.1"
    port: int = 50051
    max_model_len: int = 2048
    block_size: int = 16
    policy: str = DEFAULT_POLICY
    view_period_s: float = 0.25
    http_port: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    http_body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    http_header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    http_max_connections: int = DEFAULT_HTTP_MAX_CONNECTIONS
    grpc_max_connections: int = DEFAULT_GRPC_MAX_CONNECTIONS
    allowed_origins: tuple[str, ...] = ()
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    max_prompt_bytes: int | None = None
    max_migrations: int = DEFAULT_MAX_MIGRATIONS
    log: LogConfig = field(default_factory=LogConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    breaker: BreakerConfig = field(default_factory=BreakerConfig)
    index: int = 0
    reuse_port: bool = False
    advertise_host: str = ""

    @property
    def port_connections(self) -> int:
        """Connections the router's ports may hold at once (the process's open-file limit must fit
        them): the gRPC port's, the HTTP port's and, with TLS, as many more HTTP ones in their
        handshake (:mod:`router.tls_gate`)."""
        http = 0 if self.http_port is None else self.http_max_connections * (2 if self.security.public_tls else 1)
        return self.grpc_max_connections + http

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"index must be >= 0, got {self.index}")
        if self.max_model_len <= 0 or self.view_period_s <= 0:
            raise ValueError("max_model_len and view_period_s must be positive")
        if self.max_request_bytes <= 0 or (self.max_prompt_bytes is not None and self.max_prompt_bytes <= 0):
            raise ValueError(f"max_request_bytes ({self.max_request_bytes}) and max_prompt_bytes "
                             f"({self.max_prompt_bytes}) must be positive")
        if not (self.http_body_timeout_s > 0 and self.http_header_timeout_s > 0):
            raise ValueError(f"http_body_timeout_s ({self.http_body_timeout_s}) and http_header_timeout_s "
                             f"({self.http_header_timeout_s}) must be positive")
        if min(self.http_max_connections, self.grpc_max_connections) < 1:
            raise ValueError(f"http_max_connections ({self.http_max_connections}) and grpc_max_connections "
                             f"({self.grpc_max_connections}) must be positive")
        if self.http_port is not None and not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.http_port and self.http_port == self.port:
            raise ValueError(f"http_port ({self.http_port}) must differ from port, the gRPC one")
        check_policy(self.policy)
        check_max_migrations(self.max_migrations)
        check_origins(self.allowed_origins)
        check_tool_parser(self.tool_call_parser)
        check_reasoning_parser(self.reasoning_parser)
        if self.chat_template is not None:
            check_chat_template(self.chat_template)
