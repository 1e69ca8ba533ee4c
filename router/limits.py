"""Limits of one client request, declared once; both front doors refuse what exceeds them.

The sampling parameters' own limits (ranges, at most 16 stop strings of at most 256
characters, at most 1024 ``logit_bias`` entries, ``logprobs`` <= 20) are declared with the
parameters in :mod:`common.sampling_params`. The rest is here: the message sizes of the
public ports (``max_request_bytes``, :class:`router.server.RouterConfig`), the prompt's and
the chat's sizes, the chat roles, the request id, and the HTTP API's ``n`` and choices.
This module imports nothing, so the CLI reads its defaults cheaply.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Largest gRPC message / HTTP body the router's public ports accept (bytes); internal
#: (worker, KV) messages have their own limit (:data:`serving.rpc.MAX_MESSAGE_BYTES`).
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
#: Seconds an HTTP request's whole body may take to arrive (later: 408; :mod:`router.openai.body`).
DEFAULT_BODY_TIMEOUT_S = 60.0
#: Seconds an HTTP request's head (request line and headers) may take to arrive, from the
#: connection's start or the previous response's end (later: closed; :mod:`router.http_protocol`).
DEFAULT_HEADER_TIMEOUT_S = 10.0
#: Open connections one router's HTTP port holds at most (more: 503 and closed; :mod:`router.http_protocol`).
DEFAULT_HTTP_MAX_CONNECTIONS = 4096
#: Connections one router's gRPC port holds at once, TLS/HTTP2 handshakes included (more: closed
#: at accept; :func:`serving.rpc.connection_options`).
DEFAULT_GRPC_MAX_CONNECTIONS = 4096
#: Cap on a prompt's bytes when the tokenizer gives none (:func:`router.validation.prompt_byte_cap`).
DEFAULT_MAX_PROMPT_BYTES = 1024 * 1024
MAX_CHAT_MESSAGES = 256
#: A request id travels to the workers as gRPC metadata: printable ASCII, at most this long.
MAX_REQUEST_ID_CHARS = 256
#: How deep a chat's ``chat_template_kwargs`` (JSON) may nest: the template renderer copies the
#: values recursively, and a template variable is a flag or a small structure.
MAX_TEMPLATE_KWARGS_DEPTH = 16
#: How deep a chat's ``tools`` (JSON) may nest: a tool's parameters are a JSON schema, as deep as a
#: structured output's (:data:`common.structured_outputs.MAX_SCHEMA_DEPTH`), inside the tool object.
MAX_TOOLS_DEPTH = 68
#: How deep an earlier tool call's arguments (JSON) may nest, as a template variable's.
MAX_ARGUMENTS_DEPTH = MAX_TEMPLATE_KWARGS_DEPTH * 4
#: The chat roles the router accepts: OpenAI's (``developer`` is its newer name of
#: ``system``); the model's chat template renders them.
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")
#: HTTP API: samples per prompt (``n``), and choices per request (prompts x ``n``).
MAX_N = 16
MAX_CHOICES = 256


@dataclass(frozen=True)
class Limits:
    """Limits of the served model and of one request.

    Attributes:
        max_model_len: prompt + output tokens.
        vocab_size: token ids must be below it.
        max_prompt_bytes: a text prompt's UTF-8 bytes, or a chat's roles and contents
            together; checked before tokenization (the router derives it from the
            tokenizer: :func:`router.validation.prompt_byte_cap`).
        max_messages: chat messages per request.

    Raises:
        ValueError: a limit that is not positive.
    """

    max_model_len: int
    vocab_size: int
    max_prompt_bytes: int = DEFAULT_MAX_PROMPT_BYTES
    max_messages: int = MAX_CHAT_MESSAGES

    def __post_init__(self) -> None:
        if min(self.max_model_len, self.vocab_size, self.max_prompt_bytes, self.max_messages) < 1:
            raise ValueError(f"every limit must be positive: {self}")
