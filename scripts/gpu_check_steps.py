"""The steps of ``scripts/gpu_check.sh`` and its report (the shell script gives each step its time limit).

Subcommands (``OUT`` = the check's output folder; per-step files under ``OUT/steps/``)::

    detect OUT                     prints "cuda" or "cpu"; writes OUT/steps/device.json
    run STEP OUT LIMIT_S           runs one step (interrupted after LIMIT_S); writes OUT/steps/STEP.json
    finish STEP OUT RC SECONDS LIMIT   folds the step's exit code and wall seconds into its record
    skip STEP OUT REASON           records a step the budget left no time for (failed)
    report OUT BUDGET_S TOTAL_S    OUT/gpu_check.json + OUT/gpu_check.md; exit 1 when a step failed

A step record: ``{"name", "status": "passed" | "failed", "reason", "mode", "gpu_part",
"numbers": {...}, "notes": [...], "seconds", "limit_s", "log"}``. With a CUDA device every step runs
its GPU form; without one, its CPU form (``gpu_part`` says the GPU form was skipped and why):

* ``kernel_tests``: ``tests/test_kernels.py`` compiled on the GPU; on CPU a subset under the
  Triton interpreter (the full file runs in the test suite anyway).
* ``kernel_bench``: ``bench/kernels.py`` (decode GB/s vs copy bandwidth and nominal HBM peak,
  prefill TFLOP/s vs bf16 GEMM); on CPU its ``--interpret --quick`` smoke (not performance figures).
* ``e2e``: ``bench/e2e_check.py``, a 1P+1D cluster (one GPU shared, bf16; on CPU float32, tiny).
* ``kv_transport``: ``bench/kv_device.py``, torch_dist (NCCL; gloo on CPU) and gRPC GB/s.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

INTERRUPT_GRACE_S = 45  # seconds an interrupted step has to clean up (e.g. take its cluster down)
REPO = Path(__file__).resolve().parents[1]
STEPS = ("kernel_tests", "kernel_bench", "e2e", "kv_transport")
# kernel tests run on CPU: one of each kind, small shapes (the whole file runs in the test suite)
CPU_KERNEL_SUBSET = "TestBackend or (test_matches_reference and gqa3) or (test_boundary_lengths and auto-gqa8-64)"
# Nominal HBM bandwidth (GB/s, vendor data sheets) by a substring of torch's device name.
HBM_PEAK_GBPS = {"H200": 4800.0, "H100 80GB HBM3": 3350.0, "H100 PCIe": 2000.0, "H100 NVL": 3900.0,
                 "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0, "L40S": 864.0, "A10G": 600.0}
# Largest tolerated |triton - torch backend| in bench/kernels.py's outputs: a gross-error guard
# (the tight per-dtype tolerances are tests/test_kernels.py's).
BENCH_MAX_DIFF = {"bfloat16": 0.25, "float16": 0.05, "float32": 1e-3}


def _steps_dir(out: Path) -> Path:
    d = out / "steps"
    d.mkdir(parents=True, exist_ok=True)
    return d


def _write(out: Path, rec: dict) -> None:
    (_steps_dir(out) / f"{rec['name']}.json").write_text(json.dumps(rec, indent=2) + "\n")


def _read(out: Path, name: str) -> dict | None:
    p = _steps_dir(out) / f"{name}.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def detect(out: Path) -> str:
    """``"cuda"`` when torch sees a CUDA device, else ``"cpu"``; the facts go to ``steps/device.json``."""
    import torch

    info = {"torch": torch.__version__, "cuda_available": torch.cuda.is_available(), "python": sys.version.split()[0]}
    if info["cuda_available"]:
        info |= {"gpu": torch.cuda.get_device_name(0), "gpu_count": torch.cuda.device_count(),
                 "cuda": torch.version.cuda}
        try:
            import torch.distributed as dist

            info["nccl_available"] = dist.is_available() and dist.is_nccl_available()
        except ImportError:
            info["nccl_available"] = False
    (_steps_dir(out) / "device.json").write_text(json.dumps(info, indent=2) + "\n")
    return "cuda" if info["cuda_available"] else "cpu"


def _device(out: Path) -> str:
    return "cuda" if json.loads((_steps_dir(out) / "device.json").read_text())["cuda_available"] else "cpu"


def _tail(log: Path) -> str:
    """The log's last non-empty line (the error of a step that died), at most 300 characters."""
    try:
        lines = [x for x in log.read_text(errors="replace").splitlines() if x.strip()]
    except OSError:
        return ""
    return lines[-1].strip()[:300] if lines else ""


class StepTimeout(Exception):
    """A step's command ran past its limit (it was interrupted)."""


def _run(cmd: list[str], log: Path, limit_s: float, env: dict | None = None) -> int:
    """Run ``cmd`` from the repository root, its output appended to ``log``; returns its exit code.

    Past ``limit_s`` seconds the command gets SIGINT (a benchmark that started a cluster takes it
    down on KeyboardInterrupt; Ray's driver turns SIGTERM into a crash without cleanup), then
    SIGKILL after :data:`INTERRUPT_GRACE_S`.

    Raises:
        StepTimeout: it ran past ``limit_s``.
    """
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, env=env)
        try:
            return proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=INTERRUPT_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise StepTimeout(f"timed out after {limit_s:.0f}s (limit); interrupted") from None


def step_kernel_tests(out: Path, dev: str, log: Path, limit_s: float) -> dict:
    """``tests/test_kernels.py``: every test compiled on the GPU, a subset under the interpreter on CPU."""
    xml = _steps_dir(out) / "kernel_tests.xml"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_kernels.py", f"--junitxml={xml}"]
    env = dict(os.environ)
    if dev == "cpu":
        cmd += ["-k", CPU_KERNEL_SUBSET]
        env["TRITON_INTERPRET"] = "1"
    rc = _run(cmd, log, limit_s, env)
    counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    if xml.exists():
        suite = ET.parse(xml).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        counts = {k: int(suite.get(k, 0)) for k in counts}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    ok = rc == 0 and counts["passed"] > 0
    return {"status": "passed" if ok else "failed", "numbers": counts,
            "reason": "" if ok else (f"pytest exit code {rc}: {counts['failures']} failed, {counts['errors']} errors: "
                                     f"{_tail(log)}"),
            "mode": "compiled on the GPU" if dev == "cuda" else f"Triton interpreter on CPU, -k {CPU_KERNEL_SUBSET!r}"}


def hbm_peak(device_name: str) -> float | None:
    """Nominal HBM GB/s of a known GPU (by a substring of its name), else ``None``."""
    return next((v for k, v in HBM_PEAK_GBPS.items() if k.lower() in device_name.lower()), None)


def kernel_numbers(res: dict) -> dict:
    """The headline numbers of a ``bench/kernels.py`` result."""
    dec, pre = res["decode"], res["prefill"]
    best_dec = max(dec, key=lambda x: x["GBps"])
    best_pre = max(pre, key=lambda x: x["TFLOPs"])
    peak = None if res["interpreter"] else hbm_peak(res["device"])
    nums = {"device": res["device"], "dtype": res["dtype"], "copy_GBps": res["copy_GBps"],
            "decode_best_GBps": best_dec["GBps"], "decode_best_point": [best_dec["batch"], best_dec["context"]],
            "decode_best_of_copy": best_dec["of_copy_peak"], "hbm_peak_GBps_nominal": peak,
            "decode_best_of_hbm_peak": best_dec["GBps"] / peak if peak else None,
            "gemm_TFLOPs": res["gemm_TFLOPs"], "prefill_best_TFLOPs": best_pre["TFLOPs"],
            "prefill_best_point": [best_pre["batch"], best_pre["new_tokens"], best_pre["prefix"]],
            "prefill_best_of_gemm": best_pre["of_gemm"],
            "max_abs_diff_vs_torch": max(x["max_abs_diff_vs_torch"] for x in dec + pre)}
    return nums


def step_kernel_bench(out: Path, dev: str, log: Path, limit_s: float) -> dict:
    """``bench/kernels.py`` into ``OUT/kernels/`` (its ``--interpret --quick`` smoke on CPU)."""
    kdir = out / "kernels"
    cmd = [sys.executable, "bench/kernels.py", "--out-dir", str(kdir)]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # bench/kernels.py sets it itself with --interpret
    if dev == "cpu":
        cmd += ["--interpret", "--quick"]
    rc = _run(cmd, log, limit_s, env)
    found = sorted(kdir.glob("kernels_*.json"))
    if rc != 0 or not found:
        return {"status": "failed", "reason": f"bench/kernels.py exit code {rc}{'' if found else ', no result'}: "
                                              f"{_tail(log)}"}
    nums = kernel_numbers(json.loads(found[-1].read_text()))
    limit = BENCH_MAX_DIFF.get(nums["dtype"], 0.25)
    bad = nums["max_abs_diff_vs_torch"] > limit
    return {"status": "failed" if bad else "passed", "numbers": nums, "files": [str(p) for p in found],
            "reason": f"triton vs torch backend differ by {nums['max_abs_diff_vs_torch']:.3g} > {limit}" if bad else "",
            "mode": "compiled on the GPU" if dev == "cuda" else "Triton interpreter on CPU (not performance figures)"}


def step_e2e(out: Path, dev: str, log: Path, limit_s: float) -> dict:
    """``bench/e2e_check.py``: 1P+1D on one GPU in bf16; on CPU 2 requests of 8 tokens in float32."""
    res_path = _steps_dir(out) / "e2e_result.json"
    cmd = [sys.executable, "bench/e2e_check.py", "--device", dev, "--out", str(res_path)]
    if os.environ.get("GPU_CHECK_MODEL"):
        cmd += ["--model", os.environ["GPU_CHECK_MODEL"]]
    if dev == "cpu":
        cmd += ["--requests", "2", "--prompt-tokens", "32", "--new-tokens", "8"]
    rc = _run(cmd, log, limit_s)
    if not res_path.exists():
        return {"status": "failed", "reason": f"bench/e2e_check.py exit code {rc}, no result: {_tail(log)}"}
    res = json.loads(res_path.read_text())
    keys = ("requests", "prompt_tokens", "new_tokens", "ttft_ms_median", "ttft_ms_p90", "tpot_ms_median",
            "tpot_ms_p90", "output_tokens_per_s", "up_s")
    ok = rc == 0 and res["ok"]
    return {"status": "passed" if ok else "failed", "numbers": {k: res.get(k) for k in keys}, "files": [str(res_path)],
            "reason": "" if ok else (f"exit code {rc}; tokens per request {res['tokens']}; errors {res['failed'][:3]}; "
                                     f"KV held after the run {res.get('kv_held_after')}"),
            "mode": ("1P+1D on one GPU (--worker-gpus 0.5), bfloat16, gRPC KV" if dev == "cuda"
                     else "1P+1D on CPU, float32, tiny (CI smoke)")}


def step_kv_transport(out: Path, dev: str, log: Path, limit_s: float) -> dict:
    """``bench/kv_device.py``: torch_dist (NCCL on GPUs, gloo on CPU) and gRPC GB/s, raw TCP for reference."""
    res_path = _steps_dir(out) / "kv_result.json"
    cmd = [sys.executable, "bench/kv_device.py", "--device", dev, "--out", str(res_path)]
    if dev == "cpu":
        cmd += ["--tokens", "256", "--reps", "2"]
    rc = _run(cmd, log, limit_s)
    if rc != 0 or not res_path.exists():
        return {"status": "failed", "reason": f"bench/kv_device.py exit code {rc}: {_tail(log)}"}
    res = json.loads(res_path.read_text())
    nums, bad = {"dtype": res["dtype"], "torch_dist_backend": res["torch_dist_backend"]}, []
    for r in res["results"]:
        for name in ("raw_tcp", "grpc", "torch_dist"):
            if r.get(name):
                nums[f"{name}_GBps_{r['tokens']}tok"] = r[name]["gb_per_s"]
                if r[name].get("verified") is False:
                    bad.append(f"{name} at {r['tokens']} tokens: received bytes differ")
    notes = [f"torch_dist ({res['torch_dist_backend']}) skipped: {res['torch_dist_skipped']}"] \
        if res["torch_dist_skipped"] else []
    return {"status": "failed" if bad else "passed", "reason": "; ".join(bad), "numbers": nums, "notes": notes,
            "files": [str(res_path)], "mode": f"{res['sender_device']} -> {res['receiver_device']}, {res['dtype']}"}


RUNNERS = {"kernel_tests": step_kernel_tests, "kernel_bench": step_kernel_bench, "e2e": step_e2e,
           "kv_transport": step_kv_transport}


def run_step(name: str, out: Path, limit_s: float) -> int:
    """Run step ``name`` (its command interrupted after ``limit_s`` seconds) and write its record;
    exit code 1 when it failed."""
    dev = _device(out)
    log = _steps_dir(out) / f"{name}.log"
    rec = {"name": name, "status": "failed", "reason": "", "numbers": {}, "notes": [], "log": str(log)}
    try:
        rec |= RUNNERS[name](out, dev, log, limit_s)
    except StepTimeout as e:
        rec["reason"] = str(e)
    rec["gpu_part"] = "ran" if dev == "cuda" else "skipped: no CUDA device visible to torch (ran the CPU form)"
    _write(out, rec)
    return 0 if rec["status"] != "failed" else 1


def finish(name: str, out: Path, rc: int, seconds: float, limit: float) -> None:
    """Fold the step's exit code and wall time into its record (a missing record or a timeout fails it)."""
    rec = _read(out, name) or {"name": name, "status": "failed", "numbers": {}, "notes": [],
                               "reason": f"exit code {rc}, no record (see steps/{name}.log)"}
    if rc in (124, 137):  # the shell's safety net: the step did not even end after its interrupt
        rec["status"] = "failed"
        rec["reason"] = f"timed out after {limit:.0f}s (limit) and did not stop when interrupted"
    elif rc != 0 and rec["status"] == "passed":
        rec["status"], rec["reason"] = "failed", f"exit code {rc}"
    rec |= {"seconds": round(seconds, 1), "limit_s": limit, "log": str(_steps_dir(out) / f"{name}.log")}
    _write(out, rec)


def skip(name: str, out: Path, reason: str) -> None:
    """Record a step that could not run because the budget was spent: a failure of the check."""
    _write(out, {"name": name, "status": "failed", "reason": reason, "numbers": {}, "notes": [], "seconds": 0.0})


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1000 else f"{v:.0f}"
    return "–" if v is None else str(v)


def markdown(rep: dict) -> str:
    """The report as a markdown table plus each step's numbers."""
    dev = rep["device"]
    nccl = "yes" if dev.get("nccl_available") else "no"
    where = (f"{dev['gpu']} x{dev['gpu_count']} (CUDA {dev['cuda']}, NCCL {nccl})"
             if dev["cuda_available"] else "no CUDA device: CPU forms of the steps (GPU forms skipped)")
    lines = [f"# GPU check ({'passed' if rep['passed'] else 'FAILED'})", "",
             f"{where}; torch {dev['torch']}, Python {dev['python']}; {rep['total_seconds']:.0f} s of a "
             f"{rep['budget_s']:.0f} s budget.", "",
             "| step | status | form | seconds (limit) | reason / notes |", "|---|---|---|---:|---|"]
    for s in rep["steps"]:
        why = "; ".join(x for x in [s.get("reason", "")] + s.get("notes", []) if x)
        lim = f" ({_fmt(s['limit_s'])})" if s.get("limit_s") else ""
        lines.append(f"| {s['name']} | {s['status']} | {s.get('mode', '')} | {_fmt(s.get('seconds'))}{lim} | {why} |")
    for s in rep["steps"]:
        if s.get("numbers"):
            lines += ["", f"## {s['name']}", "", "| quantity | value |", "|---|---:|"]
            lines += [f"| {k} | {_fmt(v)} |" for k, v in s["numbers"].items()]
    return "\n".join(lines) + "\n"


def report(out: Path, budget_s: float, total_s: float) -> int:
    """Write ``gpu_check.json`` and ``gpu_check.md``; 1 when a step failed (or has no record)."""
    steps = [_read(out, n) or {"name": n, "status": "failed", "reason": "no record", "numbers": {}, "notes": []}
             for n in STEPS]
    rep = {"device": json.loads((_steps_dir(out) / "device.json").read_text()), "budget_s": budget_s,
           "total_seconds": round(total_s, 1), "passed": all(s["status"] != "failed" for s in steps), "steps": steps}
    (out / "gpu_check.json").write_text(json.dumps(rep, indent=2) + "\n")
    text = markdown(rep)
    (out / "gpu_check.md").write_text(text)
    print(text)
    return 0 if rep["passed"] else 1


def main(argv: list[str]) -> int:
    usage = ("usage: gpu_check_steps.py detect OUT | run STEP OUT LIMIT_S | finish STEP OUT RC SECONDS LIMIT | "
             "skip STEP OUT REASON | report OUT BUDGET_S TOTAL_S")
    if not argv:
        raise SystemExit(usage)
    cmd, rest = argv[0], argv[1:]
    if cmd == "detect" and len(rest) == 1:
        print(detect(Path(rest[0])))
        return 0
    if cmd in ("run", "finish", "skip") and rest and rest[0] not in STEPS:
        raise SystemExit(f"unknown step {rest[0]!r}; steps: {', '.join(STEPS)}")
    if cmd == "run" and len(rest) == 3:
        return run_step(rest[0], Path(rest[1]), float(rest[2]))
    if cmd == "finish" and len(rest) == 5:
        finish(rest[0], Path(rest[1]), int(rest[2]), float(rest[3]), float(rest[4]))
        return 0
    if cmd == "skip" and len(rest) == 3:
        skip(rest[0], Path(rest[1]), rest[2])
        return 0
    if cmd == "report" and len(rest) == 3:
        return report(Path(rest[0]), float(rest[1]), float(rest[2]))
    raise SystemExit(usage)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
