"""Live view of a running load test: a rich progress bar over the planned requests and
counters (sent, in flight, completed, failed, output tokens/s) refreshed 4 times a second."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, ProgressColumn, TextColumn, TimeElapsedColumn
from rich.text import Text

from loadtest.runner import Counters


class _CountersColumn(ProgressColumn):
    def __init__(self, snapshot: Callable[[], Counters]):
        super().__init__()
        self._snapshot = snapshot

    def render(self, task) -> Text:
        c = self._snapshot()
        rate = c.output_tokens / c.elapsed_s if c.elapsed_s > 0 else 0.0
        return Text.assemble(
            ("sent ", "dim"), (f"{c.sent}", "bold"), ("  in-flight ", "dim"), (f"{c.inflight}", "bold cyan"),
            ("  ok ", "dim"), (f"{c.completed}", "bold green"), ("  failed ", "dim"),
            (f"{c.failed}", "bold red" if c.failed else "bold"), ("  ", "dim"), (f"{rate:.1f} tok/s", "bold"))


class LiveProgress:
    """Context manager showing the bar; :meth:`on_request_end` is the runner's callback."""

    def __init__(self, total: int, snapshot: Callable[[], Counters], console: Console | None = None,
                 enabled: bool = True):
        self._progress = Progress(TextColumn("[bold]loadtest"), BarColumn(bar_width=24), MofNCompleteColumn(),
                                  TimeElapsedColumn(), _CountersColumn(snapshot), console=console,
                                  refresh_per_second=4, disable=not enabled)
        self._task = self._progress.add_task("requests", total=total)

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.refresh()
        self._progress.stop()

    def on_request_end(self, counters: Counters) -> None:
        """Advance the bar to the number of ended requests (thread-safe)."""
        self._progress.update(self._task, completed=counters.completed + counters.failed)
