"""The ``Router`` gRPC service: the gRPC front door over :mod:`router.core`'s request path.

``Generate`` streams the core's responses; a :class:`router.errors.RouterError` becomes the
call's status (code and message unchanged, a retry-after hint as ``retry-after-ms`` trailing
metadata); a client that cancels or disconnects cancels the request on both workers.
:func:`add_router_service` registers the service with deserializers that never fail
(:mod:`router.decoding`): a request protobuf cannot parse (e.g. invalid UTF-8 in a ``string``
field) is refused with INVALID_ARGUMENT naming the field, counted and logged as the router's own refusals
are. A refused ``Generate`` carries its request id (the client's, or the one minted for it) as
``x-request-id`` trailing metadata. A request without a ``request_id`` takes the one its call's
``x-request-id`` metadata gives, if any (checked as any client id). A chat answer's tool calls and
reasoning are read out of its text as on the HTTP door (:mod:`router.grpc_answers`).
"""

from __future__ import annotations

import hashlib
import logging

import grpc
from google.protobuf import message_factory

from common.grpc_metadata import AUTHORIZATION, bearer_token, metadata_value
from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.answer import AnswerReading
from router.core import RequestRouter
from router.decoding import Unparsable, parse_or_refusal
from router.errors import RouterError
from router.grpc_answers import GrpcReading, forced_choice_error, read_responses
from router.validation import InvalidRequest, request_id_problem
from serving.logs import REQUEST_ID_METADATA
from serving.rpc import RETRY_AFTER_METADATA

log = logging.getLogger(__name__)


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Front door. Handlers block only on their own request's calls.

    Args:
        core: the request path shared with the HTTP front door.
        model_info: answer of ``GetModelInfo``.
        reading: the router's tool call and reasoning parsers (None: answers are text as is).
    """

    def __init__(self, core: RequestRouter, model_info: router_pb2.ModelInfo,
                 reading: GrpcReading | None = None) -> None:
        self.core = core
        self.model_info = model_info
        self.reading = reading

    def Generate(self, request, context):
        if not request.request_id:  # a tracing client's id in metadata names the request, as X-Request-Id does
            request.request_id = metadata_value(context.invocation_metadata(), REQUEST_ID_METADATA) or ""
        reading = None
        try:
            reading = self._reading(request)
            active = self.core.start(request, owner_of(context))
            if not context.add_callback(active.cancel):  # client cancelled or disconnected
                log.info("request %s cancelled by the client before it was placed", active.request_id)
                # a terminated call runs no callback it is given afterwards; counted, as every request is
                active.discard(RouterError(grpc.StatusCode.CANCELLED, "client cancelled"))
                return
            responses = active.responses()
            yield from responses if reading is None else read_responses(responses, reading)
        except RouterError as error:
            e = forced_choice_error(error, reading)
            rid = request.request_id  # echoed only when it can be metadata (an invalid one is what was refused)
            trailing = [(REQUEST_ID_METADATA, rid)] if rid and request_id_problem(rid) is None else []
            if e.retry_after_ms is not None:
                trailing.append((RETRY_AFTER_METADATA, str(e.retry_after_ms)))
            context.set_trailing_metadata(tuple(trailing))
            context.abort(e.code, e.message)

    def _reading(self, request: router_pb2.GenerateRequest) -> AnswerReading | None:
        """How a chat answer's tool calls and reasoning are read (:mod:`router.grpc_answers`).

        Raises:
            RouterError: INVALID_ARGUMENT (counted and logged as the core's own refusals); INTERNAL for
                any other exception (logged with its traceback).
        """
        try:
            return None if self.reading is None else self.reading.prepare(request)
        except InvalidRequest as e:
            raise self.core.refuse_invalid(request, str(e)) from None
        except Exception as e:  # noqa: BLE001 - a bug here answers INTERNAL, as the core's own preparation does
            log.exception("request %s: reading its tool choice failed", request.request_id)
            raise RouterError(grpc.StatusCode.INTERNAL, f"internal error while preparing the request "
                              f"({type(e).__name__}); the router's log has the details") from None

    def refuse_unparsable(self, method: str, request: Unparsable, context) -> None:
        """Refuse a request gRPC could not parse: INVALID_ARGUMENT naming the field; a ``Generate``
        one is counted and logged as a refused request, with a minted id."""
        if method == "Generate":
            context.set_trailing_metadata(((REQUEST_ID_METADATA, self.core.refuse_unparsable(request.message())),))
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, request.message())

    def Abort(self, request, context):
        return router_pb2.AbortResponse(found=self.core.abort(request.request_id, owner_of(context)))

    def GetModelInfo(self, request, context):
        return self.model_info


def owner_of(context: grpc.ServicerContext) -> str:
    """Who a call comes from, for :meth:`router.core.RequestRouter.abort`: a digest of its API key
    (the key itself is kept nowhere new), or "" without one (a cluster without API keys: anyone)."""
    key = bearer_token(metadata_value(context.invocation_metadata(), AUTHORIZATION))
    return hashlib.sha256(key.encode()).hexdigest()[:32] if key else ""


def add_router_service(servicer: RouterServicer, server: grpc.Server) -> None:
    """Register every method of the ``pdcluster.v1.Router`` service (read from its descriptor,
    as the generated ``add_RouterServicer_to_server`` does) on ``server``, each with a
    deserializer that turns an unparsable request into an INVALID_ARGUMENT refusal."""
    service = router_pb2.DESCRIPTOR.services_by_name["Router"]
    handlers = {}
    for method in service.methods:
        request_cls = message_factory.GetMessageClass(method.input_type)
        response_cls = message_factory.GetMessageClass(method.output_type)
        make = grpc.unary_stream_rpc_method_handler if method.server_streaming else grpc.unary_unary_rpc_method_handler
        handlers[method.name] = make(_refusing(servicer, method.name, method.server_streaming),
                                     request_deserializer=parse_or_refusal(request_cls),
                                     response_serializer=response_cls.SerializeToString)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    server.add_registered_method_handlers(service.full_name, handlers)


def _refusing(servicer: RouterServicer, method: str, streaming: bool):
    """The servicer's handler of ``method``, refusing an :class:`Unparsable` request first
    (:meth:`RouterServicer.refuse_unparsable`)."""
    handler = getattr(servicer, method)
    if streaming:
        def stream(request, context):
            if isinstance(request, Unparsable):
                servicer.refuse_unparsable(method, request, context)
            yield from handler(request, context)
        return stream

    def unary(request, context):
        if isinstance(request, Unparsable):
            servicer.refuse_unparsable(method, request, context)
        return handler(request, context)
    return unary
