"""OpenAI-style error bodies: ``{"error": {"message", "type", "param", "code"}}``.

gRPC status -> HTTP status: INVALID_ARGUMENT / OUT_OF_RANGE / ALREADY_EXISTS 400,
UNAUTHENTICATED 401, NOT_FOUND 404, RESOURCE_EXHAUSTED 429, CANCELLED 499 (client closed),
UNAVAILABLE 503, DEADLINE_EXCEEDED 504, anything else 500; a refusal with a retry-after hint
(429) also carries ``Retry-After`` (whole seconds, at least 1) and ``retry-after-ms`` headers,
both of which the ``openai`` client honours. ``param`` is the request field
a router message names (``sampling.top_p ...`` -> ``top_p``; ``prompt: ...`` -> ``prompt``;
``messages[1].role ...`` -> ``messages[1].role``, as a body field is named; ``logit_bias[5] ...`` ->
``logit_bias``).
"""

from __future__ import annotations

import json
import math
import re

import grpc
from fastapi.responses import Response

from router.errors import RouterError

_HTTP = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.ALREADY_EXISTS: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401, grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 499: "invalid_request_error"}
_CODES = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found",
          405: "method_not_allowed", 413: "request_too_large", 429: "resource_exhausted", 499: "cancelled",
          500: "internal", 503: "unavailable", 504: "deadline_exceeded"}
_PARAM = re.compile(r"^(?:sampling\.)?([a-z_]+(?:\[\d+\]\.[a-z_]+)?)(?:\[[^\]]*\])?[ :.]")
_UNION_TAG = re.compile(r"^(?:str|int|float|bool|dict|list|none|[a-z-]+\[.*\])$")  # pydantic's member tags


def http_status(code: grpc.StatusCode) -> int:
    """The HTTP status of a gRPC status code (500 when unmapped)."""
    return _HTTP.get(code, 500)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """OpenAI's error body; ``code`` defaults to the status's gRPC-style name (``invalid_argument``,
    ``not_found``, ...), the same names router errors carry."""
    return {"error": {"message": message, "type": _TYPES.get(status, "server_error"), "param": param,
                      "code": code if code is not None else _CODES.get(status, str(status))}}


def request_field(loc: tuple) -> str | None:
    """The request field a pydantic error location names, as a client wrote it:
    ``("body", "messages", 0, "content")`` -> ``messages[0].content``; a union member's tag
    (``("body", "prompt", "list[int]", 0)``) ends the path, it is no field of the request; a map
    key is quoted (``logit_bias["5"]``)."""
    out = ""
    for part in loc[1:]:
        if isinstance(part, int):  # a list index
            out += f"[{part}]"
        elif _UNION_TAG.match(part):
            break
        elif part.isidentifier():
            out += f".{part}" if out else part
        else:  # a map key, such as a token id of logit_bias
            out += f"[{json.dumps(part)}]"
    return out or None


def validation_error_response(errors: list[dict], content_type: str | None) -> Response:
    """The 400 answer to a body FastAPI could not read into the request model: invalid JSON, a body
    that is no JSON object (naming the content type it came with), or the first field that does
    not fit, named as the client wrote it; a value that fits none of a field's forms lists them."""
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        return error_response(400, f"the request body is not valid JSON{where}: "
                                   f"{first.get('ctx', {}).get('error', first.get('msg'))}", code="invalid_json")
    field = request_field(loc)
    if field is None:
        if "json" not in (content_type or ""):
            return error_response(400, "the request body must be a JSON object sent with Content-Type: "
                                       f"application/json (got {content_type or 'no Content-Type'})")
        if first.get("type") == "missing":  # no body at all
            return error_response(400, "the request body is empty: send a JSON object")
        return error_response(400, f"the request body must be a JSON object, got {_json_kind(first.get('input'))}")
    same = list(dict.fromkeys(e.get("msg", "") for e in errors if request_field(tuple(e.get("loc", ()))) == field))
    message = same[0] if len(same) == 1 else "fits none of its forms (" + "; ".join(same) + ")"
    return error_response(400, f"{field}: {message}", param=field)


def _json_kind(value) -> str:
    """What JSON calls ``value``'s type, with its article (``"an array"``, ``"null"``)."""
    if value is None:
        return "null"
    for kind, name in ((bool, "a boolean"), (str, "a string"), (list, "an array"), (int, "a number"),
                       (float, "a number")):
        if isinstance(value, kind):
            return name
    return f"a {type(value).__name__}"


UNREADABLE_BODY = "There was an error parsing the body"
"""FastAPI's ``HTTPException`` detail for a body ``json.loads`` raised on with anything but a
``JSONDecodeError`` (invalid UTF-8, an integer past Python's digit limit, nesting past the
recursion limit): :func:`unreadable_body_response` says which."""


def unreadable_body_response(body: bytes) -> Response:
    """The 400 ``invalid_json`` answer to a body FastAPI could not parse for another reason than a
    JSON syntax error, naming the reason (parsed again here: an error path, bounded by the
    request size limit)."""
    try:
        json.loads(body)
        reason = "it could not be parsed"
    except UnicodeDecodeError as e:
        reason = f"it is not valid UTF-8 (byte {e.start})"
    except RecursionError:
        reason = "it is nested too deeply"
    except ValueError as e:  # e.g. "Exceeds the limit (4300 digits) for integer string conversion"
        reason = str(e).split(";")[0]
    return error_response(400, f"the request body is not valid JSON: {reason}", code="invalid_json")


def json_response(body: dict, status: int) -> Response:
    """``body`` as JSON with non-ASCII escaped, so a string echoed from a request that
    UTF-8 cannot encode (a lone surrogate from a JSON escape) still renders."""
    return Response(json.dumps(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str, param: str | None = None, code: str | None = None) -> Response:
    """A JSON error response in OpenAI's shape."""
    return json_response(error_body(status, message, param, code), status)


def unknown_model(name: str, served: str) -> Response:
    """The 404 (OpenAI's ``model_not_found``) to a request naming model ``name`` when ``served`` is served."""
    return error_response(404, f"model {name!r} does not exist; this server serves {served!r}",
                          param="model", code="model_not_found")


def request_aliases(body) -> dict[str, str]:
    """The router's parameter names a chat request sent under OpenAI's other names: ``max_tokens``
    as ``max_completion_tokens``, the number of top ``logprobs`` as ``top_logprobs``, a constraint
    as OpenAI's ``response_format`` or, for a named or required tool choice, the ``tools``."""
    aliases = {}
    if getattr(body, "max_completion_tokens", None) is not None:
        aliases["max_tokens"] = "max_completion_tokens"
    if getattr(body, "top_logprobs", None) is not None:
        aliases["logprobs"] = "top_logprobs"
    if (getattr(body, "model_extra", None) or {}).get("response_format") not in (None, {"type": "text"}):
        aliases["structured_outputs"] = "response_format"
    if getattr(body, "tools", None) and getattr(body, "tool_choice", None) not in (None, "none", "auto"):
        aliases["structured_outputs"] = "tools"  # a named or required choice's constraint: the tools' schemas
    return aliases


def named_param(message: str) -> str | None:
    """The request field a validation message names first (``sampling.`` left out), if any."""
    match = _PARAM.match(message)
    return match.group(1) if match else None


_SCHEMA_FIELDS = {"response_format": "response_format.json_schema.schema",
                  "tools": "tools (the schema the tool choice constrains the answer to)"}


def router_error_response(e: RouterError, body_only: bool = False, aliases: dict[str, str] | None = None):
    """The response (or with ``body_only`` the body) of a :class:`RouterError`; ``param`` is the field
    its message names, under the name the request used (``aliases``: :func:`request_aliases`), and a
    sampling field's message names it so too (``sampling.logprobs must be ...`` of a chat request
    with ``top_logprobs`` reads ``top_logprobs must be ...``)."""
    status = http_status(e.code)
    param = named_param(e.message) if status == 400 else None
    field = (aliases or {}).get(param, param)
    message = e.message
    if param is not None and message.startswith(f"sampling.{param}"):  # named as the body wrote it
        message = field + message[len(f"sampling.{param}"):]
    if field in _SCHEMA_FIELDS and message.startswith("structured_outputs.json"):  # the worker's name of it
        message = _SCHEMA_FIELDS[field] + message[len("structured_outputs.json"):]
    body = error_body(status, message, param=field, code=e.code.name.lower())
    if body_only:
        return body
    response = json_response(body, status)
    if e.retry_after_ms is not None:
        response.headers["Retry-After"] = str(max(1, math.ceil(e.retry_after_ms / 1000)))
        response.headers["retry-after-ms"] = str(e.retry_after_ms)
    return response
