"""The ``Router`` gRPC service: the gRPC front door over :mod:`router.core`'s request path.

``Generate`` streams the core's responses; a :class:`router.core.RouterError` becomes the
call's status (code and message unchanged); a client that cancels or disconnects cancels
the request on both workers.
"""

from __future__ import annotations

from pdcluster.v1 import router_pb2, router_pb2_grpc
from router.core import RequestRouter, RouterError


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Front door. Handlers block only on their own request's calls.

    Args:
        core: the request path shared with the HTTP front door.
        model_info: answer of ``GetModelInfo``.
    """

    def __init__(self, core: RequestRouter, model_info: router_pb2.ModelInfo) -> None:
        self.core = core
        self.model_info = model_info

    def Generate(self, request, context):
        try:
            active = self.core.start(request)
            context.add_callback(active.cancel)  # client cancelled or disconnected
            yield from active.responses()
        except RouterError as e:
            context.abort(e.code, e.message)

    def Abort(self, request, context):
        return router_pb2.AbortResponse(found=self.core.abort(request.request_id))

    def GetModelInfo(self, request, context):
        return self.model_info
