"""Job output and past runs: the pump's lines and tails, `show_run` and crash reports."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from pathlib import Path

import pytest

from wwrun.output import JobOutput, Pump, crash_summary, find_run, show_run


def test_pump_hands_lines_to_the_display_and_keeps_a_tail(tmp_path):
    lines = []
    pump = Pump(lambda job, stream, line: lines.append((job, stream, line)))
    output = JobOutput("j", tmp_path / "j")
    pump.add(output)
    for i in range(15):
        print(f"line {i}", file=output.stdout)
    output.stderr.write("progress 1\rprogress 2\n")
    output.close_writers()
    pump.close()
    assert ("j", "stdout", "line 14") in lines and ("j", "stderr", "progress 2") in lines
    assert len(output.tail) == 10 and output.tail[-1] in ("line 14", "progress 2")
    assert (tmp_path / "j" / "stdout.log").read_text().count("\n") == 15


def test_a_pipe_a_helper_still_holds_is_read_to_its_end_without_waiting_for_its_close(tmp_path):
    """joblib's resource tracker, spared until the process ends, holds its job's stderr:
    the run's end waited 5 s for an end of file that could not come."""
    lines = []
    pump = Pump(lambda job, stream, line: lines.append(line))
    output = JobOutput("j", tmp_path / "j")
    helper_copy = os.dup(output.fds["stderr"])
    try:
        pump.add(output)
        print("last words", file=output.stderr)
        output.stderr.write("no newline")
        output.close_writers()
        pump.close(timeout=30, until_drained=True)
        assert lines == ["last words", "no newline"]  # the last, unended line: the stream was finished
    finally:
        os.close(helper_copy)
    assert (tmp_path / "j" / "stderr.log").read_text() == "last words\nno newline"


def _report(folder, state="ended", jobs=(("a", "succeeded", 0, None),), root=None, code=0):
    folder.mkdir(parents=True)
    data = {
        "run": {"run_id": folder.name, "device": "cpu", "policy": "concurrent", "wall_s": 1.5,
                "exit_code": code, "root_cause": root, "state": state},
        "jobs": [
            {"name": n, "state": s, "exit_code": c, "error": e, "attempts": 1, "threads": [], "last_lines": ["hi"]}
            for n, s, c, e in jobs
        ],
    }
    (folder / "report.json").write_text(json.dumps(data))


def test_show_run_prints_the_latest_run_by_default(tmp_path):
    _report(tmp_path / "r1", jobs=(("a", "succeeded", 0, None), ("b", "failed", 3, "exited with code 3")),
            root="b", code=3)
    os.symlink("r1", tmp_path / "latest")
    out = io.StringIO()
    assert show_run(log_root=str(tmp_path), file=out) == 0
    text = out.getvalue()
    assert "run r1 (ended)" in text and "exit code 3" in text
    assert "b  failed      exit 3  exited with code 3" in text
    assert "root cause: b (exit code 3)" in text
    assert find_run("r1", str(tmp_path)) == (tmp_path / "r1").resolve()
    assert find_run(str(tmp_path / "r1")) == (tmp_path / "r1").resolve()


def test_show_run_of_a_missing_run_is_one_line_and_code_2(tmp_path, capsys):
    assert show_run("nope", log_root=str(tmp_path)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wwrun: error:")


def test_crash_summary_names_the_job_whose_thread_crashed(tmp_path):
    folder = tmp_path / "run"
    _report(folder, state="running", jobs=(("a", "running", None, None), ("b", "running", None, None)))
    report = json.loads((folder / "report.json").read_text())
    report["jobs"][1]["threads"] = ["0x00000000000000bb"]  # a thread job b started
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "crash.log").write_text(
        "wwrun: thread 0x00000000000000aa runs job a (attempt 0)\n"
        "Fatal Python error: Aborted\n\nCurrent thread 0x00000000000000bb (most recent call first):\n"
    )
    assert crash_summary(folder).startswith("the process crashed in job b: Fatal Python error: Aborted")
    out = io.StringIO()
    show_run(str(folder), file=out)
    assert "(crashed)" in out.getvalue() and "last: hi" in out.getvalue()


def test_no_crash_summary_without_a_fatal_error(tmp_path):
    (tmp_path / "crash.log").write_text("wwrun: thread 0x1 runs job a (attempt 0)\n")
    assert crash_summary(tmp_path) is None
    assert crash_summary(tmp_path / "missing") is None


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_an_ended_job_keeps_two_descriptors_not_six(tmp_path):
    """A sweep through the queue must not run out of open files: an ended job's pipes
    are drained and closed, its write ends kept on /dev/null until the run ends."""
    from wwrun import JobSpec, LaunchConfig
    from wwrun.launcher import launch

    script = str(Path(__file__).parent / "scripts" / "count_fds.py")
    jobs = [JobSpec(name=f"j{i}", script=script) for i in range(30)]
    result = launch(LaunchConfig(jobs=jobs, policy="sequential", log_dir=str(tmp_path / "logs"), quiet=True))
    assert result.exit_code == 0
    counts = [int((Path(result.log_dir) / f"j{i}" / "stdout.log").read_text().split("=")[1]) for i in range(30)]
    grown = counts[-1] - counts[0]
    assert grown <= 2 * 29 + 12, counts  # 6 per ended job before (174)


def test_job_lines_lose_control_sequences_and_a_redrawn_bar_is_the_last_line(tmp_path):
    lines = []
    pump = Pump(lambda job, stream, line: lines.append(line))
    output = JobOutput("j", tmp_path / "j")
    pump.add(output)
    output.stdout.write("tick\x1b[A\x1b[2K \x1b[31mred\x1b[0m\x07\n")
    output.stderr.write("\rbar 10%")
    output.stderr.flush()
    deadline = time.monotonic() + 10  # the pump thread reads it
    while output.last_line != "bar 10%" and time.monotonic() < deadline:
        time.sleep(0.01)
    # Before its next '\r' or newline, the bar being drawn is what the table shows.
    assert output.last_line == "bar 10%"
    output.stderr.write("\rbar 20%\r       \r")  # a bar that clears itself leaves its last state
    output.close_writers()
    pump.close()
    assert "tick red" in lines and output.last_line == "bar 20%"
    assert list(output.tail) == ["tick red", "bar 10%", "bar 20%"]
    # The logs keep the bytes as written, as `2> file` would.
    assert (tmp_path / "j" / "stdout.log").read_bytes() == b"tick\x1b[A\x1b[2K \x1b[31mred\x1b[0m\x07\n"
    assert (tmp_path / "j" / "stderr.log").read_bytes() == b"\rbar 10%\rbar 20%\r       \r"


def test_a_line_written_a_piece_at_a_time_shows_its_start_then_is_kept_whole(tmp_path):
    """A line still being written (progress dots) is shown by its start, which is all
    the table has room for, and not decoded whole again at each write; once ended it
    is kept whole."""
    from wwrun.output import _SHOWN_BYTES

    pump = Pump(lambda job, stream, line: None)
    output = JobOutput("j", tmp_path / "j")
    pump.add(output)
    for _ in range(3):
        output.stdout.write("\t" + "." * _SHOWN_BYTES)  # a tab: not printable, so filtered
        output.stdout.flush()
    deadline = time.monotonic() + 10  # the pump thread reads it
    while len(output.last_line) < _SHOWN_BYTES - 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert output.last_line == "\t" + "." * (_SHOWN_BYTES - 1)
    output.stdout.write("\n")
    output.close_writers()
    pump.close()
    assert list(output.tail) == [("\t" + "." * _SHOWN_BYTES) * 3]


def test_a_prompt_is_shown_as_its_job_reads_and_its_line_goes_on_after_what_the_user_typed(tmp_path):
    """`input("name? ")` on a terminal: the prompt has no newline, so it was shown only
    in the live table's last-line cell, and pdb's listing before `(Pdb) ` not at all."""
    lines, prompts, shown = [], [], threading.Event()
    pump = Pump(lambda job, stream, line: lines.append(line),
                lambda job, stream, text: (prompts.append((job, stream, text)), shown.set()))
    output = JobOutput("j", tmp_path / "j")
    pump.add(output)
    output.stdout.write("listing\nname? ")
    output.stdout.flush()
    pump.prompt(output)  # from the job's thread, as it reads the terminal
    assert shown.wait(30)
    assert prompts == [("j", "stdout", "name? ")] and lines == ["listing"]
    print("hello Bob", file=output.stdout)  # the user typed "Bob" and Enter: a row of its own
    output.stdout.write("again? ")
    output.stdout.flush()
    shown.clear()
    pump.prompt(output)
    assert shown.wait(30)
    output.close_writers()  # it ended after the user's answer: the prompt's row was the last
    pump.close(timeout=30)
    assert lines == ["listing", "hello Bob"] and prompts[-1] == ("j", "stdout", "again? ")
    assert list(output.tail)[-2:] == ["name? hello Bob", "again? "]  # the report's lines keep what was written
    assert (tmp_path / "j" / "stdout.log").read_text() == "listing\nname? hello Bob\nagain? "


def test_settle_returns_once_the_pump_has_read_what_the_job_wrote(tmp_path):
    """A job's last lines before the line saying it ended ('[wwrun] j: succeeded')."""
    lines = []

    def slow_display(job, stream, line):  # a terminal taking its time: the pump lags behind
        time.sleep(0.001)
        lines.append(line)

    pump = Pump(slow_display)
    output = JobOutput("j", tmp_path / "j")
    pump.add(output)
    for i in range(300):
        print(f"last {i}", file=output.stdout)
    assert pump.settle(output, timeout=30)
    assert lines == [f"last {i}" for i in range(300)]
    output.close_writers()
    pump.close(timeout=30)


def test_a_job_that_goes_on_writing_keeps_the_pump_from_no_other_job(tmp_path):
    """Reading a job's pipes for its prompt (or its end) reads what they held then, not
    until they are empty: a thread of the job writing on kept the pump reading it for
    good, and the other jobs' output stopped (their pipes then filled and they blocked)."""
    other_line = threading.Event()

    def display(job, stream, line):
        time.sleep(0.0002)
        if job == "b":
            other_line.set()

    pump = Pump(display)
    chatty, other = JobOutput("a", tmp_path / "a"), JobOutput("b", tmp_path / "b")
    pump.add(chatty)
    pump.add(other)
    stop = threading.Event()

    def chatter():
        while not stop.is_set():
            print("x" * 100, file=chatty.stdout)

    writer = threading.Thread(target=chatter, daemon=True)
    writer.start()
    try:
        assert pump.settle(chatty, timeout=30)
        print("b's line", file=other.stdout)
        assert other_line.wait(30)
    finally:
        stop.set()
        writer.join(30)
        chatty.close_writers()
        other.close_writers()
        pump.close(timeout=30)


def test_a_job_asking_on_a_line_of_its_own_still_gets_the_screen(tmp_path):
    """`print("Name:"); input()`: nothing is left unended, and the display must still
    hear that the job waits for the user. A progress bar being redrawn beside a prompt
    is shown as it stands, and its next redraw adds no empty line."""
    lines, prompts, shown = [], [], threading.Event()
    pump = Pump(lambda job, stream, line: lines.append((stream, line)),
                lambda job, stream, text: (prompts.append((stream, text)), shown.set()))
    output = JobOutput("j", tmp_path / "j")
    pump.add(output)

    def ask():
        shown.clear()
        pump.prompt(output)
        assert shown.wait(30)

    print("Name:", file=output.stdout)
    ask()
    assert prompts == [("stdout", "")] and lines == [("stdout", "Name:")]
    output.stderr.write(" 50%|#####     | 5/10")
    output.stderr.flush()
    output.stdout.write("(Pdb) ")
    output.stdout.flush()
    ask()
    assert prompts[1:] == [("stderr", " 50%|#####     | 5/10"), ("stdout", "(Pdb) ")]  # the prompt last
    output.stderr.write("\r 60%|######    | 6/10\n")
    output.close_writers()
    pump.close(timeout=30)
    assert lines[1:] == [("stderr", " 60%|######    | 6/10")]
