"""The cluster controller's decision rules (:func:`deploy.heal.decide`) on a fake clock."""

from __future__ import annotations

import pytest

from deploy.heal import Action, HealConfig, Probe, WorkerWatch, decide, worker_restarts

CFG = HealConfig(period_s=1.0, hung_after_s=20.0, start_timeout_s=100.0, restart_backoff_s=5.0)


def test_dead_actor_is_recreated_at_once():
    w = WorkerWatch("decode-0", "decode")
    assert decide(w, Probe.DEAD, 0.0, CFG) is Action.RECREATE
    assert "dead" in w.reason


@pytest.mark.parametrize("probe", [Probe.UNRESPONSIVE, Probe.SERVING])
def test_silent_worker_is_restarted_after_hung_after_s(probe):
    w = WorkerWatch("prefill-0", "prefill")
    assert decide(w, probe, 100.0, CFG) is Action.NONE
    # counted from the record's expiry, and said so (helper finding: "for 0s" 4 s after a SIGSTOP read as wrong)
    assert decide(w, probe, 119.0, CFG) is Action.NONE and w.reason.endswith(", missing from the registry for 19s")
    assert decide(w, probe, 120.0, CFG) is Action.RESTART
    w.acted_at, w.restarts = 120.0, 1
    assert decide(w, probe, 130.0, CFG) is Action.NONE  # the quiet period starts again at the restart
    assert decide(w, probe, 140.0, CFG) is Action.RESTART


def test_loading_worker_is_left_alone_until_the_start_timeout():
    w = WorkerWatch("decode-0", "decode")
    assert decide(w, Probe.LOADING, 0.0, CFG) is Action.NONE
    assert decide(w, Probe.LOADING, 99.0, CFG) is Action.NONE and w.reason.startswith("loading")
    assert decide(w, Probe.LOADING, 100.0, CFG) is Action.RESTART


def test_failed_start_is_retried_with_backoff():
    w = WorkerWatch("decode-0", "decode", acted_at=10.0)
    assert decide(w, Probe.FAILED, 12.0, CFG, "OSError: no space") is Action.NONE
    assert w.reason == "failed to start: OSError: no space"
    assert decide(w, Probe.FAILED, 15.0, CFG) is Action.RESTART


def test_seen_live_clears_the_record():
    w = WorkerWatch("decode-0", "decode")
    decide(w, Probe.UNRESPONSIVE, 5.0, CFG)
    w.seen_live()
    assert w.missing_since is None and w.reason == ""
    assert decide(w, Probe.UNRESPONSIVE, 50.0, CFG) is Action.NONE  # missing again from 50 s on


def test_config_is_validated():
    with pytest.raises(ValueError, match="hung_after_s"):
        HealConfig(hung_after_s=0)


def test_restarts_count_every_new_generation_and_the_controllers_actions():
    """Ray restarts a crashed worker in place without the controller acting: its new generation
    counts (helper finding: ``worker_restarts`` stayed 0 through two kill -9s); a restart the
    controller ordered that has not registered yet counts too."""
    watch = WorkerWatch("decode-0", "decode")
    assert worker_restarts({"generation": 4}, watch) == 0  # not yet stamped: nothing seen
    entry = {"generation": 1, "first_generation": 1}
    assert worker_restarts(entry, watch) == 0 and worker_restarts(entry, None) == 0
    entry["generation"] = 3  # two crashes, Ray restarted it twice
    assert worker_restarts(entry, watch) == 2
    watch.restarts = 3  # the controller restarted it a third time; not registered yet
    assert worker_restarts(entry, watch) == 3
    assert worker_restarts({"generation": 9, "first_generation": 7}, None) == 2  # an id reused after a scale-down
