"""The Python client's result folding: vLLM's ``stop_reason`` (the stop string or stop token id on the
last ``GenerateResponse``) reaches :class:`pdcluster.client.GenerationResult`."""

from __future__ import annotations

from pdcluster.client_types import accumulate
from pdcluster.v1 import common_pb2, router_pb2

STOP = common_pb2.FINISH_REASON_STOP


def test_stop_reason_is_kept_from_the_last_message():
    running = router_pb2.GenerateResponse(request_id="r", token_ids=[5], text="a")
    by_string = accumulate([running, router_pb2.GenerateResponse(token_ids=[6], finish_reason=STOP, stop_string="\n")])
    assert (by_string.finish_reason, by_string.stop_reason, by_string.text) == ("STOP", "\n", "a")
    by_token = accumulate([router_pb2.GenerateResponse(token_ids=[7], finish_reason=STOP, stop_token_id=7)])
    assert by_token.stop_reason == 7
    eos = accumulate([router_pb2.GenerateResponse(token_ids=[2], finish_reason=STOP)])
    assert eos.stop_reason is None
