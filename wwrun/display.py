"""What the user sees while a run goes on, and the summary after.

- On a terminal: a live table (rich), one row per job: state, elapsed time, memory
  when known, the job's last output line. `--tee` also prints every line above it.
- Not on a terminal (CI logs, pipes): plain `[name] line` lines, nothing redrawn.
- `--quiet`: the summary only.

Job stdout lines go to stdout and job stderr lines to stderr; the launcher's own notes
and the summary go to stderr, so `--events -` leaves stdout to the event stream
(job lines then go to stderr too).
"""

from __future__ import annotations

import threading
import time

from rich.console import Console
from rich.live import Live
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from wwrun import isolation
from wwrun.config import LaunchConfig, format_size

_STYLE = {
    "pending": "dim",
    "queued": "dim",
    "running": "cyan",
    "waiting": "magenta",
    "succeeded": "green",
    "failed": "bold red",
    "interrupted": "yellow",
    "cancelled": "dim yellow",
}


class _Console(Console):
    def on_broken_pipe(self) -> None:
        # The reader went away (`wwrun ... | head`): rich would raise SystemExit; the
        # jobs go on, their logs keep everything, and this console falls silent.
        self.quiet = True


def make_display(config: LaunchConfig):
    out = _Console(file=isolation.original_stdout(), highlight=False, soft_wrap=True)
    err = _Console(file=isolation.original_stderr(), highlight=False, soft_wrap=True)
    if config.events == "-":
        out = err
    if config.quiet:
        return QuietDisplay(err)
    if err.is_terminal:
        return LiveDisplay(out, err, tee=config.tee)
    return PlainDisplay(out, err)


class QuietDisplay:
    """The summary only."""

    def __init__(self, err: Console):
        self.err = err
        self.runner = None

    def start(self, runner) -> None:
        self.runner = runner

    def line(self, job: str, stream: str, text: str) -> None:
        pass

    def state(self, result) -> None:
        pass

    def note(self, text: str, important: bool = True) -> None:
        """A line from the launcher; only `important` ones with --quiet."""
        if important:
            self.err.print(f"[wwrun] {text}", markup=False)

    def explain(self, text: str) -> None:
        self.err.print(text, markup=False)

    def stop(self, result) -> None:
        self.err.print(summary_table(result))
        for line in summary_errors(result):
            self.err.print(line, markup=False)
        self.err.print(summary_footer(result))


class PlainDisplay(QuietDisplay):
    """Prefixed lines as they come; a line per job state change."""

    def __init__(self, out: Console, err: Console):
        super().__init__(err)
        self.out = out
        self._lock = threading.Lock()
        self._shown: dict[str, str] = {}

    def note(self, text: str, important: bool = True) -> None:
        self.err.print(f"[wwrun] {text}", markup=False)

    def line(self, job: str, stream: str, text: str) -> None:
        console = self.out if stream == "stdout" else self.err
        with self._lock:
            console.print(f"[{job}] {text}", markup=False)

    def state(self, result) -> None:
        # Waits for memory come and go with every NodeGroup: the live table and the
        # events show them, a line each would drown the log.
        if result.state.value in ("pending", "waiting") or self._shown.get(result.name) == result.state.value:
            return
        self._shown[result.name] = result.state.value
        detail = f" (exit {result.exit_code}, {result.wall_s:.1f}s)" if result.state.is_final and result.wall_s else ""
        with self._lock:
            self.err.print(f"[wwrun] {result.name}: {result.state.value}{detail}", markup=False)


class LiveDisplay(QuietDisplay):
    """A live table redrawn in place; lines above it with --tee."""

    def __init__(self, out: Console, err: Console, tee: bool):
        super().__init__(err)
        self.out = out
        self.tee = tee
        self._live: Live | None = None

    def start(self, runner) -> None:
        self.runner = runner
        # Never redirect sys.stdout/err: they are the per-job views (wwrun.isolation).
        self._live = Live(
            get_renderable=self._table, console=self.err, refresh_per_second=4, transient=True,
            redirect_stdout=False, redirect_stderr=False,
        )
        self._live.start()

    def line(self, job: str, stream: str, text: str) -> None:
        if self.tee and self._live is not None:
            self._live.console.print(Text.assemble((f"[{job}] ", "bold"), text))

    def state(self, result) -> None:
        pass

    def note(self, text: str, important: bool = True) -> None:
        target = self._live.console if self._live else self.err
        target.print(f"[wwrun] {text}", markup=False)

    def stop(self, result) -> None:
        if self._live is not None:
            self._live.stop()
        super().stop(result)

    def _table(self) -> Table:
        table = Table(box=None, pad_edge=False, expand=True)
        table.add_column("job", no_wrap=True, style="bold")
        table.add_column("state", no_wrap=True)
        table.add_column("elapsed", justify="right", no_wrap=True)
        table.add_column("memory", justify="right", no_wrap=True)
        table.add_column("last line", no_wrap=True, overflow="ellipsis", ratio=1)
        for job in self.runner.jobs:
            result = job.result
            state = result.state.value
            # A job that has not started holds nothing: no memory figure, and a word
            # on what it waits for until it has a line of its own.
            started = state not in _NOT_STARTED
            last_line = job.output.last_line if job.output else ""
            table.add_row(
                result.name,
                Text(state, style=_STYLE[state]),
                _elapsed(result.wall_s),
                format_size(self.runner.memory_of(result.name)) if started else "-",
                Text(last_line or _WAITING_FOR.get(state, ""), style="dim"),
            )
        return table


_NOT_STARTED = ("pending", "queued")
_WAITING_FOR = {
    "pending": "not started yet",
    "queued": "waiting for a slot or for memory to start",
    "waiting": "waiting for memory for its next NodeGroup",
}


def summary_table(result) -> Table:
    """One line per job, whatever the width: a long error is cut short here and
    given in full below the table (`summary_errors`)."""
    table = Table(title=f"wwrun run {result.run_id}", title_justify="left")
    table.add_column("job", no_wrap=True)
    table.add_column("state", no_wrap=True)
    table.add_column("exit", justify="right", no_wrap=True)
    table.add_column("time", justify="right", no_wrap=True)
    for key in _extra_columns(result):
        table.add_column(_EXTRA_COLUMNS[key], justify="right", no_wrap=True)
    # Wrappable for rich's layout (it narrows this column first), but each cell is
    # one line cut with an ellipsis.
    table.add_column("error")
    for job in result.jobs:
        extras = [_cell(job.extra.get(key)) for key in _extra_columns(result)]
        table.add_row(
            job.name,
            Text(job.state.value, style=_STYLE[job.state.value]),
            "-" if job.exit_code is None else str(job.exit_code),
            _elapsed(job.wall_s),
            *extras,
            Text(short_error(job.error), no_wrap=True, overflow="ellipsis"),
        )
    return table


def short_error(error: str | None) -> str:
    """The error's first line, marked when there is more (the summary's error column)."""
    if not error:
        return ""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[0] + (" …" if len(lines) > 1 else "")


def summary_errors(result) -> list[str]:
    """`name: full error` for each job that has one, below the summary table (later
    lines of an error indented under the first)."""
    return [f"{job.name}: " + job.error.strip().replace("\n", "\n  ") for job in result.jobs if job.error]


def summary_footer(result) -> str:
    line = f"{len(result.jobs)} job(s) in {result.wall_s:.1f}s, logs in {result.log_dir}"
    if result.root_cause:
        line += f"\nroot cause: {result.root_cause} (exit code {result.exit_code})"
    return escape(line)


_EXTRA_COLUMNS = {"peak_memory_bytes": "peak memory", "wait_s": "waited (s)"}


def _extra_columns(result) -> list[str]:
    return [key for key in _EXTRA_COLUMNS if any(key in job.extra for job in result.jobs)]


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, int):
        return format_size(value)
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _elapsed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%M:%S", time.gmtime(seconds)) if seconds < 3600 else f"{seconds / 3600:.1f}h"
