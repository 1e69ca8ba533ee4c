"""One load test end to end: plan -> prompts -> run -> metrics -> files.

:func:`run_loadtest` is what ``pdcluster loadtest`` calls; tests and benchmarks call it
directly. It contacts only ``run.address``.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from rich.console import Console

from loadtest.backends import openai_client
from loadtest.live import LiveProgress
from loadtest.metrics import SLO, summarize
from loadtest.prompts import PromptFactory, load_tokenizer
from loadtest.records import RequestRecord
from loadtest.report import summary_table, write_markdown, write_records, write_summary
from loadtest.runner import LoadRunner, RunConfig
from loadtest.traces import default_traces_dir
from loadtest.workload import WorkloadConfig, build_plan
from pdcluster.client import PdclusterClient


@dataclass
class LoadTestResult:
    """``summary`` (the dict written to ``summary.json``), every request's record, and the
    files written (empty without an output directory)."""

    summary: dict
    records: list[RequestRecord]
    files: list[Path] = field(default_factory=list)


def _prompts(plan, factory: PromptFactory, vocab_size: int) -> list[list[int]]:
    prompts = [factory.prompt(r) for r in plan]
    for req, ids in zip(plan, prompts):
        if len(ids) != req.input_tokens or (ids and max(ids) >= vocab_size):
            raise RuntimeError(f"prompt {req.index}: {len(ids)} tokens for {req.input_tokens} planned, "
                               f"or an id >= vocab_size {vocab_size} (tokenizer does not match the model?)")
    return prompts


@dataclass(frozen=True)
class ServerInfo:
    """What the load tester needs to know of the server (``vocab_size`` 0: ask the tokenizer)."""

    model_name: str
    max_model_len: int
    vocab_size: int = 0


def server_info(run: RunConfig) -> ServerInfo:
    """The served model: ``GetModelInfo`` of a router, or ``/v1/models`` of an OpenAI server
    (``max_model_len`` as vLLM and pdcluster report it; 2048 when the server does not).

    Raises:
        TimeoutError: not ready within ``run.ready_timeout_s`` seconds.
        grpc.RpcError: ``GetModelInfo`` failed.
        ConnectionError: the OpenAI-compatible server did not list its model (unreachable,
            an HTTP error or an empty list).
    """
    if run.backend == "openai":
        import openai

        with openai_client(run.address, run.api_key, run.ready_timeout_s, max_retries=3, tls_ca=run.tls_ca) as client:
            try:
                model = client.models.list().data[0]
            except (openai.APIError, IndexError) as e:
                raise ConnectionError(f"no model listed at {client.base_url}models: {e}") from None
        return ServerInfo(model.id, int(getattr(model, "max_model_len", None) or 2048))
    with PdclusterClient(run.address, timeout_s=run.ready_timeout_s, api_key=run.api_key, tls_ca=run.tls_ca) as client:
        client.wait_ready(run.ready_timeout_s)
        info = client.model_info()
    return ServerInfo(info.model_name, info.max_model_len, info.vocab_size)


def run_loadtest(workload: WorkloadConfig, run: RunConfig, *, slo: SLO | None = None,
                 traces_dir: Path | str | None = None, tokenizer: str | None = None,
                 output_dir: Path | str | None = None, plots: bool = True,
                 console: Console | None = None, progress: bool = True) -> LoadTestResult:
    """Plan ``workload``, send it to ``run.address`` and summarize (see :mod:`metrics`).

    ``tokenizer`` is a model spec for the prompt tokenizer (default: the served model's
    name from ``GetModelInfo``). With ``output_dir``, writes ``summary.json``,
    ``requests.jsonl``, ``report.md`` and (``plots``) the PNGs of :mod:`plots`. With
    ``console``, prints the summary table there; ``progress`` shows the live bar.

    Raises:
        TimeoutError: the router is not SERVING within ``run.ready_timeout_s`` seconds.
        grpc.RpcError: ``GetModelInfo`` failed.
        WorkloadError, FileNotFoundError, ValueError: bad workload or unreadable trace.
        InvariantError: completed + failed != sent.
    """
    traces_dir = Path(traces_dir) if traces_dir else default_traces_dir()
    info = server_info(run)
    tok = load_tokenizer(tokenizer or info.model_name)
    plan, clipping = build_plan(workload, traces_dir, info.max_model_len)
    factory = PromptFactory.from_tokenizer(tok, traces_dir, workload.seed)
    prompts = _prompts(plan, factory, info.vocab_size or len(tok))

    runner: LoadRunner | None = None
    live = LiveProgress(len(plan), lambda: runner.counters(), console=console, enabled=progress)
    runner = LoadRunner(run, plan, prompts, on_request_end=live.on_request_end)
    with live:
        result = runner.run()

    summary = summarize(result.records, result.sent, result.duration_s, slo)
    summary.update(not_sent=result.not_sent, interrupted=result.interrupted, clipping=clipping.as_dict(),
                   model=info.model_name, address=run.address,
                   workload=asdict(workload),
                   run={k: v for k, v in asdict(run).items() if k not in ("address", "api_key", "tls_ca")})
    if clipping.notes:
        summary["notes"] = clipping.notes
    files: list[Path] = []
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        if plots:
            from loadtest.plots import write_plots

            files += write_plots(result.records, result.duration_s, out)
        write_summary(out / "summary.json", summary)
        write_records(out / "requests.jsonl", result.records)
        config = {**{f"workload.{k}": v for k, v in asdict(workload).items()},
                  "address": run.address, "concurrency": run.concurrency, "duration_s": run.duration_s}
        write_markdown(out / "report.md", summary, [p for p in files if p.suffix == ".png"], config)
        files += [out / "summary.json", out / "requests.jsonl", out / "report.md"]
    if console is not None:
        console.print(summary_table(summary))
    return LoadTestResult(summary, result.records, files)
