"""Worker CPU priority (serving/priority.py): every thread of the process, those it has and those it
starts later, runs the given nice steps lower; invalid values are refused naming the field."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from serving.priority import lower_cpu_priority
from serving.worker_config import ConfigError, WorkerConfig

_CHILD = """
import json, os, threading
from serving.priority import lower_cpu_priority
stop = threading.Event()
before = threading.Thread(target=stop.wait); before.start()
base = os.getpriority(os.PRIO_PROCESS, 0)
new = lower_cpu_priority(4)
after = threading.Thread(target=stop.wait); after.start()
nice = {t: os.getpriority(os.PRIO_PROCESS, int(t)) for t in os.listdir("/proc/self/task")}
stop.set()
print(json.dumps({"base": base, "new": new, "threads": nice}))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice values are Linux's")
def test_every_thread_now_and_later_runs_lower():
    out = json.loads(subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, check=True,
                                    cwd=".").stdout)
    assert out["new"] == min(19, out["base"] + 4)
    assert len(out["threads"]) == 3 and set(out["threads"].values()) == {out["new"]}, out


def test_invalid_values_are_refused():
    with pytest.raises(ValueError, match=r"increment must be in \[0, 19\]"):
        lower_cpu_priority(20)
    with pytest.raises(ConfigError, match=r"cpu_nice \(--worker-nice\) must be in \[0, 19\], got -1"):
        WorkerConfig(role="decode", worker_id="w", model="m", redis_url="redis://x", cpu_nice=-1)
