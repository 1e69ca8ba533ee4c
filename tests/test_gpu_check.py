"""``scripts/gpu_check.sh`` on this machine: where there is no GPU its steps run their CPU forms
(Triton interpreter subset, interpreter kernel smoke, a tiny float32 1P+1D cluster whose KV pools
are checked for leaks afterwards, gloo and gRPC KV transfers) and the report says the GPU forms
were skipped; the JSON report has one record per step, in order, with the fields readers rely on.
On a CUDA machine the same test runs the GPU forms (minutes, not CI-sized)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "gpu_check.sh"
STEPS = ["kernel_tests", "kernel_bench", "e2e", "kv_transport"]


def _run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHON=sys.executable)
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_usage_error_without_out_dir():
    proc = _run(timeout=30)
    assert proc.returncode == 2 and "usage: bash scripts/gpu_check.sh OUT_DIR" in proc.stderr
    assert _run("a", "b", timeout=30).returncode == 2


def test_gpu_check_runs_and_reports(tmp_path):
    out = tmp_path / "check" / "nested"  # created by the script
    proc = _run(str(out))
    report = proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, report
    rep = json.loads((out / "gpu_check.json").read_text())
    assert [s["name"] for s in rep["steps"]] == STEPS, report
    assert rep["passed"] is True and rep["total_seconds"] <= rep["budget_s"]
    on_gpu = torch.cuda.is_available()
    assert rep["device"]["cuda_available"] is on_gpu
    for s in rep["steps"]:
        assert s["status"] == "passed", s
        assert {"reason", "numbers", "notes", "seconds", "limit_s", "mode", "gpu_part", "log"} <= set(s), s
        assert 0 < s["seconds"] <= s["limit_s"] + 20 and Path(s["log"]).exists()
        if not on_gpu:
            assert s["gpu_part"].startswith("skipped: no CUDA device"), s
    steps = {s["name"]: s["numbers"] for s in rep["steps"]}
    assert steps["kernel_tests"]["passed"] >= 1 and steps["kernel_tests"]["failures"] == 0
    assert steps["kernel_bench"]["copy_GBps"] > 0 and steps["kernel_bench"]["prefill_best_TFLOPs"] > 0
    e2e = steps["e2e"]
    assert e2e["requests"] >= 1 and 0 < e2e["ttft_ms_median"] and 0 < e2e["tpot_ms_median"], e2e
    e2e_result = json.loads((out / "steps" / "e2e_result.json").read_text())
    assert e2e_result["ok"] and e2e_result["kv_held_after"] == {}, e2e_result  # leak check of the run
    kv = steps["kv_transport"]
    assert any(k.startswith("grpc_GBps_") and v > 0 for k, v in kv.items()), kv
    if not on_gpu:
        assert kv["torch_dist_backend"] == "gloo" and kv["torch_dist_GBps_256tok"] > 0
    md = (out / "gpu_check.md").read_text()
    assert md.startswith("# GPU check (passed)") and "| step | status |" in md
    assert all(f"| {name} | passed |" in md for name in STEPS)


def test_report_fails_on_a_failed_timed_out_or_unrun_step(tmp_path):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import gpu_check_steps as g
    finally:
        sys.path.remove(str(REPO / "scripts"))
    g.detect(tmp_path)
    g._write(tmp_path, {"name": "kernel_tests", "status": "passed", "reason": "", "numbers": {"tests": 1},
                        "notes": []})
    g.finish("kernel_tests", tmp_path, 0, 1.5, 150)
    g.finish("kernel_bench", tmp_path, 124, 180.0, 120)  # the outer safety net fired: no record
    g.skip("e2e", tmp_path, "not run: the 450s budget was spent")
    assert g.report(tmp_path, 450, 460) == 1  # kv_transport has no record at all
    rep = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {s["name"]: (s["status"], s["reason"]) for s in rep["steps"]}
    assert status["kernel_tests"] == ("passed", "")
    assert status["kernel_bench"][0] == "failed" and "timed out after 120s" in status["kernel_bench"][1]
    assert status["e2e"] == ("failed", "not run: the 450s budget was spent")
    assert status["kv_transport"] == ("failed", "no record")
    assert (tmp_path / "gpu_check.md").read_text().startswith("# GPU check (FAILED)")
