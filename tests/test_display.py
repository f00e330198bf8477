"""What the user sees: the summary after a run and the live table while it goes on."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import re
import select
import signal
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from rich.console import Console

from wwrun.display import (
    LiveDisplay,
    PlainDisplay,
    QuietDisplay,
    _print_rich_summary,
    short_error,
    summary_errors,
    summary_lines,
)
from wwrun.launcher import JobResult, JobState, RunResult

SCRIPTS = Path(__file__).parent / "scripts"
TOO_LARGE = (
    "JobTooLarge: job 'cnn' needs at least 1.1MiB (39.7KiB persistent + 1.1MiB activations) but the "
    "memory limit is 1.0MiB: it cannot fit even alone (use a smaller batch or model, or raise --memory-limit)"
)


def _job(name, state, code=None, error=None, **extra) -> JobResult:
    started = None if state in (JobState.PENDING, JobState.QUEUED) else 100.0
    ended = 102.0 if state.is_final and started else None
    return JobResult(name=name, script=f"{name}.py", module=None, args=[], cwd=".", state=state,
                     exit_code=code, started=started, ended=ended, error=error, extra=extra)


def _run(*jobs) -> RunResult:
    failed = [j for j in jobs if j.is_failed()]
    return RunResult(run_id="20260101-000000-abcd", device="cpu", policy="waterwave", jobs=list(jobs),
                     started=100.0, ended=103.0, log_dir="/tmp/wwrun_logs/x",
                     exit_code=failed[0].exit_code if failed else 0, root_cause=failed[0].name if failed else None)


def _console(width: int) -> tuple[Console, io.StringIO]:
    text = io.StringIO()
    return Console(file=text, width=width, highlight=False, soft_wrap=True), text


FAILED_RUN = _run(
    _job("mlp", JobState.SUCCEEDED, 0, peak_memory_bytes=300_000, wait_s=0.0),
    _job("cnn", JobState.FAILED, 1, TOO_LARGE, peak_memory_bytes=3_000_000, wait_s=1.6),
    _job("multi", JobState.FAILED, 1, "ValueError: bad value\nsecond line of it"),
)


def _check_errors_below(below: list[str]) -> None:
    assert below[0] == f"cnn: {TOO_LARGE}"
    assert below[1:3] == ["multi: ValueError: bad value", "  second line of it"]
    assert below[3:] == ["3 job(s) in 3.0s, logs in /tmp/wwrun_logs/x", "root cause: cnn (exit code 1)"]


def test_plain_summary_keeps_one_line_per_job_and_gives_full_errors_below():
    for width in (60, 100, 200):
        lines = summary_lines(FAILED_RUN, width)
        assert lines[0] == "wwrun run 20260101-000000-abcd"
        assert lines[1].split() == ["job", "state", "exit", "time", "peak", "allocated", "waited", "(s)", "error"]
        rows = lines[2:5]
        assert [row.split()[:3] for row in rows] == [["mlp", "succeeded", "0"], ["cnn", "failed", "1"],
                                                     ["multi", "failed", "1"]]
        assert all(len(line) <= max(width, 80) for line in lines[:5])
        assert rows[1].rstrip().endswith("…") and "JobTooLarge: job" in rows[1]
        assert "ValueError: bad" in rows[2] and (width < 100 or rows[2].endswith("ValueError: bad value …"))
        _check_errors_below(lines[5:])


def test_quiet_display_writes_the_plain_summary_off_a_terminal():
    text = io.StringIO()
    QuietDisplay(text).stop(FAILED_RUN)
    lines = text.getvalue().splitlines()
    assert lines[0] == "wwrun run 20260101-000000-abcd" and "│" not in text.getvalue()
    assert len(lines) == 5 + 5  # title, header, three jobs; three error lines, two of totals


def test_rich_summary_keeps_one_line_per_job_and_gives_full_errors_below():
    for width in (80, 120, 200):
        console, text = _console(width)
        _print_rich_summary(console, FAILED_RUN)
        lines = text.getvalue().splitlines()
        rows = [line for line in lines if line.startswith("│")]
        assert [row.split("│")[1].strip() for row in rows] == ["mlp", "cnn", "multi"]  # nothing wraps
        assert all(len(line) <= width for line in lines if line[:1] in "┏┃┡│└")
        cnn_row = next(row for row in rows if "cnn" in row)
        assert "JobTooLarg" in cnn_row and "…" in cnn_row  # cut to fit, not wrapped
        table_end = next(i for i, line in enumerate(lines) if line.startswith("└"))
        _check_errors_below(lines[table_end + 1:])


def test_short_error_is_the_first_line_marked_when_more_follows():
    assert short_error(None) == "" and short_error("") == ""
    assert short_error("ValueError: x") == "ValueError: x"
    assert short_error("\nTraceback:\n  line\n") == "Traceback: …"


def test_summary_errors_cover_every_job_with_an_error():
    result = _run(
        _job("a", JobState.FAILED, 1, "RuntimeError: boom"),
        _job("b", JobState.SUCCEEDED, 0),
        _job("c", JobState.CANCELLED, None, "not started: a failed (--halt soon)"),
    )
    assert summary_errors(result) == ["a: RuntimeError: boom", "c: not started: a failed (--halt soon)"]


def _live_table(jobs: list[JobResult], memory: dict[str, int], last_lines: dict[str, str]) -> str:
    console, text = _console(120)
    display = LiveDisplay(io.StringIO(), io.StringIO(), tee=False)
    display.runner = SimpleNamespace(
        jobs=[SimpleNamespace(result=j, output=SimpleNamespace(last_line=last_lines.get(j.name, "")))
              for j in jobs],
        memory_of=lambda name: memory.get(name, 0),
    )
    console.print(display._table())
    return text.getvalue()


def test_live_table_shows_queued_and_waiting_jobs_as_such():
    jobs = [
        _job("runs", JobState.RUNNING),
        _job("queued", JobState.QUEUED),
        _job("waits", JobState.WAITING),
        _job("later", JobState.PENDING),
    ]
    text = _live_table(jobs, {"runs": 3 * 2**20, "waits": 2**20}, {"runs": "step 10", "waits": "step 3"})
    rows = {line.split()[0]: line.split() for line in text.splitlines()[1:] if line.strip()}
    assert rows["runs"][1] == "running" and "3.0MiB" in rows["runs"] and "step 10" in " ".join(rows["runs"])
    # Not started: no memory figure ("0B"), and a word on what it waits for.
    assert rows["queued"][1:3] == ["queued", "-"] and rows["queued"][3] == "-"
    assert "waiting for a slot or for memory" in " ".join(rows["queued"])
    assert rows["later"][1] == "pending" and "0B" not in rows["later"]
    # Waiting for memory mid-run: its held memory and its own last line.
    assert rows["waits"][1] == "waiting" and "1.0MiB" in rows["waits"] and "step 3" in " ".join(rows["waits"])
    assert "0B" not in text


def test_live_table_shows_what_a_requeued_job_waits_for_not_its_earlier_attempt_s_line():
    requeued = _job("late", JobState.RUNNING)
    requeued.set_state(JobState.QUEUED, "does not fit beside the running jobs yet: starts again once one of them ends")
    text = _live_table([requeued], {}, {"late": "starting"})
    assert "does not fit beside the running jobs yet" in text and "starting" not in text
    requeued.set_state(JobState.RUNNING, "ignored: a running job waits for nothing")
    assert requeued.reason is None and "starting" in _live_table([requeued], {}, {"late": "starting"})


def test_live_table_leaves_the_terminal_s_last_column_free():
    """After a row as wide as the terminal, the ^C the terminal echoes wraps the
    cursor to a new line, and each redraw then left a stale header above."""
    display = LiveDisplay(io.StringIO(), io.StringIO(), tee=False)
    display.console = Console(file=io.StringIO(), width=80, force_terminal=True, color_system=None)
    display.runner = SimpleNamespace(
        jobs=[SimpleNamespace(result=_job("lstm", JobState.RUNNING), output=SimpleNamespace(last_line="x" * 200))],
        memory_of=lambda name: 2**20,
    )
    display.console.print(display._table())
    lines = display.console.file.getvalue().splitlines()
    assert len(lines) == 2 and "lstm" in lines[1]
    assert max(len(line) for line in lines) == 78  # room for the two of "^C"


def test_plain_lines_survive_a_stream_that_cannot_encode_them():
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="ascii")
    QuietDisplay(stream).note("café … done")
    stream.flush()
    assert raw.getvalue() == b"[wwrun] caf? ? done\n"


def test_a_run_off_a_terminal_loads_no_more_than_it_needs(tmp_path):
    # Every module loaded costs each run's start-up (benchmarks/launcher_overhead.py);
    # the job runs in wwrun's process, so it sees what wwrun loaded.
    job = tmp_path / "modules.py"
    job.write_text("import sys\n"
                   "print(sorted(m for m in ('rich', 'psutil', 'matplotlib', 'wwrun.memory.engine') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path / "logs"), str(job)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "[modules] []" in done.stdout.splitlines()
    assert re.search(r"^job +state +exit +time +peak allocated +error$", done.stderr, re.M)  # the plain summary


def test_a_prompt_stays_on_its_row_until_another_job_writes():
    out, err = io.StringIO(), io.StringIO()
    display = PlainDisplay(out, err)
    display.prompt("ask", "stdout", "name? ")
    assert out.getvalue() == "[ask] name? "  # the user types after it
    display.line("ask", "stdout", "hello Bob")  # after their Enter: a row of its own
    display.prompt("ask", "stdout", "(Pdb) ")
    display.line("other", "stdout", "step 5")  # the prompt's row is ended first
    display.prompt("ask", "stdout", "(Pdb) ")
    display.note("other: succeeded")
    assert out.getvalue() == "[ask] name? [ask] hello Bob\n[ask] (Pdb) \n[other] step 5\n[ask] (Pdb) \n"
    assert err.getvalue() == "[wwrun] other: succeeded\n"


def test_the_live_table_gives_way_to_plain_lines_once_a_job_reads_the_terminal():
    out, err = io.StringIO(), io.StringIO()
    display = LiveDisplay(out, err, tee=False)
    listing = SimpleNamespace(tail=["> train.py(7)<module>()", "-> loss.backward()"], last_line="(Pdb) ")
    display.start(SimpleNamespace(jobs=[SimpleNamespace(result=_job("dbg", JobState.RUNNING), output=listing)],
                                  memory_of=lambda name: 0))
    display.line("dbg", "stdout", "-> loss.backward()")  # in the table only
    assert out.getvalue() == ""
    display.prompt("dbg", "stdout", "(Pdb) ")
    display.line("dbg", "stdout", "tensor(0.5)")
    display.note("a note")
    assert out.getvalue() == "[dbg] > train.py(7)<module>()\n[dbg] -> loss.backward()\n[dbg] (Pdb) [dbg] tensor(0.5)\n"
    assert "dbg reads the terminal: job lines are printed as they come" in err.getvalue()
    assert err.getvalue().endswith("[wwrun] a note\n")


def test_quiet_shows_a_job_s_prompt_and_its_lines_from_then_on():
    """--quiet printed nothing but the summary: a job waiting at `input()` looked hung."""
    out, err = io.StringIO(), io.StringIO()
    display = QuietDisplay(err, out)
    listing = SimpleNamespace(tail=["Name:"], last_line="Name:")
    display.start(SimpleNamespace(jobs=[SimpleNamespace(result=_job("ask", JobState.RUNNING), output=listing)]))
    display.line("ask", "stdout", "Name:")
    display.note("a detail", important=False)
    assert out.getvalue() == err.getvalue() == ""
    display.prompt("ask", "stdout", "")  # `print("Name:"); input()`
    display.line("ask", "stdout", "hello Bob")
    display.note("ask: succeeded", important=False)
    assert out.getvalue() == "[ask] Name:\n[ask] hello Bob\n"
    assert "ask reads the terminal" in err.getvalue() and err.getvalue().endswith("[wwrun] ask: succeeded\n")


def _take_terminal() -> None:
    """In the child: its stdin's terminal becomes its controlling one (/dev/tty)."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class _Terminal:
    """`python -m wwrun args` with its stdin, stdout and stderr on a pseudo-terminal
    (120x40, so wwrun draws its live table) that is its controlling terminal, as a user
    at a terminal runs it."""

    def __init__(self, args: list[str], cwd: Path):
        self.main, side = pty.openpty()
        fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        self.process = subprocess.Popen([sys.executable, "-m", "wwrun", *args], stdin=side, stdout=side,
                                        stderr=side, cwd=cwd, env={**os.environ, "TERM": "xterm-256color"},
                                        start_new_session=True, preexec_fn=_take_terminal)
        os.close(side)
        self.screen = bytearray()

    def read_until(self, pattern: bytes, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        while pattern not in self.screen:
            if time.monotonic() > deadline:
                pytest.fail(f"no {pattern!r} on the terminal after {seconds} s: {bytes(self.screen[-2000:])!r}")
            if select.select([self.main], [], [], 1.0)[0]:
                try:
                    chunk = os.read(self.main, 65536)
                except OSError:  # the terminal's other side closed: wwrun has ended
                    chunk = b""
                if not chunk:
                    pytest.fail(f"wwrun ended without {pattern!r}: {bytes(self.screen[-2000:])!r}")
                self.screen.extend(chunk)

    def close(self) -> str:
        """What the terminal showed, lines ended by newlines."""
        if self.process.poll() is None:
            self.process.kill()
        os.close(self.main)
        return bytes(self.screen).decode().replace("\r\n", "\n")


def test_a_job_asking_at_a_terminal_shows_its_prompt_and_what_it_printed_before(tmp_path):
    """`input()` or `breakpoint()` in a lone job run from a terminal: the prompt and the
    job's lines are on the screen, where the live table showed only the last line."""
    terminal = _Terminal(["--log-dir", str(tmp_path), str(SCRIPTS / "asks.py")], tmp_path)
    try:
        terminal.read_until(b"[asks] name? ", 300)  # the first run of a session may build the C++ parts
        os.write(terminal.main, b"Bob\n")
        terminal.read_until(b"job(s) in", 120)
        assert terminal.process.wait(timeout=60) == 0
    finally:
        lines = terminal.close()
    assert "[asks] listing before the prompt\n" in lines
    assert "[asks] name? Bob\n[asks] hello Bob\n" in lines  # the terminal echoes what was typed


@pytest.mark.parametrize(("script", "prompt", "interrupted"), [
    ("asks.py", b"[asks] name? ", "[asks] interrupted at the prompt\n"),
    ("asks_secret.py", b"token: ", "[asks_secret] interrupted at the secret\n"),  # getpass
])
def test_ctrl_c_reaches_a_job_waiting_at_a_prompt(tmp_path, script, prompt, interrupted):
    """Under `python` a Ctrl-C ends an `input()` or a `getpass` at once; a job's read
    blocked in C held it back until the user's Enter, and the job was abandoned after
    the grace period."""
    terminal = _Terminal(["--log-dir", str(tmp_path), str(SCRIPTS / script)], tmp_path)
    try:
        terminal.read_until(prompt, 300)
        terminal.process.send_signal(signal.SIGINT)
        terminal.read_until(b"job(s) in", 120)
        assert terminal.process.wait(timeout=60) == 130
    finally:
        lines = terminal.close()
    assert interrupted in lines
    assert "did not stop within the grace period" not in lines


def test_a_job_reading_the_terminal_to_its_end_gets_the_screen_too(tmp_path):
    """`sys.stdin.read()` reads through FileIO's own `readall`, which skipped the hook
    that shows the job's prompt: the table stayed, hiding what the user typed."""
    terminal = _Terminal(["--log-dir", str(tmp_path), str(SCRIPTS / "reads_all.py")], tmp_path)
    try:
        terminal.read_until(b"reads the terminal", 300)
        os.write(terminal.main, b"a\nb\n\x04")  # Ctrl-D: end of file
        terminal.read_until(b"job(s) in", 120)
        assert terminal.process.wait(timeout=60) == 0
    finally:
        lines = terminal.close()
    assert "[reads_all] type lines, then Ctrl-D\n" in lines and "[reads_all] got 'a\\nb\\n'\n" in lines


def test_a_job_asks_for_a_secret_at_the_terminal_as_alone(tmp_path):
    """`getpass.getpass` reads /dev/tty itself, past the job's stdin: the live table drew
    over its prompt, and a Ctrl-C waited for the user's Enter (the read blocked in C)."""
    terminal = _Terminal(["--log-dir", str(tmp_path), str(SCRIPTS / "asks_secret.py")], tmp_path)
    try:
        terminal.read_until(b"token: ", 300)
        os.write(terminal.main, b"s3cret\n")
        terminal.read_until(b"job(s) in", 120)
        assert terminal.process.wait(timeout=60) == 0
    finally:
        lines = terminal.close()
    assert "[asks_secret] before the secret\n" in lines  # the live table gave way
    assert "[asks_secret] got 's3cret'\n" in lines
    # Not echoed as typed: only the script's own line says it (the live table's "last
    # line" column may show that line again, when the table is drawn before the run ends).
    assert "s3cret" not in lines.replace("got 's3cret'", ""), lines

