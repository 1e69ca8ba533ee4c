"""Cross-origin requests (CORS) on the router's HTTP port, for browser clients (chat UIs served
from another origin), as vLLM's ``--allowed-origins`` allows them.

Off by default (no ``Access-Control-*`` header is sent, so browsers keep other origins' pages
from reading answers); ``pdcluster up --allowed-origins`` lists the origins allowed, or ``*`` for any.
Starlette's ``CORSMiddleware`` answers preflights (``OPTIONS`` with ``Access-Control-Request-Method``)
itself, before the API-key check: a browser sends no credentials on a preflight. The answers the
browser may read then carry the request-id and retry-after headers too; credentials (cookies) are
never allowed: clients authenticate with the ``Authorization`` header.
"""

from __future__ import annotations

from urllib.parse import urlsplit

ALLOWED_METHODS = ("GET", "POST", "HEAD", "OPTIONS")
ALLOWED_HEADERS = ("authorization", "content-type", "x-request-id", "api-key")
EXPOSED_HEADERS = ("x-request-id", "retry-after", "retry-after-ms")


def check_origins(origins: tuple[str, ...]) -> None:
    """Raises ValueError unless every entry of ``origins`` is ``*`` or an origin
    (``scheme://host[:port]`` with scheme http or https, nothing after the port)."""
    for origin in origins:
        if origin == "*":
            continue
        parts = urlsplit(origin)
        if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query or parts.fragment:
            raise ValueError(f"allowed origin {origin!r} must be '*' or scheme://host[:port] (http or https, "
                             "no path), as a browser sends it in its Origin header")


def with_cors(app, origins: tuple[str, ...]):
    """``app`` behind CORS for ``origins`` (none: ``app`` itself)."""
    if not origins:
        return app
    from starlette.middleware.cors import CORSMiddleware  # here: the CLI checks origins without starlette

    return CORSMiddleware(app, allow_origins=list(origins), allow_methods=list(ALLOWED_METHODS),
                          allow_headers=list(ALLOWED_HEADERS), expose_headers=list(EXPOSED_HEADERS),
                          allow_credentials=False, max_age=600)
