"""The KV transport registry as workers use it: config, module loading, factories, and the `up` flags."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from kv_helpers import FAULTY_MODULE, TableSink

from common.model_config import ConfigError
from decode_worker.transfers import TransferTable
from deploy.spec import kv_config_from_args
from kvtransfer import (
    GrpcKvSender,
    KvConfigError,
    KvTransferConfig,
    KvTransferServicer,
    attach_receiver,
    create_sender,
    get_transport,
    load_transport,
)
from pdcluster.cli import build_parser


def test_config_checks_module_name_and_options() -> None:
    options = {"fault": "drop"}
    cfg = KvTransferConfig(transport_module="tests.kv_faults", transport_options=options)
    options["fault"] = "corrupt"
    assert cfg.transport_options == {"fault": "drop"}  # a copy of the caller's dict
    with pytest.raises(KvConfigError, match="dotted module name"):
        KvTransferConfig(transport_module="tests/kv_faults.py")
    with pytest.raises(KvConfigError, match="strings"):
        KvTransferConfig(transport_options={"chunk": 1})
    with pytest.raises(KvConfigError, match="strings"):
        KvTransferConfig(transport_options={"": "x"})


def test_load_transport_imports_the_module_first() -> None:
    cfg = KvTransferConfig(transport="faulty", transport_module=FAULTY_MODULE)
    assert load_transport(cfg).name == "faulty" and get_transport("faulty") is load_transport(cfg)
    with pytest.raises(ModuleNotFoundError):
        load_transport(KvTransferConfig(transport="faulty", transport_module="tests.no_such_transport"))
    with pytest.raises(KeyError, match=r"unknown KV transport 'carrier-pigeon'; registered: \[.*'grpc'"):
        load_transport(KvTransferConfig(transport="carrier-pigeon"))


def test_grpc_factories_build_the_control_plane_and_take_no_options() -> None:
    sender = create_sender(KvTransferConfig(timeout_s=3.0))
    sender.close()
    assert isinstance(sender, GrpcKvSender)
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    try:
        sink = TableSink(TransferTable(torch.zeros(1, 2, 2, 4, 1, 2)))
        assert isinstance(attach_receiver(KvTransferConfig(), server, sink), KvTransferServicer)
        with pytest.raises(ValueError, match="'grpc' takes no option"):
            attach_receiver(KvTransferConfig(transport_options={"x": "1"}), server, sink)
    finally:
        server.stop(0)
    with pytest.raises(ValueError, match="'grpc' takes no option"):
        create_sender(KvTransferConfig(transport_options={"x": "1"}))


def _up(*flags: str):
    return build_parser().parse_args(["up", "--local", *flags])


def test_up_flags_build_the_kv_config() -> None:
    args = _up("--kv-transport", "faulty", "--kv-transport-module", FAULTY_MODULE, "--kv-transport-option",
               "fault=delay", "--kv-transport-option", "delay_s=0.5", "--kv-timeout-s", "7")
    kv = kv_config_from_args(args, use_cuda=False)
    assert (kv.transport, kv.transport_module, kv.timeout_s) == ("faulty", FAULTY_MODULE, 7.0)
    assert kv.transport_options == {"fault": "delay", "delay_s": "0.5"} and kv.layerwise is False
    assert kv_config_from_args(_up(), use_cuda=True) == KvTransferConfig(layers_per_chunk=2, layerwise=True)


@pytest.mark.parametrize("flags, match", [
    (("--kv-transport", "carrier-pigeon"), "unknown KV transport 'carrier-pigeon'"),
    (("--kv-transport-module", "tests.no_such_transport"), "No module named 'tests.no_such_transport'"),
    (("--kv-transport-option", "a=1", "--kv-transport-option", "a=2"), "given twice"),
])
def test_up_refuses_a_transport_it_cannot_load(flags, match) -> None:
    with pytest.raises(ConfigError, match=match):
        kv_config_from_args(_up(*flags), use_cuda=False)


def test_up_flag_needs_key_value(capsys) -> None:
    with pytest.raises(SystemExit):
        _up("--kv-transport-option", "novalue")
    assert "expected KEY=VALUE" in capsys.readouterr().err
