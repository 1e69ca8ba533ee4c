"""KV-failure policies: the registry, what each policy asks of the scheduler, and the
answers to a FailTransfer report. No model: a recorder stands in for the scheduler."""

from __future__ import annotations

import grpc
import pytest

from decode_worker.kv_failure import (
    KV_FAILURE_POLICY_REGISTRY,
    ErrorPolicy,
    KvFailureOutcome,
    RecomputePolicy,
    make_kv_failure_policy,
)
from engine.config import KV_FAILURE_POLICIES, SchedulerConfig
from engine.request import Request, RequestParams, RequestStatus
from engine.sampling import SamplingOptions


class Recorder:
    """The scheduler's :class:`RecoveryActions`, recording the calls."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def fail_request(self, request_id: str, code: grpc.StatusCode, message: str) -> None:
        self.calls.append(("fail", request_id, code, message))

    def recompute_request(self, request_id: str, why: str) -> None:
        self.calls.append(("recompute", request_id, why))


def _req(status: RequestStatus, rid: str = "r", transfer_id: str = "x") -> Request:
    params = RequestParams(max_tokens=4, sampling=SamplingOptions(temperature=0.0))
    return Request(rid, [1, 2, 3], params, transfer_id=transfer_id, status=status)


def test_registry_matches_the_config_names():
    assert set(KV_FAILURE_POLICY_REGISTRY) == set(KV_FAILURE_POLICIES)
    for name in KV_FAILURE_POLICIES:
        policy = make_kv_failure_policy(SchedulerConfig(kv_failure_policy=name).kv_failure_policy)
        assert policy.name == name
    assert isinstance(make_kv_failure_policy("error"), ErrorPolicy)
    assert isinstance(make_kv_failure_policy("recompute"), RecomputePolicy)
    assert make_kv_failure_policy("recompute") is not make_kv_failure_policy("recompute")  # fresh state


def test_unknown_policy_name_raises():
    with pytest.raises(ValueError, match="unknown kv_failure_policy 'retry'; registered: \\['error', 'recompute'\\]"):
        make_kv_failure_policy("retry")


def test_error_policy_fails_the_request():
    policy, actions = ErrorPolicy(), Recorder()
    assert policy.transfer_lost("r", "KV transfer failed: corrupt", actions) == KvFailureOutcome.FAILED
    assert actions.calls == [("fail", "r", grpc.StatusCode.UNAVAILABLE, "KV transfer failed: corrupt")]
    assert not policy.is_rebuilding("r")


def test_recompute_policy_rebuilds_and_remembers_until_forgotten():
    policy, actions = RecomputePolicy(), Recorder()
    assert policy.transfer_lost("r", "lease expired", actions) == KvFailureOutcome.RECOMPUTING
    assert actions.calls == [("recompute", "r", "lease expired")]
    assert policy.is_rebuilding("r") and not policy.is_rebuilding("s")
    policy.forget("r")
    policy.forget("r")  # idempotent
    assert not policy.is_rebuilding("r")


@pytest.mark.parametrize("policy_cls", [ErrorPolicy, RecomputePolicy])
def test_fail_transfer_outcomes(policy_cls):
    policy = policy_cls()
    unknown = KvFailureOutcome.UNKNOWN_REQUEST
    assert policy.fail_transfer_outcome(None, "x") == unknown
    assert policy.fail_transfer_outcome(_req(RequestStatus.RUNNING), "another") == unknown
    assert policy.fail_transfer_outcome(_req(RequestStatus.WAITING), "x") == unknown  # no blocks offered yet
    assert policy.fail_transfer_outcome(_req(RequestStatus.TRANSFERRING), "x") is None  # lost now
    for status in (RequestStatus.RUNNING, RequestStatus.PREEMPTED, RequestStatus.RECOMPUTING):
        assert policy.fail_transfer_outcome(_req(status), "x") == KvFailureOutcome.KV_COMPLETE


def test_fail_transfer_outcome_of_a_rebuilt_request():
    policy = RecomputePolicy()
    policy.transfer_lost("r", "corrupt", Recorder())
    assert policy.fail_transfer_outcome(_req(RequestStatus.RECOMPUTING), "x") == KvFailureOutcome.RECOMPUTING
    assert policy.fail_transfer_outcome(_req(RequestStatus.RUNNING), "x") == KvFailureOutcome.RECOMPUTING
    assert policy.fail_transfer_outcome(_req(RequestStatus.RUNNING, rid="s"), "x") == KvFailureOutcome.KV_COMPLETE
