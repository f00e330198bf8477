"""Job output: every job writes into its own pair of pipes; one pump thread drains
them all into the job's log files and hands complete lines to the display (and, as a
job is about to read the terminal, the prompt it wrote before: `Pump.prompt`).

Pipes rather than Python-level buffers, because a job's output comes from more than
its own thread: threads it starts, forked DataLoader workers (they inherit the fds)
and spawned or `subprocess` children (their stdout/stderr are pointed at the pipes,
see `isolation._fork_exec`). All of it lands in the job's logs, in order.

On-disk layout (like torchrun's)::

    <log_dir>/<run_id>/recipe.yaml            the resolved recipe
    <log_dir>/<run_id>/<job>/stdout.log
    <log_dir>/<run_id>/<job>/stderr.log
    <log_dir>/<run_id>/<job>/error.json       only when the job failed
    <log_dir>/<run_id>/<job>/attempt_N/...    instead, when the job may be retried
    <log_dir>/<run_id>/report.json            the run's report (rewritten while it runs)
    <log_dir>/<run_id>/crash.log              only when the process died of a fatal signal
    <log_dir>/latest -> <run_id>              the last run started
"""

from __future__ import annotations

import collections
import fcntl
import io
import os
import re
import selectors
import struct
import termios
import threading
from collections.abc import Callable
from pathlib import Path

from wwrun import forksafe

LineSink = Callable[[str, str, str], None]
"""on_line(job_name, stream ('stdout'|'stderr'), line without its newline)"""

_CHUNK = 1 << 16
TAIL_LINES = 10
_SHOWN_BYTES = 1024
"""Of a line still being written, what becomes the table's last line (wider than any row)."""

# Terminal control sequences: CSI (cursor moves, colours: ESC [ ... final byte), OSC
# (titles, links: ESC ] ... BEL or ESC \\), other ESC pairs, and the C0/C1 control
# characters left (backspace, bell; tabs stay). Newlines and carriage returns are
# split on before this applies.
_CONTROL = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]|\x1b\][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -/]*[0-~]?"
    r"|\x9b[0-?]*[ -/]*[@-~]|[\x00-\x08\x0b-\x1f\x7f-\x9f]"
)


def printable(line: str) -> str:
    """`line` without terminal control sequences: what the display, the report and
    `wwrun show` print of a job's line can neither move the cursor nor recolour the
    screen (`print("tick\\x1b[A")` in a job leaves the live table where it is)."""
    return _CONTROL.sub("", line) if not line.isprintable() else line


class JobOutput:
    """One job's stdout and stderr: the write ends for the job, the log files for the pump."""

    def __init__(self, name: str, folder: Path):
        self.name = name
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)
        self._read_fds: dict[int, str] = {}
        self._logs: dict[str, io.BufferedWriter] = {}
        self._partial: dict[str, bytes] = {}
        self._shown: dict[str, int] = {}
        """Of each partial line, the bytes the display already showed as a prompt."""
        self.fds: dict[str, int] = {}
        for stream in ("stdout", "stderr"):
            read_fd, write_fd = os.pipe()
            self._read_fds[read_fd] = stream
            self.fds[stream] = write_fd
            self._logs[stream] = open(folder / f"{stream}.log", "wb")  # noqa: SIM115
            self._partial[stream] = b""
            self._shown[stream] = 0
        # Line-buffered text streams over the pipes: what the job sees as sys.stdout/err.
        self.stdout = self._text_stream("stdout")
        self.stderr = self._text_stream("stderr")
        self.last_line = ""
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        """The job's last lines (stdout and stderr), for the running report."""

    def _text_stream(self, stream: str) -> io.TextIOWrapper:
        raw = io.FileIO(self.fds[stream], "w", closefd=False)
        return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", line_buffering=True)

    def release_writers(self) -> None:
        """The job has ended: its write ends now lead to /dev/null. Its pipes reach end
        of file (the pump then closes them and the log files), so an ended job holds
        two descriptors, not six; and a thread of the job still writing cannot reach
        another job's pipe through a reused descriptor number, as closing would allow."""
        for text in (self.stdout, self.stderr):
            try:
                text.flush()
            except (OSError, ValueError):
                pass
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            for fd in self.fds.values():
                if fd >= 0:
                    os.dup2(null, fd)
        finally:
            os.close(null)

    def close_writers(self) -> None:
        """The job has ended: flush and close the launcher's write ends (children may
        still hold theirs until they exit)."""
        for text in (self.stdout, self.stderr):
            try:
                text.flush()
            except (OSError, ValueError):
                pass
        for stream, fd in list(self.fds.items()):
            try:
                os.close(fd)
            except OSError:
                pass
            self.fds[stream] = -1

    def _feed(self, stream: str, data: bytes, on_line: LineSink) -> None:
        # The logs hold the bytes as written, as `python script.py 2> file` would.
        self._logs[stream].write(data)
        self._logs[stream].flush()
        # Progress bars redraw with '\r': each redraw counts as a line for the display.
        text = self._partial[stream] + data.replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *lines, self._partial[stream] = text.split(b"\n")
        for raw in lines:
            self._line(stream, raw, on_line)
        # A bar being redrawn is the line a terminal shows now: the table shows it too,
        # before its next '\r' ends it (a bar that clears itself leaves the last line).
        # Its start only, as the table shows it: a line growing a byte at a time
        # (progress dots) is not decoded and filtered whole again at every write.
        current = printable(self._partial[stream][:_SHOWN_BYTES].decode("utf-8", "replace"))
        if current.strip():
            self.last_line = current

    def _line(self, stream: str, raw: bytes, on_line: LineSink) -> None:
        line = printable(raw.decode("utf-8", "backslashreplace"))
        if line.strip():
            self.last_line = line
            self.tail.append(line)
        # A line begun by a prompt the display showed goes on past what the user typed
        # (their Enter ended the screen's row): only its rest, if any, is still to show
        # (none for a prompt the job's end left unended, or a progress bar shown beside
        # a prompt that then redrew).
        shown, self._shown[stream] = self._shown[stream], 0
        if not shown:
            on_line(self.name, stream, line)
        elif len(raw) > shown:
            on_line(self.name, stream, printable(raw[shown:].decode("utf-8", "backslashreplace")))

    def _prompt(self, on_prompt: LineSink) -> None:
        """The job is about to wait for the user: hand the display what each stream
        holds of a line not yet ended (a prompt: `input("name? ")`), stdout's last, as
        prompts go there; an empty one when neither holds any (`print("Name:");
        input()`), so that the display still gives the user the screen."""
        rests = {stream: self._partial[stream][self._shown[stream]:] for stream in ("stderr", "stdout")}
        for stream in [stream for stream, rest in rests.items() if rest] or ["stdout"]:
            self._shown[stream] = len(self._partial[stream])
            on_prompt(self.name, stream, printable(rests[stream].decode("utf-8", "backslashreplace")))

    def _finish(self, stream: str, on_line: LineSink) -> None:
        rest = self._partial[stream]
        if rest:
            self._partial[stream] = b""
            self._line(stream, rest, on_line)
        self._logs[stream].close()


class Pump:
    """One thread draining every job's pipes (a selector over the read ends)."""

    def __init__(self, on_line: LineSink, on_prompt: LineSink | None = None):
        self._display = on_line
        self._display_prompt = on_prompt
        self._requests: list[tuple[JobOutput, threading.Event | None]] = []
        """Jobs whose pipes to read empty now: then show the job's prompt (None) or set
        the event."""
        self._selector = selectors.DefaultSelector()
        self._lock = forksafe.Lock()
        self._open = 0
        self._wake_r, self._wake_w = os.pipe()
        self._selector.register(self._wake_r, selectors.EVENT_READ, None)
        self._thread = threading.Thread(target=self._run, name="wwrun-pump", daemon=True)
        self._stopping = False
        self._until_drained = False
        self._thread.start()

    def add(self, output: JobOutput) -> None:
        with self._lock:
            for fd, stream in output._read_fds.items():
                self._selector.register(fd, selectors.EVENT_READ, (output, stream))
                self._open += 1
        os.write(self._wake_w, b"x")

    def prompt(self, output: JobOutput) -> None:
        """`output`'s job is about to read the terminal: what it wrote before (a prompt)
        is shown now, not when a newline ends it. Called from the job's thread, after
        its write: the pump reads the job's pipes empty, then shows what is left."""
        if self._display_prompt is not None:
            self._request(output, None)

    def settle(self, output: JobOutput, timeout: float = 1.0) -> bool:
        """Wait until the pump has read what `output`'s job wrote so far (at most
        `timeout` s: a display stalled by a paused terminal), so that its last lines
        are shown before the line saying it ended. False if it did not in time."""
        done = threading.Event()
        self._request(output, done)
        return self._thread.is_alive() and done.wait(timeout)

    def _request(self, output: JobOutput, done: threading.Event | None) -> None:
        with self._lock:
            self._requests.append((output, done))
        os.write(self._wake_w, b"x")

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._stopping and self._open == 0:
                    return
                drain = self._stopping and self._until_drained
                requests, self._requests = self._requests, []
            for output, done in requests:
                self._read_now(output)
                if done is None:
                    output._prompt(self._on_prompt)
                else:
                    done.set()
            events = self._selector.select(timeout=0 if drain else 0.5)
            if drain and not events:
                self._finish_open()
                return
            for key, _ in events:
                if key.data is None:
                    os.read(self._wake_r, 4096)
                    continue
                output, stream = key.data
                try:
                    data = os.read(key.fd, _CHUNK)
                except OSError:
                    data = b""
                if data:
                    output._feed(stream, data, self._on_line)
                    continue
                with self._lock:  # end of file: every writer has closed
                    self._selector.unregister(key.fd)
                    os.close(key.fd)
                    self._open -= 1
                output._finish(stream, self._on_line)

    def _read_now(self, output: JobOutput) -> None:
        """Read what `output`'s pipes hold now (what the job wrote before it asked), and
        no more: a job that goes on writing must not keep the pump from the others."""
        with self._lock:
            keys = [key for key in self._selector.get_map().values()
                    if key.data is not None and key.data[0] is output]
        for key in keys:
            try:
                pending = struct.unpack("i", fcntl.ioctl(key.fd, termios.FIONREAD, b"\0\0\0\0"))[0]
            except OSError:
                continue
            while pending > 0:
                try:
                    data = os.read(key.fd, min(pending, _CHUNK))
                except OSError:
                    break
                if not data:  # end of file: the loop's next select sees it too
                    break
                pending -= len(data)
                output._feed(key.data[1], data, self._on_line)

    def _finish_open(self) -> None:
        """Every pipe drained but some still open (a helper holds a copy): their jobs'
        last lines and logs are finished now. The read ends stay open, so that the
        helper's later writes fail no one (they are read by no one)."""
        with self._lock:
            keys = [key for key in self._selector.get_map().values() if key.data is not None]
            for key in keys:
                self._selector.unregister(key.fd)
            self._open = 0
        for key in keys:
            output, stream = key.data
            output._finish(stream, self._on_line)

    def _on_line(self, job: str, stream: str, line: str) -> None:
        self._show(self._display, job, stream, line)

    def _on_prompt(self, job: str, stream: str, text: str) -> None:
        self._show(self._display_prompt, job, stream, text)

    def _show(self, sink: LineSink | None, job: str, stream: str, text: str) -> None:
        """Hand a line (or a prompt) to the display. If the display fails (its reader
        went away: `wwrun ... | head`), stop showing anything but keep draining: a pump
        that died would leave the jobs blocked on full pipes. The logs keep everything."""
        if sink is None:
            return
        try:
            sink(job, stream, text)
        except (OSError, ValueError):
            self._display = self._display_prompt = None

    def close(self, timeout: float = 5.0, until_drained: bool = False) -> None:
        """Wait until every pipe reached end of file (all writers closed), then stop;
        with `until_drained`, only until every pipe is read empty (its only writers left
        live on with the process). After `timeout` seconds whatever is left is
        abandoned (a lingering child)."""
        with self._lock:
            self._stopping = True
            self._until_drained = until_drained
        os.write(self._wake_w, b"x")
        self._thread.join(timeout)


def find_run(run: str | None = None, log_root: str = "wwrun_logs") -> Path:
    """A past run's folder: `run` is a run id under `log_root`, a folder, or None for
    the latest run (`<log_root>/latest`). Raises FileNotFoundError."""
    root = Path(log_root)
    if run is None:
        folder = root / "latest"
    elif Path(run).is_dir() and (Path(run) / "report.json").exists():
        folder = Path(run)
    else:
        folder = root / run
    if not (folder / "report.json").is_file():
        what = f"run {run!r}" if run else "no run yet"
        raise FileNotFoundError(f"{what}: no report.json under {folder}")
    return folder.resolve()


def show_run(run: str | None = None, log_root: str = "wwrun_logs", file=None) -> int:
    """Print a past run's summary from its report.json (and crash.log, when the
    process crashed): `wwrun show [RUN]`. Returns 0, or 2 when there is no such run."""
    import json
    import sys

    out = file or sys.stdout
    try:
        folder = find_run(run, log_root)
        data = json.loads((folder / "report.json").read_text())
    except (FileNotFoundError, ValueError) as err:
        print(f"wwrun: error: {err}", file=sys.stderr)
        return 2
    info, jobs = data["run"], data["jobs"]
    crash = crash_summary(folder)
    state = info.get("state", "ended")
    if crash:
        state = "crashed"
    elif state == "running":
        state = "running, or ended without a word (the report was last written while it ran)"
    if info.get("state", "ended") == "ended":
        outcome = f"exit code {info['exit_code']}, {info['wall_s']}s"
    else:
        outcome = f"last report after {info['wall_s']}s"
    print(f"run {info['run_id']} ({state}): device {info['device']}, policy {info['policy']}, {outcome}",
          file=out)
    print(f"logs: {folder}", file=out)
    if crash:
        print(crash, file=out)
    width = max(len(j["name"]) for j in jobs)
    for job in jobs:
        attempts = job.get("attempts", 1)
        again = f", {attempts} attempts" if attempts > 1 else ""
        code = "" if job["exit_code"] is None else f" exit {job['exit_code']}"
        line = f"  {job['name']:<{width}}  {job['state']:<11}{code}{again}"
        if job.get("error"):
            line += f"  {job['error']}"
        print(line, file=out)
        if state != "ended" and job.get("last_lines"):
            print(f"  {'':<{width}}  last: {job['last_lines'][-1]}", file=out)
    if info.get("root_cause"):
        print(f"root cause: {info['root_cause']} (exit code {info['exit_code']})", file=out)
    from wwrun.display import write_collision

    for clash in info.get("write_collisions", ()):
        print(f"warning: {write_collision(clash['path'], clash['jobs'])}", file=out)
    return 0


def crash_summary(folder: Path) -> str | None:
    """'crashed in job X: Fatal Python error: ...' from a run's crash.log, else None.

    crash.log (written by faulthandler when the process dies of a fatal signal)
    starts with one 'wwrun: thread 0x... runs job NAME' line per job attempt; the
    running report.json adds the threads each job started."""
    import json
    import re

    path = folder / "crash.log"
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return None
    fatal = re.search(r"^Fatal Python error: .*$", text, re.M)
    if not fatal:
        return None
    owners = dict(re.findall(r"^wwrun: thread (0x[0-9a-f]+) runs job (\S+)", text, re.M))
    try:
        for job in json.loads((folder / "report.json").read_text())["jobs"]:
            for thread in job.get("threads", []):
                owners.setdefault(thread, job["name"])
    except (OSError, ValueError, KeyError):
        pass
    current = re.search(r"^Current thread (0x[0-9a-f]+)", text, re.M)
    where = owners.get(current.group(1)) if current else None
    job = f"in job {where}" if where else "outside any job's threads"
    return f"the process crashed {job}: {fatal.group(0)} (stacks in {path})"
