"""What the user sees while a run goes on, and the summary after.

- On a terminal: a live table (rich), one row per job: state, elapsed time, its
  allocated memory now when known, the job's last output line (for a queued job,
  what it waits for). `--tee` also prints every line above it.
- Not on a terminal (CI logs, pipes): plain `[name] line` lines, nothing redrawn,
  and a plain-text summary; rich is not even imported (it would cost every run's
  start-up about 50 ms: benchmarks/launcher_overhead.py).
- `--quiet`: the summary only.
- A job that reads the terminal (`input()`, pdb) needs the screen: its prompt is
  shown as it waits, and from then on the live table (or --quiet's silence) gives
  way to plain lines.

The summary keeps one line per job, whatever the width; the full error of each job
that has one follows it (`name: error`).

Job stdout lines go to stdout and job stderr lines to stderr; the launcher's own notes
and the summary go to stderr, so `--events -` leaves stdout to the event stream
(job lines then go to stderr too).
"""

from __future__ import annotations

import os
import shutil
import threading
import time

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


def make_display(config: LaunchConfig):
    out, err = isolation.original_stdout(), isolation.original_stderr()
    if config.events == "-":
        out = err
    if config.quiet:
        return QuietDisplay(err, out)
    if _is_terminal(err):
        return LiveDisplay(out, err, tee=config.tee)
    return PlainDisplay(out, err)


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, OSError, ValueError):
        return False


class _Lines:
    """Whole lines written to one stream, at once; silent once its reader went away
    (`wwrun ... | head`): the jobs go on and their logs keep everything."""

    def __init__(self, stream):
        self.stream = stream
        self.gone = False

    def write(self, text: str, end: str = "\n") -> None:
        if self.gone:
            return
        try:
            try:
                self.stream.write(text + end)
            except UnicodeEncodeError:  # a stream that cannot take every character (LANG=C)
                encoding = getattr(self.stream, "encoding", None) or "ascii"
                self.stream.write(text.encode(encoding, "replace").decode(encoding) + end)
            self.stream.flush()
        except BrokenPipeError:
            self.gone = True
            try:  # what is still buffered goes nowhere, not into an error at exit
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            except (OSError, ValueError):
                pass


class QuietDisplay:
    """The summary only: plain text, or a rich table on a terminal. Once a job reads
    the terminal, plain lines: the user answers a question they can see."""

    shows_lines = False
    """Whether the user has seen the jobs' lines so far (else a prompt replays the tail)."""

    def __init__(self, err, out=None):
        self.out = err if out is None else out
        self.err = _Lines(err)
        self.runner = None
        self._plain: PlainDisplay | None = None
        """Once a job read the terminal: every line as it comes."""
        self._stopped = False

    def start(self, runner) -> None:
        self.runner = runner

    def line(self, job: str, stream: str, text: str) -> None:
        if self._plain is not None:
            self._plain.line(job, stream, text)

    def prompt(self, job: str, stream: str, text: str) -> None:
        """The job is about to read the terminal, after writing `text` (no newline)."""
        # Silence or a table redrawn under a prompt would hide it, what the job printed
        # before it (pdb's listing) and what the user types: the screen becomes plain lines.
        if self._stopped:  # an abandoned job, still reading after the summary
            return
        if self._plain is None:
            self._give_way()
            self._plain = PlainDisplay(self.out, self.err.stream)
            self._plain.note(f"{job} reads the terminal: job lines are printed as they come from now on")
            if not self.shows_lines:  # what it printed before its prompt (pdb's listing)
                output = next((j.output for j in self.runner.jobs if j.result.name == job), None)
                for line in output.tail if output else ():
                    self._plain.line(job, "stdout", line)
        self._plain.prompt(job, stream, text)

    def _give_way(self) -> None:
        """Clear the screen for plain lines."""

    def state(self, result) -> None:
        if self._plain is not None:
            self._plain.state(result)

    def note(self, text: str, important: bool = True) -> None:
        """A line from the launcher; only `important` ones with --quiet."""
        if self._plain is not None:
            self._plain.note(text, important)
        elif important:
            self.err.write(f"[wwrun] {text}")

    def explain(self, text: str) -> None:
        self.err.write(text)

    def stop(self, result) -> None:
        self._stopped = True
        if self._plain is not None:
            self._plain.end_prompt_row()
        if _is_terminal(self.err.stream):
            _print_rich_summary(_console(self.err.stream), result)
            return
        for line in summary_lines(result, shutil.get_terminal_size((100, 24)).columns):
            self.err.write(line)


class PlainDisplay(QuietDisplay):
    """Prefixed lines as they come; a line per job state change."""

    shows_lines = True

    def __init__(self, out, err):
        super().__init__(err)
        self.out = self.err if out is err else _Lines(out)
        self._lock = threading.Lock()
        self._shown: dict[str, str] = {}
        self._prompt_open: tuple[str, str] | None = None
        """(job, stream) of a prompt shown on the screen's last row, not yet ended."""

    def note(self, text: str, important: bool = True) -> None:
        with self._lock:
            self._end_prompt_row(None)
            self.err.write(f"[wwrun] {text}")

    def line(self, job: str, stream: str, text: str) -> None:
        lines = self.out if stream == "stdout" else self.err
        with self._lock:
            self._end_prompt_row((job, stream))
            lines.write(f"[{job}] {text}")

    def prompt(self, job: str, stream: str, text: str) -> None:
        if not text:  # it asked on a line of its own (`print("Name:"); input()`)
            return
        lines = self.out if stream == "stdout" else self.err
        with self._lock:
            self._end_prompt_row((job, stream))
            lines.write(f"[{job}] {text}", end="")
            self._prompt_open = (job, stream)

    def _end_prompt_row(self, writer: tuple[str, str] | None) -> None:
        """Before another job's line (or a note), end the row a prompt left open; the
        prompting job's own next line comes after the user's Enter, on a row of its own."""
        if self._prompt_open is not None and self._prompt_open != writer:
            (self.out if self._prompt_open[1] == "stdout" else self.err).write("")
        self._prompt_open = None

    def state(self, result) -> None:
        # Waits for memory come and go with every NodeGroup: the live table and the
        # events show them, a line each would drown the log.
        if result.state.value in ("pending", "waiting") or self._shown.get(result.name) == result.state.value:
            return
        self._shown[result.name] = result.state.value
        detail = f" (exit {result.exit_code}, {result.wall_s:.1f}s)" if result.state.is_final and result.wall_s else ""
        if result.reason:
            detail = f": {result.reason}"
        with self._lock:
            self._end_prompt_row(None)
            self.err.write(f"[wwrun] {result.name}: {result.state.value}{detail}")

    def stop(self, result) -> None:
        self.end_prompt_row()
        super().stop(result)

    def end_prompt_row(self) -> None:
        with self._lock:
            self._end_prompt_row(None)


class LiveDisplay(QuietDisplay):
    """A live table redrawn in place; lines above it with --tee."""

    def __init__(self, out, err, tee: bool):
        super().__init__(err, out)
        self.console = _console(err)
        self.tee = tee
        self.shows_lines = tee
        self._live = None

    def start(self, runner) -> None:
        from rich.live import Live

        self.runner = runner
        # Never redirect sys.stdout/err: they are the per-job views (wwrun.isolation).
        self._live = Live(
            get_renderable=self._table, console=self.console, refresh_per_second=4, transient=True,
            redirect_stdout=False, redirect_stderr=False,
        )
        self._live.start()

    def line(self, job: str, stream: str, text: str) -> None:
        from rich.text import Text

        if self._plain is not None:
            self._plain.line(job, stream, text)
        elif self.tee and self._live is not None:
            self._live.console.print(Text.assemble((f"[{job}] ", "bold"), text))

    def _give_way(self) -> None:
        if self._live is not None:
            self._live.stop()

    def note(self, text: str, important: bool = True) -> None:
        if self._plain is not None:
            self._plain.note(text, important)
            return
        self.console.print(f"[wwrun] {text}", markup=False)

    def explain(self, text: str) -> None:
        self.console.print(text, markup=False)

    def stop(self, result) -> None:
        self._stopped = True
        if self._plain is not None:
            self._plain.end_prompt_row()
        elif self._live is not None:
            self._live.stop()
        _print_rich_summary(self.console, result)

    def _table(self):
        from rich.table import Table
        from rich.text import Text

        # Two columns short of the terminal: after a full last row, the "^C" (or a
        # key) the terminal echoes wraps the cursor to a new line, and each redraw
        # then starts one row low, leaving a stale row above the table.
        table = Table(box=None, pad_edge=False, expand=True, width=max(self.console.width - 2, 1))
        table.add_column("job", no_wrap=True, style="bold")
        table.add_column("state", no_wrap=True)
        table.add_column("elapsed", justify="right", no_wrap=True)
        table.add_column("allocated", justify="right", no_wrap=True)
        table.add_column("last line", no_wrap=True, overflow="ellipsis", ratio=1)
        for job in self.runner.jobs:
            result = job.result
            state = result.state.value
            # A job that has not started holds nothing: no memory figure, and a word
            # on what it waits for until it has a line of its own.
            started = state not in _NOT_STARTED
            last_line = job.output.last_line if job.output else ""
            if state == "queued" or not last_line:  # a queued job's last line is an earlier attempt's
                last_line = result.reason or _WAITING_FOR.get(state, last_line)
            table.add_row(
                result.name,
                Text(state, style=_STYLE[state]),
                _elapsed(result.wall_s),
                format_size(self.runner.memory_of(result.name)) if started else "-",
                Text(last_line, style="dim"),
            )
        return table


_NOT_STARTED = ("pending", "queued")
_WAITING_FOR = {
    "pending": "not started yet",
    "queued": "waiting for a slot or for memory to start",
    "waiting": "waiting for memory for its next NodeGroup",
}


def _console(stream):
    """A rich console on `stream` that falls silent when its reader goes away."""
    from rich.console import Console

    class _Console(Console):
        def on_broken_pipe(self) -> None:
            # rich would raise SystemExit; the jobs go on, their logs keep everything.
            self.quiet = True

    return _Console(file=stream, highlight=False, soft_wrap=True)


# -- the summary: one set of cells, drawn as plain text or as a rich table ---------------

def _summary_cells(result) -> tuple[list[str], list[list[str]]]:
    """The columns' headers and each job's cells; the error cell is its short form."""
    extra = [key for key in _EXTRA_COLUMNS if any(key in job.extra for job in result.jobs)]
    headers = ["job", "state", "exit", "time", *(_EXTRA_COLUMNS[key] for key in extra), "error"]
    rows = [
        [
            job.name,
            job.state.value,
            "-" if job.exit_code is None else str(job.exit_code),
            _elapsed(job.wall_s),
            *(_cell(job.extra.get(key), key) for key in extra),
            short_error(job.error),
        ]
        for job in result.jobs
    ]
    return headers, rows


_LEFT = {"job", "state", "error"}  # the other columns are figures, right-aligned


def summary_lines(result, width: int = 100) -> list[str]:
    """The summary as plain text: one line per job whatever `width` (the error cut
    with an ellipsis to fit), then each job's full error, then the totals."""
    headers, rows = _summary_cells(result)
    sizes = [max(len(cell) for cell in column) for column in zip(headers, *rows)]
    room = max(20, width - sum(sizes[:-1]) - 2 * (len(sizes) - 1))
    lines = [f"wwrun run {result.run_id}"]
    for cells in [headers, *rows]:
        cells = [*cells[:-1], _cut(cells[-1], room)]
        padded = [cell.ljust(size) if header in _LEFT else cell.rjust(size)
                  for header, cell, size in zip(headers, cells, sizes)]
        lines.append("  ".join(padded).rstrip())
    return lines + summary_errors(result) + summary_footer(result).splitlines()


def summary_table(result):
    """The summary as a rich table (terminals): one line per job, whatever the width."""
    from rich.table import Table
    from rich.text import Text

    headers, rows = _summary_cells(result)
    table = Table(title=f"wwrun run {result.run_id}", title_justify="left")
    for header in headers[:-1]:
        table.add_column(header, no_wrap=True, justify="left" if header in _LEFT else "right")
    # Wrappable for rich's layout (it narrows this column first), but each cell is
    # one line cut with an ellipsis.
    table.add_column(headers[-1])
    for cells in rows:
        state = cells[1]
        table.add_row(cells[0], Text(state, style=_STYLE[state]), *cells[2:-1],
                      Text(cells[-1], no_wrap=True, overflow="ellipsis"))
    return table


def _print_rich_summary(console, result) -> None:
    console.print(summary_table(result))
    for line in [*summary_errors(result), *summary_footer(result).splitlines()]:
        console.print(line, markup=False)


def short_error(error: str | None) -> str:
    """The error's first line, marked when there is more (the summary's error column)."""
    if not error:
        return ""
    lines = [line.strip() for line in error.strip().splitlines() if line.strip()]
    return lines[0] + (" …" if len(lines) > 1 else "")


def summary_errors(result) -> list[str]:
    """The lines below the summary table: `name: full error` for each job that has
    one, later lines of an error indented under the first."""
    lines = []
    for job in result.jobs:
        if job.error:
            first, *rest = job.error.strip().splitlines()
            lines += [f"{job.name}: {first}", *(f"  {line}" for line in rest)]
    return lines


def write_collision(path: str, jobs: list[str]) -> str:
    """What the live output, the summary and `wwrun show` say of jobs of one run that
    opened one file for writing (`isolation.WriteWatch`)."""
    both = "both" if len(jobs) == 2 else "all"
    return (f"jobs {', '.join(jobs[:-1])} and {jobs[-1]} {both} write {path}: the last write wins; "
            "give each job its own path ({job} in its args is its name, or cwd: runs/{job})")


def summary_footer(result) -> str:
    line = f"{len(result.jobs)} job(s) in {result.wall_s:.1f}s, logs in {result.log_dir}"
    for clash in result.extra.get("write_collisions", ()):
        line += f"\nwarning: {write_collision(clash['path'], clash['jobs'])}"
    if result.root_cause:
        line += f"\nroot cause: {result.root_cause} (exit code {result.exit_code})"
    return line


# The report's fields, named as the README names them: peak_memory_bytes is allocated
# bytes (what tensors hold, as the allocator counts them), never reserved.
_EXTRA_COLUMNS = {"engine": "engine", "peak_memory_bytes": "peak allocated", "wait_s": "waited (s)"}


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def _cell(value, key: str | None = None) -> str:
    if value is None:
        return "-"
    if key == "engine":  # an index (wwrun.scale), not bytes
        return str(value)
    if isinstance(value, int):
        return format_size(value)
    return f"{value:.1f}" if isinstance(value, float) else str(value)


def _elapsed(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return time.strftime("%M:%S", time.gmtime(seconds)) if seconds < 3600 else f"{seconds / 3600:.1f}h"
