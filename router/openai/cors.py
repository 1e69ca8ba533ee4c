"""Cross-origin requests (CORS) on the router's HTTP port, for browser clients (chat UIs served
from another origin), as vLLM's ``--allowed-origins`` allows them.

Off by default (no ``Access-Control-*`` header is sent, so browsers keep other origins' pages
from reading answers); ``pdcluster up --allowed-origins`` lists the origins allowed, or ``*`` for any.
Starlette's ``CORSMiddleware`` answers preflights (``OPTIONS`` with ``Access-Control-Request-Method``)
itself, before the API-key check: a browser sends no credentials on a preflight. The answers the
browser may read then carry the request-id and retry-after headers too. Any request header is allowed
(the ``openai`` SDK in a browser sends its ``x-stainless-*`` ones), as vLLM's default; credentials
(cookies) never are: clients authenticate with the ``Authorization`` header.
"""

from __future__ import annotations

from urllib.parse import urlsplit

ALLOWED_METHODS = ("GET", "POST", "HEAD", "OPTIONS")
EXPOSED_HEADERS = ("x-request-id", "retry-after", "retry-after-ms")


def check_origins(origins: tuple[str, ...]) -> None:
    """Raises ValueError unless every entry of ``origins`` is ``*`` or an origin exactly as a browser
    writes it in its ``Origin`` header (they are compared as strings): ``scheme://host[:port]``, scheme
    http or https, lower case, no user, path, query or wildcard, a port only when not the scheme's default."""
    for origin in origins:
        if origin == "*":
            continue
        parts = urlsplit(origin)
        try:
            port = parts.port
        except ValueError:
            port = -1
        host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname  # IPv6
        canonical = f"{parts.scheme}://{host}" + (f":{port}" if port is not None else "")
        if parts.scheme not in ("http", "https") or not parts.hostname or "*" in origin or origin != canonical \
                or port == {"http": 80, "https": 443}[parts.scheme]:
            raise ValueError(f"allowed origin {origin!r} must be '*' or scheme://host[:port] as a browser writes it "
                             "in its Origin header (http or https, lower case, no user, path or wildcard, no default "
                             "port): they are compared as strings")


def with_cors(app, origins: tuple[str, ...]):
    """``app`` behind CORS for ``origins`` (none: ``app`` itself)."""
    if not origins:
        return app
    from starlette.middleware.cors import CORSMiddleware  # here: the CLI checks origins without starlette

    return CORSMiddleware(app, allow_origins=list(origins), allow_methods=list(ALLOWED_METHODS),
                          allow_headers=["*"], expose_headers=list(EXPOSED_HEADERS),  # any header, as vLLM's
                          allow_credentials=False, max_age=600)
