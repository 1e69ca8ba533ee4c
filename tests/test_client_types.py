"""The Python client's result folding: vLLM's ``stop_reason`` (the stop string or stop token id on the
last ``GenerateResponse``) reaches :class:`pdcluster.client.GenerationResult`."""

from __future__ import annotations

import json

import pytest

from pdcluster.client_types import accumulate, build_request
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


def test_chat_options_set_the_message_list():
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hel"}]
    req = build_request(chat, chat_options={"add_generation_prompt": False, "continue_final_message": True,
                                            "chat_template_kwargs": {"enable_thinking": False}})
    assert not req.messages.add_generation_prompt and req.messages.HasField("add_generation_prompt")
    assert req.messages.continue_final_message and json.loads(req.messages.chat_template_kwargs) == {
        "enable_thinking": False}
    assert not build_request(chat).messages.HasField("add_generation_prompt")  # unset: the server's true
    for options in ({"continue_final_message": True}, {}):  # an empty dict too (verification-helper finding)
        with pytest.raises(ValueError, match="need a prompt of chat messages"):
            build_request("text", chat_options=options)
    with pytest.raises(ValueError, match="unknown option 'functions'"):
        build_request(chat, chat_options={"functions": []})
    tools = [{"type": "function", "function": {"name": "f"}}]
    calls = [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    req = build_request(chat + calls, chat_options={"tools": tools})
    assert json.loads(req.messages.tools) == tools
    call = req.messages.messages[-2].tool_calls[0]
    assert (call.id, call.name, json.loads(call.arguments)) == ("c1", "f", {"x": 1})
    assert req.messages.messages[-2].content == "" and req.messages.messages[-1].tool_call_id == "c1"
    named = {"type": "function", "function": {"name": "f"}}
    req = build_request(chat, chat_options={"tools": tools, "tool_choice": named, "parallel_tool_calls": False,
                                            "include_reasoning": False})
    assert json.loads(req.messages.tool_choice) == named and req.messages.HasField("parallel_tool_calls")
    assert not req.messages.parallel_tool_calls and not req.messages.include_reasoning
    assert build_request(chat, chat_options={"tool_choice": "required"}).messages.tool_choice == "required"
