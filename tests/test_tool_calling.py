"""Tool calling (OpenAI's ``tools`` / ``tool_choice``): the parsers, the request checks, the chat template's
view of tools and tool calls, and the whole path on a real cluster (router with ``--tool-call-parser hermes``)."""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import openai
import pytest

from common.tokenizer import load_tokenizer
from pdcluster.cli import build_parser, main
from pdcluster.client import accumulate
from pdcluster.v1 import common_pb2, router_pb2
from router.chat import ChatOptions
from router.config import RouterConfig
from router.limits import Limits
from router.openai.chat import chat_prompt, chat_requests
from router.openai.protocol import ChatCompletionRequest
from router.openai.requests import OpenAIRequestError
from router.openai.responses import ResponseBuilder
from router.tool_choice import MAX_TOOLS, required_schema, tool_choice
from router.validation import InvalidRequest, RequestValidator

from cluster_utils import (assert_greedy_matches, assert_no_leak, grpc, hf_constrained_greedy, render_chat, router_client,
                           running_cluster)

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                   "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}


def _chat(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **extra})


BAD_TOOLS = [
    (dict(tool_choice="auto"), "tool_choice needs tools", "tool_choice"),
    (dict(tools=[{"type": "retrieval"}]), 'tools[0] must be {"type": "function"', "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "a b"}}]), "tools[0].function.name must be", "tools"),
    (dict(tools=[WEATHER, WEATHER]), "tools[1].function.name 'get_weather' is given twice", "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": []}}]), "JSON schema of an object", "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]),
     "tools[0].function.parameters must be the JSON schema of an object", "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"$defs": [1]}}}]),
     "parameters.$defs must be an object", "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"properties": {"a": {"$ref": "#"}}}}}]),
     "$ref '#' is not served", "tools"),
    (dict(tools=[{"type": "function", "function": {"name": f, "parameters": {"$defs": {"x": {"type": t}}}}}
                 for f, t in (("f", "string"), ("g", "integer"))], tool_choice="required"),
     "tools define $defs.x twice, differently", "tools"),
    (dict(tools=[{"type": "function", "function": {"name": "f", "description": "\ud800"}}], tool_choice="none"),
     "tools is not valid Unicode", "tools"),
    (dict(chat_template_kwargs={"x": "\ud800"}), "chat_template_kwargs is not valid Unicode", "chat_template_kwargs"),
    (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"\ud800": 1}}}),
     "not valid Unicode", "response_format"),
    (dict(tools=[WEATHER] + [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS)]),
     f"at most {MAX_TOOLS}", "tools"),
    (dict(tools=[WEATHER], tool_choice="sometimes"), "tool_choice must be one of", "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "not in tools",
     "tool_choice"),
    (dict(tools=[WEATHER], tool_choice={"type": "function"}), "tool_choice must name a function", "tool_choice"),
    (dict(tools=[WEATHER]), 'tool_choice "auto" needs a tool call parser', "tool_choice"),
    (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}),
     "give no response_format or structured_outputs with it", "tool_choice"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "1", "type": "function", "function": {"name": 3}}]}]),
     "messages[0].tool_calls[0]: id, function.name and function.arguments", "messages[0].tool_calls"),
    (dict(messages=[{"role": "user"}]), "a message of role 'user' needs content", "messages[0].content"),
]


@pytest.mark.parametrize("extra,message,param", BAD_TOOLS)
def test_malformed_tools_are_refused_naming_the_field(extra, message, param):
    with pytest.raises(OpenAIRequestError) as e:
        chat_requests(_chat(**extra))
    assert message in e.value.message and e.value.param == param, (e.value.message, e.value.param)


def test_auto_keeps_the_first_call_without_parallel_calls_and_schema_errors_name_the_tools():
    """parallel_tool_calls false: an auto answer's later calls are dropped (vLLM's); a forced choice's constraint that
    the router or a worker refuses is reported on tools, not on the structured_outputs the client never sent."""
    from grpc import StatusCode

    from router.errors import RouterError
    from router.openai.errors import request_aliases, router_error_response
    two = '<tool_call>{"name": "get_weather", "arguments": {"city": "A"}}</tool_call>' \
          '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    for parallel, names in [(True, ["get_weather", "get_time"]), (False, ["get_weather"])]:
        _, [sub] = chat_requests(_chat(tools=[WEATHER, TIME], parallel_tool_calls=parallel), tool_parser="hermes")
        whole = ResponseBuilder("chat", "x", "m", None, False, reading=sub.reading).whole(
            {0: [router_pb2.GenerateResponse(text=two, finish_reason=common_pb2.FINISH_REASON_STOP)]}, 0, 1)["choices"][0]
        assert [c["function"]["name"] for c in whole["message"]["tool_calls"]] == names
    body = _chat(tools=[WEATHER], tool_choice="required")
    error = RouterError(StatusCode.INVALID_ARGUMENT, "structured_outputs.json does not compile: bad type")
    answer = json.loads(router_error_response(error, aliases=request_aliases(body)).body)["error"]
    assert answer["param"] == "tools" and answer["message"].startswith("tools (the schema"), answer


def test_each_tool_choice_constrains_and_reads_the_answer():
    """none and auto leave the answer free; a named choice constrains it to the function's parameters, required
    to vLLM's array of calls (the tools' $defs at the top, so references resolve)."""
    _, [sub] = chat_requests(_chat(tools=[WEATHER], tool_choice="none"))
    assert not sub.request.HasField("structured_outputs") and sub.tools.new_parser() is None
    _, [sub] = chat_requests(_chat(tools=[WEATHER, TIME]), tool_parser="hermes")
    assert not sub.request.HasField("structured_outputs") and sub.tools.choice == "auto"
    assert json.loads(sub.request.messages.tools) == [WEATHER, TIME]
    _, [sub] = chat_requests(_chat(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    assert json.loads(sub.request.structured_outputs.json) == WEATHER["function"]["parameters"]
    _, [sub] = chat_requests(_chat(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False))
    schema = json.loads(sub.request.structured_outputs.json)
    assert schema == required_schema([WEATHER, TIME], parallel=False)
    assert schema["maxItems"] == 1 and schema["$defs"] == {"zone": {"type": "string", "enum": ["UTC", "CET"]}}
    assert [b["properties"]["name"]["enum"] for b in schema["items"]["anyOf"]] == [["get_weather"], ["get_time"]]
    assert "$defs" not in schema["items"]["anyOf"][1]["properties"]["parameters"]


def test_whole_and_streamed_answers_carry_the_same_calls():
    """The response builder: a required answer becomes tool_calls with finish_reason tool_calls and no content,
    streamed as one delta per call; a named one ends with stop (OpenAI's); auto keeps the text around calls."""
    stop = common_pb2.FINISH_REASON_STOP
    for choice, text, finish in [("required", '[{"name": "get_weather", "parameters": {"city": "Oslo"}}]', "tool_calls"),
                                 ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo"}', "stop"),
                                 ("auto", 'Hm.<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}'
                                          '</tool_call>', "tool_calls")]:
        _, [sub] = chat_requests(_chat(tools=[WEATHER], tool_choice=choice), tool_parser="hermes")
        builder = ResponseBuilder("chat", "chatcmpl-x", "m", None, False, reading=sub.reading)
        msgs = [router_pb2.GenerateResponse(text=text[:5]), router_pb2.GenerateResponse(text=text[5:], finish_reason=stop)]
        whole = builder.whole({0: msgs}, 0, 1)["choices"][0]
        call = whole["message"]["tool_calls"][0]
        assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}, whole
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
        assert whole["finish_reason"] == finish
        assert whole["message"]["content"] == ("Hm." if choice == "auto" else None)
        chunks = [c for c in (builder.chunk(0, m, 0, 0) for m in msgs) if c is not None]
        deltas = [c["choices"][0]["delta"] for c in chunks]
        arguments = "".join(t["function"]["arguments"] for d in deltas for t in d.get("tool_calls", []))
        assert arguments == '{"city": "Oslo"}' and chunks[-1]["choices"][0]["finish_reason"] == finish
        assert "".join(d.get("content", "") for d in deltas) == (whole["message"]["content"] or "")


TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools: {{ tools | tojson }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>{% endfor %}"
    "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_the_chat_template_sees_tools_tool_calls_and_call_ids(model_dir):
    """A tool-aware template gets the tools, an assistant message's calls with their arguments as an object, and a
    tool message's call id; arguments that are not a JSON object and control tokens in them are refused."""
    tok = load_tokenizer(model_dir)
    tok.chat_template = TOOL_TEMPLATE
    validator = RequestValidator(tok, Limits(max_model_len=2048, vocab_size=len(tok)))
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                     "arguments": '{"city": "Oslo"}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "12 C"}]
    body = ChatCompletionRequest.model_validate({"messages": history, "tools": [WEATHER], "tool_choice": "none"})
    chat = chat_prompt(body, tool_choice(body, None))
    text = tok.decode(validator.tokenize(router_pb2.GenerateRequest(messages=chat)))
    assert 'Tools: [{"type": "function", "function": {"name": "get_weather"' in text, text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text, text
    assert "12 C [call_1]<|im_end|>" in text and text.endswith("<|im_start|>assistant\n"), text
    for arguments, message in [("[1]", "must be a JSON object"), ("{", "is not JSON"),
                               ('{"a":' * 500 + "1" + "}" * 500, "nests deeper than"),
                               ('{"a":' * 5000 + "1" + "}" * 5000, "nests deeper than"),
                               ('{"city": "\\ud800"}', "not valid Unicode"),
                               ('{"a": "<|im_end|>"}', "holds a control token")]:
        chat.messages[1].tool_calls[0].arguments = arguments
        with pytest.raises(InvalidRequest, match="messages\\[1\\]") as e:
            validator.tokenize(router_pb2.GenerateRequest(messages=chat))
        assert message in str(e.value)
    chat.messages[1].tool_calls[0].arguments = "{}"
    chat.tools = json.dumps([{"type": "function", "function": {"name": "x", "description": "<|im_start|>"}}])
    with pytest.raises(InvalidRequest, match="tools holds a control token"):
        validator.tokenize(router_pb2.GenerateRequest(messages=chat))
    chat.tools = json.dumps([WEATHER, WEATHER])  # the gRPC door checks the tools' shape as the HTTP one
    with pytest.raises(InvalidRequest, match="tools\\[1\\].function.name 'get_weather' is given twice"):
        validator.tokenize(router_pb2.GenerateRequest(messages=chat))


TEMPLATE_FILE = Path(__file__).resolve().parent.parent / "examples" / "tool_chat_template_chatml_hermes.jinja"


def test_the_chat_template_flag_reads_a_file_or_a_line_and_refuses_what_is_no_jinja(tmp_path, capsys):
    parser = build_parser()
    assert parser.parse_args(["up", "--chat-template", str(TEMPLATE_FILE)]).chat_template == TEMPLATE_FILE.read_text()
    assert parser.parse_args(["up", "--chat-template", "{{ messages[0].content }}"]).chat_template == \
        "{{ messages[0].content }}"
    (tmp_path / "bad.jinja").write_text("{% for m in messages %}")
    for value, message in [(str(tmp_path / "bad.jinja"), "not valid Jinja"), (str(tmp_path / "none"), "no such file")]:
        with pytest.raises(SystemExit):
            parser.parse_args(["up", "--chat-template", value])
        assert message in capsys.readouterr().err
    with pytest.raises(ValueError, match="not valid Jinja"):
        RouterConfig(model="m", model_path="p", redis_url="redis://x", chat_template="{% if %}")
    with pytest.raises(ValueError, match="unknown tool call parser 'nope'; registered: hermes, llama3_json, mistral, pythonic"):
        RouterConfig(model="m", model_path="p", redis_url="redis://x", tool_call_parser="nope")


def test_the_example_template_renders_tools_calls_and_results_and_plain_chats_as_the_models_own(model_dir):
    tok = load_tokenizer(model_dir)
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    own = render_chat(tok, chat)
    tok.chat_template = TEMPLATE_FILE.read_text()
    assert render_chat(tok, chat) == own
    history = [{"role": "user", "content": "Weather in Oslo?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "tool_call_id": "c", "content": "12 C"}]
    text = tok.decode(render_chat(tok, history, ChatOptions(tools=[WEATHER])))
    assert "<tools>\n" + json.dumps(WEATHER) + "\n</tools>" in text, text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>' in text
    assert text.endswith("<tool_response>\n12 C\n</tool_response><|im_end|>\n<|im_start|>assistant\n"), text


@pytest.fixture(scope="module")
def state(tmp_path_factory):
    with running_cluster(tmp_path_factory.mktemp("state"), "--max-model-len", "1024", "--block-size", "16",
                         "--num-kv-blocks", "96", "--heartbeat-s", "0.5", "--tool-call-parser", "hermes",
                         "--reasoning-parser", "qwen3", "--chat-template", str(TEMPLATE_FILE)) as state:
        yield state


def _ids(choice) -> list[int]:
    return [int(t.token.removeprefix("token_id:")) for t in choice.logprobs.content]


def _streamed(oai, **kw) -> tuple[str, dict[int, dict], str]:
    """A streamed answer's content, its calls (index -> id, name, arguments joined) and its finish_reason."""
    content, calls, finish = "", {}, None
    for chunk in oai.chat.completions.create(stream=True, **kw):
        choice = chunk.choices[0]
        content += choice.delta.content or ""
        for t in choice.delta.tool_calls or []:
            call = calls.setdefault(t.index, {"id": t.id, "name": t.function.name, "arguments": ""})
            assert t.id is None or call["id"] == t.id
            call["arguments"] += t.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, calls, finish


def test_tool_calls_end_to_end(state, tokenizer, hf_model, model_config, model_dir):
    """Every tool choice over HTTP through prefill and decode workers: a named and a required choice are greedy
    token-exact with HF under xgrammar's mask of their schemas and come back as tool_calls (streamed: the same
    calls); auto reads a Hermes call written by the model (here forced by a regex) and leaves plain answers as
    content; a history with calls and tool results is served; /tokenize takes tools; nothing leaks."""
    import xgrammar as xgr
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=model_config.vocab_size,
                                              stop_token_ids=list(model_config.eos_token_ids))
    compiler = xgr.GrammarCompiler(info, max_threads=1)
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    tok = load_tokenizer(model_dir)
    tok.chat_template = TEMPLATE_FILE.read_text()  # the cluster's --chat-template: it writes the tools
    prompt = render_chat(tok, messages, ChatOptions(tools=[WEATHER, TIME]))
    named = {"type": "function", "function": {"name": "get_weather"}}
    base = dict(model="", messages=messages, tools=[WEATHER, TIME], temperature=0, max_tokens=64)
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        for choice, schema, finish in [(named, WEATHER["function"]["parameters"], "stop"),
                                       ("required", required_schema([WEATHER, TIME], parallel=False), "tool_calls")]:
            ref, gaps = hf_constrained_greedy(hf_model, tokenizer, model_config, prompt,
                                              compiler.compile_json_schema(json.dumps(schema)), 64)
            base["parallel_tool_calls"] = choice == named  # required: one call (whole within max_tokens)
            got = oai.chat.completions.create(tool_choice=choice, logprobs=True,
                                              extra_body={"return_tokens_as_token_ids": True}, **base).choices[0]
            assert_greedy_matches(_ids(got), ref, gaps, str(choice))
            assert got.message.content is None and got.finish_reason == finish, got
            text = tokenizer.decode(ref, skip_special_tokens=True)
            calls = [(c.function.name, json.loads(c.function.arguments)) for c in got.message.tool_calls]
            if choice == "required":
                assert calls == [(c["name"], c["parameters"]) for c in json.loads(text)], (calls, text)
            else:
                assert calls == [("get_weather", json.loads(text))] and "city" in calls[0][1], (calls, text)
            content, streamed, end = _streamed(oai, tool_choice=choice, **base)
            assert content == "" and end == finish
            assert [(c["name"], json.loads(c["arguments"])) for c in streamed.values()] == calls
        del base["parallel_tool_calls"]
        forced = r'<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,12}"\}\}\n</tool_call>'
        base["max_tokens"] = 80
        got = oai.chat.completions.create(extra_body={"structured_outputs": {"regex": forced}}, **base).choices[0]
        assert got.finish_reason == "tool_calls" and got.message.content is None, got
        [call] = got.message.tool_calls
        assert call.function.name == "get_weather" and set(json.loads(call.function.arguments)) == {"city"}
        content, streamed, end = _streamed(oai, extra_body={"structured_outputs": {"regex": forced}}, **base)
        assert content == "" and end == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == [("get_weather", call.function.arguments)]
        plain = oai.chat.completions.create(**{**base, "max_tokens": 12}).choices[0]
        free = oai.chat.completions.create(**{**base, "max_tokens": 12, "tool_choice": "none"}).choices[0]
        assert plain.message.content == free.message.content and not plain.message.tool_calls, plain
        history = messages + [
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
            {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"}]
        after = oai.chat.completions.create(**{**base, "messages": history, "tool_choice": "none", "max_tokens": 8})
        assert after.choices[0].message.content and after.usage.prompt_tokens > len(prompt), after
    with urllib.request.urlopen(urllib.request.Request(
            f"http://{state['router_http_address']}/tokenize", method="POST", headers={"Content-Type": "application/json"},
            data=json.dumps({"messages": messages, "tools": [WEATHER, TIME]}).encode())) as r:
        assert json.loads(r.read())["tokens"] == prompt
    assert_no_leak(state)


def test_reasoning_end_to_end(state):
    """--reasoning-parser qwen3: an answer that thinks first (forced here by a regex: this model does not think)
    comes back as reasoning_content and content, streamed alike; include_reasoning false drops it; a call after
    the thinking is read as a call; an answer without thinking is content with reasoning_content null; a structured
    output holds for the answer (qwen3: from its first token when it does not open with <think>, whatever the prompt
    mentions)."""
    think = r"<think>[a-z ]{1,24}</think>\n\nThe answer is [0-9]\."
    base = dict(model="", messages=[{"role": "user", "content": "What is 2 + 2?"}], temperature=0, max_tokens=48)
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai:
        got = oai.chat.completions.create(extra_body={"structured_outputs": {"regex": think}}, **base).choices[0]
        reasoning = got.message.model_extra["reasoning_content"]
        assert reasoning and "<think>" not in reasoning and got.message.content.startswith("\n\nThe answer is "), got
        streamed = {"reasoning_content": "", "content": ""}
        for chunk in oai.chat.completions.create(stream=True, extra_body={"structured_outputs": {"regex": think}},
                                                 **base):
            delta = chunk.choices[0].delta
            streamed["reasoning_content"] += (delta.model_extra or {}).get("reasoning_content") or ""
            streamed["content"] += delta.content or ""
        assert streamed == {"reasoning_content": reasoning, "content": got.message.content}
        quiet = oai.chat.completions.create(extra_body={"structured_outputs": {"regex": think},
                                                        "include_reasoning": False}, **base).choices[0]
        assert quiet.message.model_extra["reasoning_content"] is None and quiet.message.content == got.message.content
        plain = oai.chat.completions.create(**{**base, "max_tokens": 6}).choices[0]
        assert plain.message.content and plain.message.model_extra["reasoning_content"] is None
        call = r'<think>[a-z ]{1,16}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
        got = oai.chat.completions.create(tools=[WEATHER], extra_body={"structured_outputs": {"regex": call}},
                                          **{**base, "max_tokens": 80}).choices[0]
        assert got.finish_reason == "tool_calls" and got.message.model_extra["reasoning_content"], got
        assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == \
            [("get_weather", '{"city": "Oslo"}')] and got.message.content is None
        mention = {**base, "messages": [{"role": "user", "content": "What does the <think> tag do?"}], "max_tokens": 8}
        got = oai.chat.completions.create(extra_body={"structured_outputs": {"regex": "[0-9]{64}"}}, **mention)
        assert got.choices[0].message.content.isdigit(), got  # qwen3: an answer without <think> is constrained
    assert_no_leak(state)


def test_tool_calls_and_reasoning_over_grpc(state, capsys):
    """The gRPC door reads calls and reasoning as the HTTP door does: a named call equals HTTP's; a Hermes call
    the model writes after its thinking (forced by a regex) is a call with FINISH_REASON_TOOL_CALLS, streamed
    alike; a malformed choice is INVALID_ARGUMENT naming the field; `pdcluster generate --chat` prints the
    thinking to stderr and the answer to stdout, streamed or not."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = r'<think>[a-z ]{1,16}</think>\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "Oslo"\}\}\n</tool_call>'
    with openai.OpenAI(base_url=f"http://{state['router_http_address']}/v1", api_key="unused", max_retries=0,
                       timeout=300) as oai, router_client(state) as client:
        http = oai.chat.completions.create(model="", messages=messages, tools=[WEATHER, TIME], tool_choice=named,
                                           temperature=0, max_tokens=64).choices[0]
        got = got_named = client.generate(messages, chat_options={"tools": [WEATHER, TIME], "tool_choice": named},
                                          temperature=0, max_tokens=64)
        assert (got.text, got.finish_reason) == ("", "STOP")
        assert [(c.name, c.arguments) for c in got.tool_calls] == \
            [(c.function.name, c.function.arguments) for c in http.message.tool_calls]
        kw = dict(chat_options={"tools": [WEATHER]}, structured_outputs={"regex": call}, temperature=0, max_tokens=80)
        for got in (client.generate(messages, **kw), accumulate(client.stream(messages, **kw))):
            assert got.finish_reason == "TOOL_CALLS" and got.reasoning_text and not got.text.strip(), got
            assert [(c.name, json.loads(c.arguments)) for c in got.tool_calls] == [("get_weather", {"city": "Oslo"})]
        with pytest.raises(grpc.RpcError) as refused:
            client.generate(messages, chat_options={"tool_choice": "required"}, max_tokens=4)
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "messages.tool_choice needs messages.tools" in refused.value.details()
        bad = [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "string", "pattern": "(("}}}}}]
        with pytest.raises(grpc.RpcError) as refused:  # the workers' compile error names the tools (helper 19)
            client.generate(messages, chat_options={"tools": bad, "tool_choice": "required"}, max_tokens=4)
        assert refused.value.details().startswith("messages.tools (the schema the tool choice constrains"), \
            refused.value.details()
        think = json.dumps({"regex": r"<think>[a-z ]{1,8}</think>\nThe answer is [0-9]\."})
        ref = client.generate([{"role": "user", "content": "What is 2 + 2?"}], structured_outputs=json.loads(think),
                              temperature=0, max_tokens=24)
    assert main(["generate", "--address", state["router_address"], "--chat", "--temperature", "0", "--max-tokens", "64",
                 "--tools", json.dumps([WEATHER, TIME]), "--tool-choice", "get_weather", messages[0]["content"]]) == 0
    out, _ = capsys.readouterr()  # the named call as one JSON line after the (empty) text
    assert json.loads(out.splitlines()[-1])["arguments"] == got_named.tool_calls[0].arguments, out
    for stream in ([], ["--stream"]):
        assert main(["generate", "--address", state["router_address"], "--chat", "--temperature", "0", *stream,
                     "--max-tokens", "24", "--structured-outputs", think, "What is 2 + 2?"]) == 0
        out, err = capsys.readouterr()
        assert out.strip() == ref.text.strip() and ref.reasoning_text and err.startswith(ref.reasoning_text), (out, err)
    assert_no_leak(state)
