"""The run as a whole: ordering and limits, the report and events, interrupts, and
the processes jobs leave behind."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from wwrun import JobSpec, JobState, LaunchConfig, launch
from wwrun.display import QuietDisplay

SCRIPTS = Path(__file__).parent / "scripts"
ENDING = str(SCRIPTS / "ending.py")


def ending(name, how="ok", delay=0.0, **fields):
    return JobSpec(name=name, script=ENDING, args=[how, str(delay)], **fields)


def run(tmp_path, *jobs, **options):
    options.setdefault("quiet", True)
    return launch(LaunchConfig(jobs=list(jobs), log_dir=str(tmp_path / "logs"), **options))


def overlaps(a, b) -> bool:
    return a.started < b.ended and b.started < a.ended


def test_concurrent_jobs_overlap(tmp_path):
    result = run(tmp_path, ending("a", delay=0.5), ending("b", delay=0.5), policy="concurrent")
    a, b = result.jobs
    assert overlaps(a, b)
    assert result.wall_s < a.wall_s + b.wall_s


def test_sequential_runs_one_after_another_in_priority_order(tmp_path):
    result = run(
        tmp_path,
        ending("low", delay=0.2),
        ending("high", delay=0.2, priority=5),
        policy="sequential",
    )
    low, high = result.jobs
    assert not overlaps(low, high)
    assert high.ended <= low.started  # higher priority went first


def test_max_concurrent_holds_the_rest_in_the_queue(tmp_path):
    result = run(tmp_path, *(ending(f"j{i}", delay=0.4) for i in range(3)), max_concurrent=2)
    j0, j1, j2 = result.jobs
    assert overlaps(j0, j1)
    assert j2.started >= min(j0.ended, j1.ended)


def test_report_and_events(tmp_path):
    report, events = tmp_path / "report.json", tmp_path / "events.jsonl"
    result = run(
        tmp_path, ending("ok"), ending("bad", "exit3"), report=str(report), events=str(events)
    )
    data = json.loads(report.read_text())
    assert set(data["run"]) >= {
        "run_id", "device", "policy", "torch", "host", "started", "wall_s", "exit_code", "root_cause",
    }
    assert data["run"]["exit_code"] == 3 and data["run"]["root_cause"] == "bad"
    assert data["run"]["device"] == result.device == "cpu"
    jobs = {j["name"]: j for j in data["jobs"]}
    assert set(jobs["ok"]) >= {"name", "script", "args", "cwd", "state", "exit_code", "started", "wall_s", "error"}
    assert (jobs["ok"]["state"], jobs["ok"]["exit_code"]) == ("succeeded", 0)
    assert (jobs["bad"]["state"], jobs["bad"]["exit_code"], jobs["bad"]["args"]) == ("failed", 3, ["exit3", "0.0"])
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["state"] for e in lines if e["job"] == "bad"] == ["pending", "running", "failed"]
    assert [e["state"] for e in lines if e["job"] == "ok"] == ["pending", "running", "succeeded"]
    assert all(e["run_id"] == result.run_id for e in lines)
    # The resolved recipe is kept beside the logs, and loads back to the same jobs.
    from wwrun import load_recipe

    again = load_recipe(Path(result.log_dir) / "recipe.yaml")
    assert [j.name for j in again.jobs] == ["ok", "bad"]
    assert again.jobs[1].args == ["exit3", "0.0"]


def test_a_missing_script_fails_like_python_does(tmp_path):
    result = run(tmp_path, JobSpec(name="gone", script=str(tmp_path / "gone.py")), ending("fine"))
    gone, fine = result.jobs
    assert (gone.state, gone.exit_code, fine.exit_code) == (JobState.FAILED, 2, 0)
    assert "can't open file" in (Path(gone.log_dir) / "stderr.log").read_text()


def test_a_job_in_a_missing_folder_fails_and_only_a_folder_per_job_is_made(tmp_path):
    """A cwd with `{job}` is a folder per job, made when it starts; any other cwd that
    does not exist is a mistake the job reports, not a folder wwrun makes."""
    typo = tmp_path / "no-such-folder"
    result = run(tmp_path, ending("typo", cwd=str(typo)), ending("own", cwd=str(tmp_path / "runs" / "{job}")))
    typo_job, own = result.jobs
    assert typo_job.state == JobState.FAILED and "no-such-folder" in typo_job.error, typo_job
    assert not typo.exists()
    assert own.state == JobState.SUCCEEDED and own.cwd == str(tmp_path / "runs" / "own")
    assert (tmp_path / "runs" / "own").is_dir()


def test_an_output_file_a_job_took_is_said_and_the_run_still_ends_with_its_summary(tmp_path):
    """--trace and --memory-plot are written after the jobs: a path one of them made a
    folder of is a note, not an exception that loses the run's result and summary."""
    trace, plot = tmp_path / "trace.json", tmp_path / "memory.png"
    script = tmp_path / "takes.py"
    script.write_text(f"import os\nos.mkdir({str(trace)!r})\nos.mkdir({str(plot)!r})\n")
    err = io.StringIO()
    result = launch(LaunchConfig(jobs=[JobSpec(name="takes", script=str(script))], log_dir=str(tmp_path / "logs"), quiet=True,
                                 policy="waterwave", trace=str(trace), memory_plot=str(plot)),
                    display=QuietDisplay(err))
    assert result.exit_code == 0 and result.jobs[0].state == JobState.SUCCEEDED
    said = err.getvalue()
    assert "no trace:" in said and "no memory plot:" in said and "1 job(s) in" in said, said


def test_events_reader_going_away_does_not_stop_the_jobs(tmp_path):
    # `wwrun --events - ... | head -1`: the pipe closes after the first line.
    shell = (
        f"{sys.executable} -m wwrun --events - --report {tmp_path}/r.json --log-dir {tmp_path} "
        f"{ENDING} ok 1 : {ENDING} ok 1 | head -1"
    )
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert json.loads(done.stdout)["state"] == "pending"
    report = json.loads((tmp_path / "r.json").read_text())
    assert [job["state"] for job in report["jobs"]] == ["succeeded", "succeeded"]
    assert "Traceback" not in done.stderr


def test_terminal_reader_going_away_does_not_block_the_jobs(tmp_path):
    # `wwrun chatty.py | head -1`: job lines can no longer be shown, but the job must
    # not block on its full pipe, and its log keeps everything.
    chatty = SCRIPTS / "chatty.py"
    shell = f"{sys.executable} -m wwrun --report {tmp_path}/r.json --log-dir {tmp_path} {chatty} | head -1"
    done = subprocess.run(["bash", "-c", shell], capture_output=True, text=True, timeout=60)
    assert done.stdout.startswith("[chatty] line 00000")
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["jobs"][0]["state"] == "succeeded"
    log = (Path(report["run"]["log_dir"]) / "chatty" / "stdout.log").read_text()
    assert log.count("\n") == 20001 and log.endswith("chatty done\n")


def test_earliest_failure_is_the_root_cause(tmp_path):
    result = run(tmp_path, ending("late", "exit3", 1.5), ending("early", "raise", 0.1), ending("fine"))
    assert result.root_cause == "early"
    assert result.exit_code == 1
    assert result.is_failed()


def _interrupt_soon(delay: float, times: int = 1):
    def send():
        for _ in range(times):
            time.sleep(delay)
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=send, daemon=True).start()


def test_first_interrupt_reaches_every_job_and_cancels_the_queue(tmp_path):
    _interrupt_soon(1.5)
    result = run(
        tmp_path,
        ending("a", "loop"),
        ending("b", "loop"),
        ending("queued"),
        max_concurrent=2,
        grace_period_s=10,
    )
    a, b, queued = result.jobs
    for job in (a, b):
        assert (job.state, job.exit_code) == (JobState.INTERRUPTED, 130)
        assert "got KeyboardInterrupt" in (Path(job.log_dir) / "stdout.log").read_text()
    assert queued.state == JobState.CANCELLED and queued.started is None
    assert result.exit_code == 130


def test_a_job_being_started_as_the_interrupt_comes_is_interrupted_too(tmp_path, monkeypatch):
    """The launcher interrupts the jobs whose thread it knows. A Ctrl-C landing as a job
    was being started (its thread made, not yet running the job: three Hugging Face
    Trainer jobs pressed Ctrl-C as they started) passed it by, and it trained on to
    its end, or past the grace period."""
    from wwrun import isolation
    from wwrun.runner import Runner

    handled, enter, on_signal = threading.Event(), isolation.enter, Runner._on_signal

    def on_signal_then_say_so(self, signum, frame):
        on_signal(self, signum, frame)
        handled.set()

    def enter_after_the_interrupt(job):
        if job.name == "late":  # its thread runs, but the launcher does not know it yet
            os.kill(os.getpid(), signal.SIGINT)
            assert handled.wait(30), "the launcher never handled the interrupt"
        enter(job)

    monkeypatch.setattr(Runner, "_on_signal", on_signal_then_say_so)
    monkeypatch.setattr(isolation, "enter", enter_after_the_interrupt)
    result = run(tmp_path, ending("late", "loop"), grace_period_s=20)
    (late,) = result.jobs
    assert (late.state, late.exit_code, late.error) == (JobState.INTERRUPTED, 130, "interrupted")


def test_job_ignoring_the_interrupt_is_abandoned_after_the_grace_period(tmp_path):
    _interrupt_soon(1.0)
    start = time.monotonic()
    result = run(tmp_path, ending("stubborn", "stubborn"), ending("polite", "loop"), grace_period_s=1.0)
    assert time.monotonic() - start < 8
    stubborn, polite = result.jobs
    assert polite.state == JobState.INTERRUPTED
    assert stubborn.state == JobState.INTERRUPTED
    assert stubborn.error == "did not stop within the grace period"
    where = json.loads((Path(stubborn.log_dir) / "error.json").read_text())["traceback"]
    assert where.startswith("Still running here when abandoned") and "ending.py" in where  # what it waited in


def test_an_interrupt_landing_while_a_job_ends_interrupted_still_hands_everything_back(tmp_path, monkeypatch):
    """A second KeyboardInterrupt can land in wwrun's handling of the first (a
    DataLoader's workers dying of the same Ctrl-C): the job is still interrupted
    (130), not "wwrun: KeyboardInterrupt" (1), and its namespaces and memory go back,
    so that the next job runs."""
    from wwrun import jobthread

    outcome = jobthread._outcome

    def interrupted_again(exc, ctx, quiet=False):
        if isinstance(exc, KeyboardInterrupt):
            raise KeyboardInterrupt
        return outcome(exc, ctx, quiet)

    monkeypatch.setattr(jobthread, "_outcome", interrupted_again)
    _interrupt_soon(1.0)
    first = run(tmp_path, ending("a", "loop"), policy="waterwave", memory_limit=64 << 20)
    assert (first.jobs[0].state, first.jobs[0].exit_code, first.jobs[0].error) == (JobState.INTERRUPTED, 130, "interrupted")
    monkeypatch.setattr(jobthread, "_outcome", outcome)
    second = run(tmp_path, ending("b"), policy="waterwave", memory_limit=64 << 20)
    assert second.jobs[0].state == JobState.SUCCEEDED, second.jobs[0].error


def test_second_interrupt_ends_the_process_at_once(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path), ENDING, "stubborn"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _wait_for_line(proc, "ready")
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)  # a second press, not the first one delivered twice (host.SAME_PRESS_S)
    proc.send_signal(signal.SIGINT)
    code = proc.wait(timeout=10)
    assert code == 130, proc.stderr.read()


def test_sigterm_interrupts_like_ctrl_c_with_a_summary(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path), ENDING, "loop", ":", ENDING, "loop"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _wait_for_line(proc, "ready")
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 130
    assert "interrupted" in err and "job(s) in" in err
    assert "root cause" not in err  # no job caused it: they were all interrupted


def test_a_job_s_own_signal_handler_runs_instead_of_the_interrupt(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path), "--report", str(tmp_path / "r.json"),
         ENDING, "graceful", ":", ENDING, "loop"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _wait_for_line(proc, "ready")
    _wait_for_line(proc, "ready")  # both jobs

    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    jobs = {j["name"]: j for j in json.loads((tmp_path / "r.json").read_text())["jobs"]}
    assert (jobs["ending"]["state"], jobs["ending"]["exit_code"]) == ("succeeded", 0)
    assert f"[ending] saving checkpoint after signal {int(signal.SIGTERM)}" in out
    assert (jobs["ending-2"]["state"], jobs["ending-2"]["exit_code"]) == ("interrupted", 130)
    assert proc.returncode == 130


def test_no_child_process_outlives_the_run(tmp_path):
    result = run(tmp_path, ending("orphan", "orphan"))
    assert result.exit_code == 0
    out = (Path(result.jobs[0].log_dir) / "stdout.log").read_text()
    pid = int(out.split("child pid ")[1].split()[0])
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def _wait_for_line(proc, text: str, timeout: float = 30) -> None:
    """Read the (non-terminal, so plain prefixed) output until `text` shows up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if text in line:
            return
        if not line and proc.poll() is not None:
            break
    proc.kill()
    pytest.fail(f"never saw {text!r}: {proc.stderr.read()}")


def test_jobs_running_at_once_share_the_cpu_threads(tmp_path, monkeypatch):
    import torch

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    script = str(SCRIPTS / "threads.py")
    before = torch.get_num_threads()
    result = run(tmp_path, *(JobSpec(name=f"t{i}", script=script) for i in range(3)), max_concurrent=2)
    share = max(1, (os.cpu_count() or 1) // 2)
    for job in result.jobs:
        assert (Path(job.log_dir) / "stdout.log").read_text().strip() == f"threads={share}"
    assert torch.get_num_threads() == before  # restored after the run


def test_explicit_omp_num_threads_is_left_alone(tmp_path, monkeypatch):
    import torch

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    script = str(SCRIPTS / "threads.py")
    result = run(tmp_path, JobSpec(name="a", script=script), JobSpec(name="b", script=script))
    # What any new thread of this process sees (OpenMP's count is per thread: an earlier
    # test's set_num_threads on the main thread changed the main thread's alone).
    fresh = []
    reader = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    reader.start()
    reader.join()
    for job in result.jobs:
        assert (Path(job.log_dir) / "stdout.log").read_text().strip() == f"threads={fresh[0]}"


@pytest.mark.gpu
@pytest.mark.fresh_process  # wwrun's allocator installs only before CUDA is initialised
def test_on_cuda_each_job_sees_its_own_memory_figures(tmp_path):
    script = str(SCRIPTS / "cuda_memory.py")
    result = run(
        tmp_path,
        JobSpec(name="small", script=script, args=["64"]),
        JobSpec(name="large", script=script, args=["256"]),
        device="cuda",
        policy="concurrent",
    )
    assert result.exit_code == 0, (Path(result.jobs[0].log_dir) / "stderr.log").read_text()
    assert result.extra["allocator"] == "waterwave"
    for job, mib in zip(result.jobs, (64, 256)):
        line = (Path(job.log_dir) / "stdout.log").read_text()
        allocated = int(line.split("allocated=")[1].split()[0])
        assert mib * 2**20 <= allocated < (mib + 16) * 2**20  # its own, not the sum
        assert job.extra["peak_memory_bytes"] >= mib * 2**20


def _mlp(name, width, batch, steps=20):
    args = ["--width", str(width), "--batch", str(batch), "--steps", str(steps)]
    return JobSpec(name=name, script=str(SCRIPTS / "train_mlp.py"), args=args)


def test_waterwave_keeps_jobs_whose_peaks_exceed_the_budget_under_it(tmp_path):
    # Each job retains ~4 x batch x width x 4 bytes x 2 (linear + relu) for backward.
    jobs = [_mlp("a", 256, 512), _mlp("b", 256, 512), _mlp("c", 256, 512)]
    alone = run(tmp_path / "alone", _mlp("solo", 256, 512), policy="waterwave")
    solo_peak = alone.jobs[0].extra["peak_memory_bytes"]
    limit = int(solo_peak * 2.2)  # the three together (~3x) do not fit
    result = run(tmp_path, *jobs, memory_limit=limit, trace=str(tmp_path / "trace.json"))
    assert result.exit_code == 0
    assert result.policy == "waterwave"
    assert result.extra["memory_limit_bytes"] == limit
    # The allocator enforces the limit: no tolerance, reserved segments included.
    assert result.extra["peak_memory_bytes"] <= result.extra["peak_reserved_bytes"] <= limit
    assert sum(job.extra["peak_memory_bytes"] for job in result.jobs) > limit
    assert any(job.extra["wait_s"] > 0 for job in result.jobs)  # someone had to wait
    for job in result.jobs:
        assert job.extra["iterations"] == 20
        assert job.extra["nodegroups"] and all("modules" in g and "bytes" in g for g in job.extra["nodegroups"])
    # Numerics are unchanged by the interleaving.
    solo_loss = (Path(alone.jobs[0].log_dir) / "stdout.log").read_text()
    for job in result.jobs:
        assert (Path(job.log_dir) / "stdout.log").read_text() == solo_loss
    trace = json.loads((tmp_path / "trace.json").read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    assert {"a", "b", "c"} <= {e.get("args", {}).get("name") for e in events if e.get("ph") == "M"}


def test_a_job_too_large_for_the_budget_fails_alone(tmp_path):
    result = run(tmp_path, _mlp("huge", 512, 4096, steps=2), _mlp("small", 64, 32, steps=5), memory_limit=2 * 2**20)
    huge, small = result.jobs
    # The engine says so before its pass, or the allocator refuses its first tensor.
    assert huge.state == JobState.FAILED
    assert "JobTooLarge" in huge.error or "OutOfMemoryError: wwrun: job 'huge' is out of memory" in huge.error
    assert small.state == JobState.SUCCEEDED
    assert result.root_cause == "huge"


def test_a_job_memory_limit_on_the_cpu_fails_that_job_alone(tmp_path):
    """wwrun's CPU allocator counts every byte a job's tensors take: a job's own limit
    fails it with torch.OutOfMemoryError, as on a GPU, and the other job finishes."""
    capped = dataclasses.replace(_mlp("capped", 512, 1024, steps=2), memory_limit=2 * 2**20)
    result = run(tmp_path, capped, _mlp("free", 512, 1024, steps=2))
    capped_result, free = result.jobs
    assert capped_result.state == JobState.FAILED
    assert "OutOfMemoryError: wwrun: job 'capped' is out of memory" in capped_result.error
    assert free.state == JobState.SUCCEEDED
    assert free.extra["peak_memory_bytes"] > 2 * 2**20  # the same job needs more than the cap


def test_explain_prints_each_job_s_nodegroups(tmp_path, capsys):
    run(tmp_path, _mlp("a", 64, 32, steps=3), _mlp("b", 64, 32, steps=3), explain=True)
    err = capsys.readouterr().err
    assert "[a] Sequential:" in err and "[b] Sequential:" in err and "group 0:" in err


def test_a_memory_limit_alone_selects_waterwave():
    from wwrun import LaunchConfig

    one = [JobSpec(name="x", script=ENDING)]
    assert LaunchConfig(jobs=one).resolved_policy == "concurrent"
    assert LaunchConfig(jobs=one, memory_limit="1GiB").resolved_policy == "waterwave"


def _launch_bounded(tmp_path, *jobs, limit=120, **options):
    """Run in a helper thread so that a launcher that would hang fails the test."""
    results = []
    thread = threading.Thread(target=lambda: results.append(run(tmp_path, *jobs, **options)), daemon=True)
    thread.start()
    thread.join(limit)
    assert not thread.is_alive(), "the launcher is still waiting"
    return results[0]


def test_a_job_that_closed_its_stderr_and_failed_still_ends(tmp_path):
    # Writing the traceback into the job's closed stderr raised in the job's thread,
    # which died without reporting, and the launcher waited for it forever.
    script = tmp_path / "closer.py"
    script.write_text("import sys\nsys.stderr.close()\nraise RuntimeError('after closing stderr')\n")
    result = _launch_bounded(tmp_path, JobSpec(name="closer", script=str(script)), ending("fine"))
    closer, fine = result.jobs
    assert (closer.state, closer.exit_code) == (JobState.FAILED, 1)
    assert closer.error == "RuntimeError: after closing stderr"
    assert fine.state == JobState.SUCCEEDED


def test_the_launcher_never_waits_on_a_thread_that_has_ended(tmp_path, monkeypatch):
    from wwrun.runner import Runner

    # A job thread that ends without a word (the worst case: no state, no notify).
    monkeypatch.setattr(Runner, "_job_main", lambda self, job: None)
    result = _launch_bounded(tmp_path, ending("silent"))
    assert result.jobs[0].state == JobState.FAILED
    assert "ended without reporting" in result.jobs[0].error


def test_a_stream_view_collected_in_a_job_leaves_the_job_s_stream_open(tmp_path):
    # The hang of issue 11: pytest swaps sys.stderr between tests, wwrun wraps the new
    # one, and the old view, collected later in a job's thread, closed that job's
    # stderr (IOBase's finalizer calls close()); the job's next write failed.
    script = tmp_path / "stale.py"
    script.write_text(
        "import sys\n"
        "view = type(sys.stderr)('stderr', sys.__stderr__)\n"
        "del view\n"
        "print('still here', file=sys.stderr)\n"
    )
    result = _launch_bounded(tmp_path, JobSpec(name="stale", script=str(script)))
    assert result.jobs[0].state == JobState.SUCCEEDED, result.jobs[0].error
    assert (Path(result.jobs[0].log_dir) / "stderr.log").read_text() == "still here\n"


# -- issue 11 §3/§5: what sweep users expect ------------------------------------------

FLAKY = str(SCRIPTS / "flaky.py")


def flaky(name, counter, succeed_at, how="raise", **fields):
    return JobSpec(name=name, script=FLAKY, args=[how, str(counter), str(succeed_at)], **fields)


def test_every_run_writes_its_report_and_latest_points_at_it(tmp_path, capsys):
    first = run(tmp_path, ending("a"), quiet=False)
    second = run(tmp_path, ending("b", "exit3"), quiet=False)
    err = capsys.readouterr().err
    assert f"run {first.run_id}: logs in {first.log_dir}" in err  # said when the run starts
    for result in (first, second):
        report = json.loads((Path(result.log_dir) / "report.json").read_text())
        assert report["run"]["run_id"] == result.run_id and report["run"]["state"] == "ended"
    latest = tmp_path / "logs" / "latest"
    assert latest.is_symlink() and latest.resolve() == Path(second.log_dir).resolve()
    assert not (Path(second.log_dir) / "crash.log").exists()  # only after a crash


def test_wwrun_show_prints_a_past_run(tmp_path):
    result = run(tmp_path, ending("fine"), ending("bad", "exit3"))
    shown = subprocess.run(
        [sys.executable, "-m", "wwrun", "show", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=60,
    )
    assert shown.returncode == 0, shown.stderr
    assert f"run {result.run_id} (ended)" in shown.stdout
    assert "bad" in shown.stdout and "exited with code 3" in shown.stdout
    assert "root cause: bad (exit code 3)" in shown.stdout
    missing = subprocess.run(
        [sys.executable, "-m", "wwrun", "show", "nope", "--log-dir", str(tmp_path / "logs")],
        capture_output=True, text=True, timeout=60,
    )
    assert missing.returncode == 2 and len(missing.stderr.strip().splitlines()) == 1


def test_a_refused_run_leaves_no_log_folder(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--device", "cuda", "--log-dir", str(tmp_path / "logs"), ENDING],
        capture_output=True, text=True, timeout=60,
    )
    if done.returncode == 0:
        pytest.skip("a CUDA device is present")
    assert done.returncode == 2
    assert not (tmp_path / "logs").exists()


def test_a_job_timeout_ends_that_job_alone_like_gnu_timeout(tmp_path):
    result = run(tmp_path, ending("slow", "loop", timeout=1), ending("other", delay=0.2), grace_period_s=5)
    slow, other = result.jobs
    assert (slow.state, slow.exit_code) == (JobState.FAILED, 124)
    assert slow.error == "timed out after 1s"
    assert "got KeyboardInterrupt" in (Path(slow.log_dir) / "stdout.log").read_text()
    assert other.state == JobState.SUCCEEDED
    assert result.exit_code == 124 and result.root_cause == "slow"


def test_a_job_ignoring_its_timeout_is_abandoned_after_the_grace_period(tmp_path):
    result = run(tmp_path, ending("stubborn", "stubborn", timeout=0.5), grace_period_s=0.5)
    (stubborn,) = result.jobs
    assert (stubborn.state, stubborn.exit_code) == (JobState.FAILED, 124)
    assert stubborn.error == "timed out after 0.5s (did not stop within the grace period)"


def test_the_run_timeout_ends_every_job_and_cancels_the_queue(tmp_path):
    result = run(
        tmp_path, ending("a", "loop"), ending("b", "loop"), ending("later"),
        max_concurrent=2, timeout=1, grace_period_s=5,
    )
    a, b, later = result.jobs
    for job in (a, b):
        assert (job.state, job.exit_code) == (JobState.FAILED, 124)
        assert job.error == "the run timed out after 1s"
    assert later.state == JobState.CANCELLED and later.started is None
    assert result.exit_code == 124


def test_a_failed_job_is_retried_with_each_attempt_logged_apart(tmp_path):
    counter = tmp_path / "count"
    events = tmp_path / "events.jsonl"
    result = run(tmp_path, flaky("flaky", counter, 3), retries=2, events=str(events))
    (job,) = result.jobs
    assert (job.state, job.exit_code, job.extra["attempts"]) == (JobState.SUCCEEDED, 0, 3)
    folder = Path(result.log_dir) / "flaky"
    assert Path(job.log_dir) == folder / "attempt_2"
    for n in range(3):
        assert (folder / f"attempt_{n}" / "stdout.log").read_text().startswith(f"attempt {n + 1}\n")
    assert json.loads((folder / "attempt_0" / "error.json").read_text())["error"] == "RuntimeError: flaky failure 1"
    states = [json.loads(line)["state"] for line in events.read_text().splitlines()]
    assert states == ["pending", "running", "queued", "running", "queued", "running", "succeeded"]
    report = json.loads((Path(result.log_dir) / "report.json").read_text())
    assert report["jobs"][0]["attempts"] == 3


def test_a_retry_is_named_as_its_folder(tmp_path):
    """The message, the queued reason, the events and the folder count attempts one
    way: retry N runs in attempt_N/ (issue 21: "attempt 2 of 2" in attempt_1/)."""
    import io

    from wwrun.display import PlainDisplay

    events = tmp_path / "events.jsonl"
    out, err = io.StringIO(), io.StringIO()
    config = LaunchConfig(jobs=[flaky("flaky", tmp_path / "count", 3)], retries=2, events=str(events),
                          log_dir=str(tmp_path / "logs"))
    result = launch(config, display=PlainDisplay(out, err))
    assert result.jobs[0].state == JobState.SUCCEEDED
    shown = err.getvalue()
    assert "[wwrun] flaky failed (RuntimeError: flaky failure 1): retry 1 of 2, in attempt_1/\n" in shown
    assert "[wwrun] flaky failed (RuntimeError: flaky failure 2): retry 2 of 2, in attempt_2/\n" in shown
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [r["attempt"] for r in records if r["state"] == "running"] == [0, 1, 2]
    assert [r["reason"] for r in records if r["state"] == "queued"] == [
        "retry 1 of 2, in attempt_1/", "retry 2 of 2, in attempt_2/"]
    folder = Path(result.log_dir) / "flaky"
    assert all((folder / f"attempt_{n}" / "stdout.log").read_text().startswith(f"attempt {n + 1}\n") for n in range(3))


def test_a_job_s_own_retries_win_and_run_out(tmp_path):
    result = run(tmp_path, flaky("flaky", tmp_path / "count", 5, retries=1), retries=3)
    (job,) = result.jobs
    assert (job.state, job.extra["attempts"]) == (JobState.FAILED, 2)
    assert job.error == "RuntimeError: flaky failure 2"


def test_after_running_out_of_memory_the_retry_waits_for_another_job_to_end(tmp_path):
    result = run(
        tmp_path, flaky("hungry", tmp_path / "count", 2, how="oom"), ending("holder", delay=1.0),
        retries=1, policy="concurrent",
    )
    hungry, holder = result.jobs
    assert (hungry.state, hungry.extra["attempts"]) == (JobState.SUCCEEDED, 2)
    assert hungry.started >= holder.ended  # the second attempt started once memory was freed


def test_halt_soon_starts_nothing_new_after_a_failure(tmp_path):
    result = run(
        tmp_path, ending("bad", "exit3"), ending("running", delay=1.0), ending("queued"),
        max_concurrent=2, halt="soon",
    )
    bad, running, queued = result.jobs
    assert bad.state == JobState.FAILED
    assert running.state == JobState.SUCCEEDED  # let finish
    assert queued.state == JobState.CANCELLED and queued.started is None
    assert "bad failed (--halt soon)" in queued.error
    assert result.exit_code == 3 and result.root_cause == "bad"


def test_halt_now_interrupts_the_running_jobs(tmp_path):
    result = run(tmp_path, ending("bad", "exit3", 0.5), ending("busy", "loop"), halt="now", grace_period_s=5)
    bad, busy = result.jobs
    assert bad.state == JobState.FAILED
    assert (busy.state, busy.exit_code) == (JobState.INTERRUPTED, 130)
    assert "got KeyboardInterrupt" in (Path(busy.log_dir) / "stdout.log").read_text()
    assert result.root_cause == "bad"


# -- issue 11 §6: queued and waiting --------------------------------------------------


def _states(events: Path) -> dict[str, list[str]]:
    states: dict[str, list[str]] = {}
    for line in events.read_text().splitlines():
        record = json.loads(line)
        states.setdefault(record["job"], []).append(record["state"])
    return states


def test_a_job_waiting_for_a_slot_is_queued(tmp_path):
    events = tmp_path / "events.jsonl"
    run(tmp_path, ending("first", delay=0.3), ending("second"), max_concurrent=1, events=str(events))
    states = _states(events)
    assert states["first"] == ["pending", "running", "succeeded"]
    assert states["second"] == ["pending", "queued", "running", "succeeded"]


def test_jobs_waiting_for_memory_show_queued_or_waiting(tmp_path):
    alone = run(tmp_path / "alone", _mlp("solo", 256, 512), policy="waterwave")
    limit = int(alone.jobs[0].extra["peak_memory_bytes"] * 2.2)  # the three together do not fit
    events = tmp_path / "events.jsonl"
    result = run(
        tmp_path, _mlp("a", 256, 512), _mlp("b", 256, 512), _mlp("c", 256, 512),
        memory_limit=limit, events=str(events),
    )
    assert result.exit_code == 0
    states = _states(events)
    seen = {state for job in states.values() for state in job}
    assert seen & {"queued", "waiting"}  # someone had to wait, and it shows
    for job in states.values():
        assert job[0] == "pending" and job[-1] == "succeeded"
        assert "running" in job


# -- issue 12 §2: a job's own threads ---------------------------------------------------


def test_a_job_ends_after_its_non_daemon_threads_as_under_python(tmp_path):
    target = tmp_path / "result.txt"
    result = run(tmp_path, JobSpec(name="bg", script=str(SCRIPTS / "background.py"), args=[str(target)]))
    (job,) = result.jobs
    assert job.state == JobState.SUCCEEDED
    assert target.read_text() == "trained\n"  # written before the job was reported ended
    assert job.ended >= target.stat().st_mtime
    log = (Path(job.log_dir) / "stdout.log").read_text()
    assert log == "main returns\nresult written\natexit sees the result: True\n"


# -- issue 12 §6: a crash of the whole process -----------------------------------------


def test_a_segfault_in_one_job_leaves_a_crash_report_naming_it(tmp_path):
    logs = tmp_path / "logs"
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--log-dir", str(logs),
         str(SCRIPTS / "crash.py"), "0.5", ":", ENDING, "loop"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode in (-signal.SIGSEGV, 128 + signal.SIGSEGV), done.stderr  # the process is gone
    folder = (logs / "latest").resolve()
    crash = (folder / "crash.log").read_text()
    assert "Fatal Python error: Segmentation fault" in crash
    assert "runs job crash" in crash and 'crash.py", line' in crash
    report = json.loads((folder / "report.json").read_text())  # written while it ran
    assert report["run"]["state"] == "running"
    assert {j["name"]: j["state"] for j in report["jobs"]} == {"crash": "running", "ending": "running"}
    shown = subprocess.run(
        [sys.executable, "-m", "wwrun", "show", "--log-dir", str(logs)], capture_output=True, text=True, timeout=60,
    )
    assert "the process crashed in job crash: Fatal Python error: Segmentation fault" in shown.stdout


# -- issue 12 §7: escaping children ------------------------------------------------------


def _gone(pid: int, within: float = 15.0) -> bool:
    """Polls until the process is gone (or a zombie), for at most `within` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return True
        except psutil.NoSuchProcess:
            return True
        time.sleep(0.05)
    return False


def test_a_double_forked_daemon_is_ended_with_the_run(tmp_path):
    pidfile = tmp_path / "daemon.pid"
    result = run(tmp_path, JobSpec(name="d", script=str(SCRIPTS / "daemon.py"), args=[str(pidfile)]))
    assert result.exit_code == 0, (Path(result.jobs[0].log_dir) / "stderr.log").read_text()
    pid = int(pidfile.read_text())
    try:
        assert _gone(pid), "the daemon outlived the run"
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGKILL)


def test_a_retried_job_starts_again_under_the_engine(tmp_path):
    result = run(tmp_path, flaky("flaky", tmp_path / "count", 2), _mlp("mlp", 64, 32, steps=3), retries=1)
    flaky_job, mlp = result.jobs
    assert result.policy == "waterwave"
    assert (flaky_job.state, flaky_job.extra["attempts"]) == (JobState.SUCCEEDED, 2)
    assert mlp.state == JobState.SUCCEEDED


def test_a_job_leaving_its_executors_open_ends_as_under_python(tmp_path):
    # Their workers are non-daemon threads now (as under python), which interpreter
    # exit stops through concurrent.futures' own hook; the launcher does it per job.
    result = _launch_bounded(tmp_path, JobSpec(name="pools", script=str(SCRIPTS / "pools.py")), limit=60)
    (job,) = result.jobs
    assert job.state == JobState.SUCCEEDED, job.error
    assert (Path(job.log_dir) / "stdout.log").read_text() == "1024 27\n"


def test_an_interrupted_job_s_endless_thread_does_not_keep_the_process_alive(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path), str(SCRIPTS / "spinner.py")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    _wait_for_line(proc, "ready")
    proc.send_signal(signal.SIGINT)
    try:
        assert proc.wait(timeout=60) == 130
    finally:
        proc.kill()


def test_the_report_names_options_as_flags_recipes_and_the_dry_run_do(tmp_path):
    """One source of truth: the report's options are the recipe keys of the config's
    fields (the same as `--dry-run`'s defaults), with the values the run resolved."""
    import dataclasses

    from wwrun.config import options
    from wwrun.recipe import resolved_options

    script = Path(__file__).parent / "scripts" / "count_fds.py"
    config = LaunchConfig(jobs=[JobSpec(name="a", script=str(script))], log_dir=str(tmp_path / "logs"),
                          quiet=True, retries=1, timeout=600.0)
    result = launch(config)
    reported = json.loads((Path(result.log_dir) / "report.json").read_text())["run"]["options"]
    assert list(reported) == [f.name for f in options()]
    assert reported == resolved_options(dataclasses.replace(config, run_id=result.run_id))
    assert reported["retries"] == 1


def test_a_job_with_no_room_beside_the_others_starts_again_when_one_ends(tmp_path):
    """The engine's NoRoomYet (it fits alone, not beside the running jobs) is not the
    script's failure: the job is queued, not counted as an attempt, and starts again
    from the top once another job has ended."""
    scripts = Path(__file__).parent / "scripts"
    marker = tmp_path / "tried"
    jobs = [
        JobSpec(name="early", script=str(scripts / "wait_for_file.py"), args=[str(marker)]),
        JobSpec(name="late", script=str(scripts / "no_room_once.py"), args=[str(marker)]),
    ]
    events = tmp_path / "events.jsonl"
    result = launch(LaunchConfig(jobs=jobs, log_dir=str(tmp_path / "logs"), quiet=True,
                                 policy="concurrent", events=str(events)))
    assert [j.state.value for j in result.jobs] == ["succeeded", "succeeded"], result.to_dict()
    late = Path(result.log_dir) / "late"
    assert (late / "stdout.log").read_text() == "starting\ntrained\n"
    assert not (late / "error.json").exists()
    assert result.jobs[1].extra["attempts"] == 1
    states = [json.loads(line)["state"] for line in events.read_text().splitlines()
              if json.loads(line)["job"] == "late"]
    assert states[-3:] == ["queued", "running", "succeeded"]
    # It started again only after "early" had ended.
    assert result.jobs[1].started >= result.jobs[0].ended


def test_a_job_that_does_not_fit_yet_is_no_end_that_starts_another_again(tmp_path):
    """Two jobs that do not fit beside a running one both wait for its end: one
    queued again for want of room frees only what it had just taken, so it does not
    start the other again (two such jobs took turns failing, each starting the
    other, while the job they waited for ran on)."""
    first, second = tmp_path / "first", tmp_path / "second"
    jobs = [
        JobSpec(name="early", script=str(SCRIPTS / "wait_for_file.py"),
                args=[str(first), str(second), "--linger", "1"]),
        JobSpec(name="late1", script=str(SCRIPTS / "no_room_once.py"), args=[str(first)]),
        JobSpec(name="late2", script=str(SCRIPTS / "no_room_once.py"), args=[str(second)]),
    ]
    result = run(tmp_path, *jobs, policy="concurrent")
    assert [j.state.value for j in result.jobs] == ["succeeded"] * 3, result.to_dict()
    early = result.jobs[0]
    assert all(late.started >= early.ended for late in result.jobs[1:])
    assert [late.extra["attempts"] for late in result.jobs[1:]] == [1, 1]


def test_a_job_waiting_for_room_is_queued_with_its_reason_not_failed(tmp_path):
    """Not fitting beside the running jobs is a wait, not an error: no traceback in the
    job's output, the display and the events say what it waits for, and its
    `queued_s` counts the whole wait (issue 21)."""
    import io
    from datetime import datetime

    from wwrun.display import PlainDisplay

    marker = tmp_path / "tried"
    jobs = [ending("early", delay=1.0),
            JobSpec(name="late", script=str(SCRIPTS / "no_room_once.py"), args=[str(marker)])]
    events = tmp_path / "events.jsonl"
    out, err = io.StringIO(), io.StringIO()
    result = launch(LaunchConfig(jobs=jobs, log_dir=str(tmp_path / "logs"), events=str(events)),
                    display=PlainDisplay(out, err))
    assert [j.state.value for j in result.jobs] == ["succeeded", "succeeded"], result.to_dict()
    shown = out.getvalue() + err.getvalue()
    assert "NoRoomYet" not in shown
    assert "[wwrun] late: queued: does not fit beside the running jobs yet" in shown
    late = [json.loads(line) for line in events.read_text().splitlines() if json.loads(line)["job"] == "late"]
    queued = next(i for i, e in enumerate(late) if e["state"] == "queued" and i > 0 and late[i - 1]["state"] == "running")
    assert late[queued]["reason"].startswith("does not fit beside the running jobs yet")
    assert late[queued + 1]["state"] == "running" and "reason" not in late[queued + 1]
    waited = (datetime.fromisoformat(late[queued + 1]["time"]) - datetime.fromisoformat(late[queued]["time"]))
    assert waited.total_seconds() > 0.1  # it waited for "early" to end
    assert result.jobs[1].extra["queued_s"] >= waited.total_seconds() - 0.01
    assert "reason" not in result.to_dict()["jobs"][1]  # ended: it waits for nothing


@pytest.mark.parametrize("twice", [False, True], ids=["terminal", "timeout"])
def test_ctrl_c_to_the_process_group_is_handled_by_the_launcher_alone(tmp_path, twice):
    """A terminal's Ctrl-C reaches every process of the group, forked DataLoader
    workers included: they must act as under `python` (KeyboardInterrupt), not run the
    launcher's handler again; each job ends interrupted (exit 130), the one iterating
    through a tqdm bar too, before its workers' deaths fail it. `timeout -s INT`
    signals the launcher, then the group: one interrupt, not a forced stop."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "wwrun", "--device", "cpu", "--log-dir", str(tmp_path), "--grace-period", "30",
         str(SCRIPTS / "loader_forever.py"), ":", str(SCRIPTS / "loader_forever.py"), "--tqdm"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        _wait_for_line(proc, "ready", timeout=120)
        _wait_for_line(proc, "ready", timeout=120)
        if twice:
            proc.send_signal(signal.SIGINT)
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.count("interrupted: stopping every job") == 1, err
    assert "second interrupt" not in err and "did not stop within the grace period" not in out + err
    assert not [line for line in err.splitlines() if line.startswith(("Traceback", "Exception ignored"))], err
    jobs = json.loads((tmp_path / "latest" / "report.json").read_text())["jobs"]
    assert [(job["state"], job["exit_code"], job["error"]) for job in jobs] == [("interrupted", 130, "interrupted")] * 2
