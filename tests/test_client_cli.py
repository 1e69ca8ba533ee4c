"""PdclusterClient and the ``pdcluster generate`` CLI against an in-test fake Router.

The fake servicer stands in for the router so that only the client side is
under test; it runs on a real gRPC server with the standard health service.
"""

from __future__ import annotations

import json
import sys
import threading
import time
import types
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from pdcluster import cli
from pdcluster.client import (
    ROUTER_SERVICE,
    GenerationResult,
    PdclusterClient,
    TokenLogprob,
    Usage,
    build_request,
)
from pdcluster.v1 import common_pb2, router_pb2, router_pb2_grpc

FR = common_pb2.FinishReason
STREAM_STEP_S = 0.02


class FakeRouter(router_pb2_grpc.RouterServicer):
    """Emits tokens 100, 101, ... with text "t0 t1 ..." up to max_tokens (default 4)."""

    def __init__(self):
        self.requests: list[router_pb2.GenerateRequest] = []
        self.running = {"req-running"}
        self.stream_terminated = threading.Event()
        self.stream_saw_inactive = threading.Event()
        self.stream_completed = False

    def Generate(self, request, context):
        self.requests.append(request)
        sp = request.sampling
        if sp.HasField("temperature") and sp.temperature < 0:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "temperature must be >= 0")
        n = sp.max_tokens if sp.HasField("max_tokens") else 4
        rid = request.request_id or "minted-1"
        which = request.WhichOneof("prompt")
        prompt_len = {
            "text": len(request.text.split()),
            "token_ids": len(request.token_ids.ids),
            "messages": len(request.messages.messages),
        }[which]
        usage = common_pb2.Usage(prompt_tokens=prompt_len, completion_tokens=n, cached_prompt_tokens=1)

        def lp(i):
            top = [common_pb2.TopLogprob(token_id=100 + i, logprob=-0.5)] * sp.logprobs
            return common_pb2.TokenLogprob(token_id=100 + i, logprob=-0.5, top=top)

        if not request.stream:
            yield router_pb2.GenerateResponse(
                request_id=rid, token_ids=[100 + i for i in range(n)],
                text="".join(f"t{i} " for i in range(n)), finish_reason=FR.FINISH_REASON_LENGTH,
                usage=usage, logprobs=[lp(i) for i in range(n)] if sp.logprobs else [],
            )
            return
        context.add_callback(self.stream_terminated.set)
        for i in range(n):
            if not context.is_active():
                self.stream_saw_inactive.set()
                return
            last = i == n - 1
            msg = router_pb2.GenerateResponse(request_id=rid, token_ids=[100 + i], text=f"t{i} ")
            if last:
                msg.finish_reason = FR.FINISH_REASON_LENGTH
                msg.usage.CopyFrom(usage)
            yield msg
            time.sleep(STREAM_STEP_S)
        self.stream_completed = True

    def Abort(self, request, context):
        found = request.request_id in self.running
        self.running.discard(request.request_id)
        return router_pb2.AbortResponse(found=found)

    def GetModelInfo(self, request, context):
        return router_pb2.ModelInfo(model_name="fake", max_model_len=2048, vocab_size=49152,
                                    eos_token_ids=[2], block_size=16)


@pytest.fixture()
def server():
    srv = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    router = FakeRouter()
    router_pb2_grpc.add_RouterServicer_to_server(router, srv)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, srv)
    port = srv.add_insecure_port("127.0.0.1:0")
    srv.start()
    ns = types.SimpleNamespace(router=router, health=health_servicer, address=f"127.0.0.1:{port}")
    yield ns
    srv.stop(grace=None)


@pytest.fixture()
def client(server):
    with PdclusterClient(server.address, timeout_s=10) as c:
        yield c


# ---- build_request -------------------------------------------------------------------------


def test_build_request_text_leaves_optional_fields_unset():
    req = build_request("hello world")
    assert req.WhichOneof("prompt") == "text" and req.text == "hello world"
    sp = req.sampling
    for name in ("max_tokens", "temperature", "top_p", "seed", "repetition_penalty"):
        assert not sp.HasField(name), name
    assert sp.top_k == 0 and list(sp.stop) == [] and list(sp.stop_token_ids) == []
    assert sp.min_p == 0 and sp.presence_penalty == 0 and sp.frequency_penalty == 0 and not sp.logit_bias
    assert not sp.ignore_eos and sp.logprobs == 0 and req.request_id == "" and not req.stream


def test_build_request_token_ids_with_all_fields_set():
    req = build_request(
        [1, 2, 3], max_tokens=8, temperature=0.0, top_p=0.9, top_k=5, seed=7, stop="END",
        stop_token_ids=[2], ignore_eos=True, logprobs=3, request_id="r1", stream=True,
    )
    assert req.WhichOneof("prompt") == "token_ids" and list(req.token_ids.ids) == [1, 2, 3]
    sp = req.sampling
    assert sp.HasField("temperature") and sp.temperature == 0.0  # explicit greedy stays set
    assert sp.max_tokens == 8 and sp.top_p == pytest.approx(0.9) and sp.top_k == 5 and sp.seed == 7
    assert list(sp.stop) == ["END"] and list(sp.stop_token_ids) == [2]
    assert sp.ignore_eos and sp.logprobs == 3 and req.request_id == "r1" and req.stream


def test_build_request_penalties_min_p_and_logit_bias():
    req = build_request("x", min_p=0.25, repetition_penalty=1.0, presence_penalty=-0.5,
                        frequency_penalty=1.5, logit_bias={7: 100, 49151: -2.5})
    sp = req.sampling
    assert sp.min_p == 0.25 and sp.presence_penalty == -0.5 and sp.frequency_penalty == 1.5
    assert sp.HasField("repetition_penalty") and sp.repetition_penalty == 1.0  # explicit 1.0 stays set
    assert dict(sp.logit_bias) == {7: 100.0, 49151: -2.5}
    unset = build_request("x", min_p=0, presence_penalty=0.0, frequency_penalty=None, logit_bias={}).sampling
    assert unset.min_p == 0 and unset.presence_penalty == 0 and not unset.logit_bias
    assert not unset.HasField("repetition_penalty")
    with pytest.raises(TypeError):
        build_request("x", logit_bias={"7": 1.0})
    with pytest.raises(ValueError):
        build_request("x", logit_bias={-1: 1.0})


def test_build_request_messages():
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = build_request(msgs, stop=["a", "b"])
    assert req.WhichOneof("prompt") == "messages"
    assert [(m.role, m.content) for m in req.messages.messages] == [("system", "be brief"), ("user", "hi")]
    assert list(req.sampling.stop) == ["a", "b"]


@pytest.mark.parametrize(
    "prompt, exc",
    [([], ValueError), ([1, "x"], TypeError), ([True], TypeError), ([{"role": "user"}], ValueError),
     (b"bytes", TypeError), (3, TypeError)],
)
def test_build_request_rejects_bad_prompts(prompt, exc):
    with pytest.raises(exc):
        build_request(prompt)


# ---- client RPCs ---------------------------------------------------------------------------


def test_generate_non_stream(server, client):
    result = client.generate("a b c", max_tokens=3, logprobs=2, request_id="r-7")
    assert result == GenerationResult(
        request_id="r-7", token_ids=[100, 101, 102], text="t0 t1 t2 ", finish_reason="LENGTH",
        usage=Usage(prompt_tokens=3, completion_tokens=3, cached_prompt_tokens=1),
        logprobs=[TokenLogprob(100 + i, -0.5, [(100 + i, -0.5)] * 2) for i in range(3)],
    )
    (req,) = server.router.requests
    assert not req.stream and req.sampling.max_tokens == 3 and req.request_id == "r-7"


def test_generate_without_logprobs_returns_none(client):
    result = client.generate([5, 6])
    assert result.logprobs is None and result.request_id == "minted-1"
    assert result.usage.prompt_tokens == 2 and len(result.token_ids) == 4


def test_stream_collects_all_chunks(server, client):
    chunks = list(client.stream("x", max_tokens=5))
    assert [list(c.token_ids) for c in chunks] == [[100 + i] for i in range(5)]
    assert "".join(c.text for c in chunks) == "t0 t1 t2 t3 t4 "
    assert chunks[-1].finish_reason == FR.FINISH_REASON_LENGTH
    assert chunks[-1].usage.completion_tokens == 5
    assert server.router.requests[0].stream


def test_stream_cancel_mid_stream_reaches_server(server, client):
    stream = client.stream("x", max_tokens=500)
    got = [next(stream), next(stream)]
    assert [list(c.token_ids) for c in got] == [[100], [101]]
    assert stream.cancel()
    assert list(stream) == []  # ends quietly after a local cancel
    assert server.router.stream_terminated.wait(5)
    time.sleep(5 * STREAM_STEP_S)
    assert not server.router.stream_completed


def test_stream_server_error_propagates(client):
    stream = client.stream("x", temperature=-1.0)
    with pytest.raises(grpc.RpcError) as info:
        list(stream)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_generate_error_keeps_status_code(client):
    with pytest.raises(grpc.RpcError) as info:
        client.generate("x", temperature=-1.0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details() == "temperature must be >= 0"


def test_abort(server, client):
    assert client.abort("req-running") is True
    assert client.abort("req-running") is False


def test_model_info(client):
    info = client.model_info()
    assert (info.model_name, info.max_model_len, info.block_size, list(info.eos_token_ids)) == (
        "fake", 2048, 16, [2])


# ---- wait_ready ----------------------------------------------------------------------------


def test_wait_ready_waits_for_router_serving(server, client):
    NS, S = health_pb2.HealthCheckResponse.NOT_SERVING, health_pb2.HealthCheckResponse.SERVING
    server.health.set(ROUTER_SERVICE, NS)
    timer = threading.Timer(0.3, server.health.set, (ROUTER_SERVICE, S))
    timer.start()
    start = time.monotonic()
    client.wait_ready(5)
    assert 0.25 < time.monotonic() - start < 4
    timer.join()


def test_wait_ready_times_out_when_not_serving(server, client):
    server.health.set(ROUTER_SERVICE, health_pb2.HealthCheckResponse.NOT_SERVING)
    with pytest.raises(TimeoutError, match="NOT_SERVING"):
        client.wait_ready(0.4)


def test_wait_ready_falls_back_to_server_wide_status(client):
    client.wait_ready(2)  # only "" is registered (SERVING by default)


def test_wait_ready_unreachable_times_out():
    with PdclusterClient("127.0.0.1:1") as c:
        start = time.monotonic()
        with pytest.raises(TimeoutError):
            c.wait_ready(0.5)
        assert time.monotonic() - start < 3


# ---- CLI -----------------------------------------------------------------------------------


def test_cli_generate_non_stream(server, capsys):
    rc = cli.main(["generate", "--address", server.address, "--max-tokens", "2", "--temperature", "0",
                   "--top-k", "3", "--seed", "9", "--stop", "END", "--stop", "FIN", "--ignore-eos", "a b"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == "t0 t1 \n"
    assert "finish=LENGTH" in err and "prompt_tokens=2" in err and "completion_tokens=2" in err
    assert "tokens/s=" in err and "elapsed=" in err
    (req,) = server.router.requests
    sp = req.sampling
    assert req.text == "a b" and not req.stream and sp.temperature == 0 and sp.top_k == 3
    assert sp.seed == 9 and list(sp.stop) == ["END", "FIN"] and sp.ignore_eos
    assert not sp.HasField("top_p") and not sp.HasField("repetition_penalty")
    assert sp.min_p == 0 and sp.presence_penalty == 0 and sp.frequency_penalty == 0


def test_cli_generate_penalty_and_min_p_flags(server, capsys):
    rc = cli.main(["generate", "--address", server.address, "--min-p", "0.5", "--repetition-penalty", "1.25",
                   "--presence-penalty", "-1.5", "--frequency-penalty", "0.75", "--stream", "a"])
    assert rc == 0
    (req,) = server.router.requests
    sp = req.sampling
    assert req.stream and sp.min_p == 0.5 and sp.repetition_penalty == 1.25
    assert sp.presence_penalty == -1.5 and sp.frequency_penalty == 0.75


def test_cli_generate_stream_chat_with_system(server, capsys):
    rc = cli.main(["generate", "--address", server.address, "--stream", "--chat", "--system", "sys",
                   "--max-tokens", "3", "hello there"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == "t0 t1 t2 \n" and "finish=LENGTH" in err and "completion_tokens=3" in err
    (req,) = server.router.requests
    assert req.stream and [(m.role, m.content) for m in req.messages.messages] == [
        ("system", "sys"), ("user", "hello there")]


def test_cli_generate_chat_without_system(server, capsys):
    assert cli.main(["generate", "--address", server.address, "--chat", "hi"]) == 0
    (req,) = server.router.requests
    assert [(m.role, m.content) for m in req.messages.messages] == [("user", "hi")]


def test_cli_generate_error_exits_1(server, capsys):
    rc = cli.main(["generate", "--address", server.address, "--temperature=-1", "x"])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert err.strip() == "error: INVALID_ARGUMENT: temperature must be >= 0"


def test_cli_stream_error_exits_1(server, capsys):
    rc = cli.main(["generate", "--address", server.address, "--stream", "--temperature=-1", "x"])
    assert rc == 1 and "error: INVALID_ARGUMENT: temperature must be >= 0" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["--system", "s"], ["--tools", "[]"], ["--chat", "--tool-choice", "f"], ["--chat", "--tools", "{}"]])
def test_cli_flags_that_need_another_are_usage_errors(argv, capsys):  # --system / --tools need --chat, ...
    with pytest.raises(SystemExit) as info:
        cli.main(["generate", *argv, "x"])
    assert info.value.code == 2


def _fake_deploy(monkeypatch, module="deploy.local", **attrs):
    mod = types.ModuleType(module)
    for k, v in attrs.items():
        setattr(mod, k, v)
    monkeypatch.setitem(sys.modules, module, mod)
    return mod


def test_cli_default_address_from_state(server, monkeypatch, capsys):
    _fake_deploy(monkeypatch, "deploy.state", read_state=lambda state_dir=None: {"router_address": server.address})
    assert cli.default_address() == server.address
    assert cli.main(["generate", "x"]) == 0
    assert capsys.readouterr().out == "t0 t1 t2 t3 \n"


def test_cli_generate_finds_the_router_in_state_dir(server, tmp_path, capsys):
    """``generate --state-dir DIR``: the router address ``up --state-dir DIR`` recorded; ``--address``
    wins over it; a DIR no cluster is up from is one line on stderr, not a call to the fallback address."""
    (tmp_path / "cluster.json").write_text(json.dumps({"router_address": server.address}))
    assert cli.main(["generate", "--state-dir", str(tmp_path), "x"]) == 0
    assert capsys.readouterr().out == "t0 t1 t2 t3 \n"
    rc = cli.main(["generate", "--state-dir", str(tmp_path / "none"), "--address", server.address, "y"])
    assert rc == 0 and [r.text for r in server.router.requests] == ["x", "y"]
    capsys.readouterr()
    assert cli.main(["generate", "--state-dir", str(tmp_path / "none"), "z"]) == 1
    assert capsys.readouterr().err == f"error: no pdcluster is up from state dir {tmp_path / 'none'}; give --address\n"
    with pytest.raises(FileNotFoundError):
        cli.default_address(state_dir=tmp_path / "none")


def test_cli_default_address_fallbacks(monkeypatch):
    def missing(state_dir=None):
        raise FileNotFoundError("no state")

    _fake_deploy(monkeypatch, "deploy.state", read_state=missing)
    assert cli.default_address() == "127.0.0.1:50051"
    monkeypatch.setitem(sys.modules, "deploy.state", None)  # import raises ImportError
    assert cli.default_address() == "127.0.0.1:50051"


def test_cli_up_down_status_delegate(monkeypatch, tmp_path):
    seen = {}

    def record(name, rc):
        def cmd(args):
            seen[name] = args
            return rc
        return cmd

    _fake_deploy(monkeypatch, cmd_up=record("up", 0), cmd_down=record("down", 3))
    _fake_deploy(monkeypatch, "deploy.status", cmd_status=record("status", 0))
    assert cli.main(["up", "--local", "--prefill", "2", "--decode", "3", "--kv-cache-gb", "0.5",
                     "--state-dir", str(tmp_path)]) == 0
    up = seen["up"]
    assert up.local and up.prefill == 2 and up.decode == 3 and up.kv_cache_gb == 0.5
    assert up.state_dir == tmp_path and up.ray_address is None and up.redis_url is None
    assert (up.model, up.port, up.host, up.block_size, up.num_kv_blocks) == (
        "smollm2-135m-instruct", 50051, "127.0.0.1", 16, 0)
    assert (up.max_model_len, up.max_num_seqs, up.max_num_batched_tokens) == (None, 64, 2048)
    assert (up.heartbeat_s, up.timeout_s, up.cluster, up.dtype, up.device) == (
        1.0, 300, "default", "auto", "auto")
    assert cli.main(["down"]) == 3 and seen["down"].state_dir.name == ".pdcluster"
    assert cli.main(["status", "--json"]) == 0 and seen["status"].json
