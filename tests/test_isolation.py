"""Each job behaves as if started alone with `python script.py`, while others run.

The scripts under tests/scripts/ are real, unmodified programs; several run
concurrently in each test through the library API.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

import wwrun
from tests.forking import exit_code_of
from wwrun import JobSpec, LaunchConfig, isolation
from wwrun.launcher import JobState, launch

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parent.parent


def run(tmp_path, *jobs, **options):
    config = LaunchConfig(jobs=list(jobs), log_dir=str(tmp_path / "logs"), quiet=True, **options)
    return launch(config)


def log(result, name: str, stream: str = "stdout") -> str:
    return (Path(result.log_dir) / name / f"{stream}.log").read_text()


def job(name, script, *args, **fields):
    return JobSpec(name=name, script=str(SCRIPTS / script), args=[str(a) for a in args], **fields)


def test_a_job_s_own_pythonpath_is_on_its_sys_path(tmp_path):
    """A recipe's `env: {PYTHONPATH: ...}` was only in the job's environment, never on
    its sys.path: minGPT's projects (`from mingpt.model import GPT`) failed with "No
    module named 'mingpt'". Python puts those folders right after the script's."""
    for who in ("a", "b"):
        (tmp_path / f"lib_{who}").mkdir()
        (tmp_path / f"lib_{who}" / "pythonpath_helper.py").write_text(f"WHO = {who!r}\n")
    script = tmp_path / "uses_helper.py"
    script.write_text("import sys\nimport pythonpath_helper\nprint(pythonpath_helper.WHO, sys.path[1])\n")
    result = run(
        tmp_path,
        JobSpec(name="a", script=str(script), env={"PYTHONPATH": str(tmp_path / "lib_a")}),
        JobSpec(name="b", script=str(script), env={"PYTHONPATH": "lib_b"}, cwd=str(tmp_path)),  # from its cwd
        policy="concurrent",
    )
    assert result.exit_code == 0, [log(result, name, "stderr") for name in ("a", "b")]
    assert log(result, "a") == f"a {tmp_path / 'lib_a'}\n"
    assert log(result, "b") == f"b {tmp_path / 'lib_b'}\n"


def test_a_folder_beside_the_script_named_like_an_installed_package_leaves_the_package(tmp_path, monkeypatch):
    """A folder without `__init__.py` beside the script (wandb's `wandb/` run folder, a
    `datasets/` of data files) was taken for the job's own namespace package: `import
    wandb` got that empty folder ("module 'wandb' has no attribute 'init'"), where
    `python` imports the installed package. A folder whose name nothing else provides
    is still the job's own."""
    for name in ("wsgiref", "wsgiref.util"):  # a stdlib package, here the installed one
        monkeypatch.delitem(sys.modules, name, raising=False)
    (tmp_path / "wsgiref").mkdir()
    (tmp_path / "wsgiref" / "notes.txt").write_text("a run's files\n")
    (tmp_path / "own_folder").mkdir()
    (tmp_path / "own_folder" / "helper.py").write_text("WHO = 'mine'\n")
    script = tmp_path / "beside_folders.py"
    script.write_text("import wsgiref.util\nfrom own_folder import helper\n"
                      "print(wsgiref.util.guess_scheme({}), helper.WHO)\n")
    result = run(tmp_path, JobSpec(name="a", script=str(script)), JobSpec(name="b", script=str(script)),
                 policy="concurrent")
    assert result.exit_code == 0, [log(result, name, "stderr") for name in ("a", "b")]
    assert [log(result, name) for name in ("a", "b")] == ["http mine\n"] * 2


@pytest.mark.parametrize("python", ["3.12", "3.13"])
def test_a_library_s_exit_handler_runs_before_the_run_ends_its_service(tmp_path, monkeypatch, python):
    """wandb's service is a process the job starts; its teardown, registered with atexit,
    finishes the runs a script left open. The run's end ended the service first, and
    the teardown at the launcher's exit met a closed connection: a run without
    `wandb.finish()` lost its data ("Exception ignored in atexit callback ...
    ConnectionResetError"). The run's end now runs such handlers first, once each: one
    that another unregistered as it ran is not run (opentelemetry's "shutdown can only
    be called once", under wandb). Its `threading._register_atexit` hook runs too,
    whether Python records it as a partial or, from 3.13, as a lambda (the job's import
    of joblib failed on 3.13: "'function' object has no attribute 'func'")."""
    if python == "3.13":
        def register_as_python_3_13(func, *args, **kwargs):
            threading._threading_atexits.append(lambda: func(*args, **kwargs))

        monkeypatch.setitem(isolation._originals, "threading._register_atexit", register_as_python_3_13)
    monkeypatch.syspath_prepend(str(SCRIPTS / "imports" / "shared"))  # a library: the launcher's path
    monkeypatch.delitem(sys.modules, "exit_service", raising=False)
    written = tmp_path / "service.out"
    result = run(tmp_path, job("a", "imports/exit_service_job.py", written))
    assert result.exit_code == 0, log(result, "a", "stderr")
    assert log(result, "a") == "started\n"
    assert written.read_text() == "finished"
    assert (tmp_path / "service.out.provider").read_text() == "shutdown\n"
    assert (tmp_path / "service.out.hook").read_text() == "workers stopped"


def test_reloading_a_module_of_the_job_s_runs_its_code_again(tmp_path):
    """`importlib.reload` of a module beside the script returned the job's copy as it
    was (a notebook-style script editing its config module saw the old values); as
    under `python`, its code runs again, also on an import after `del sys.modules`."""
    script = tmp_path / "reloads.py"
    script.write_text(
        "import importlib, sys\nfrom pathlib import Path\n"
        "helper_py = Path(__file__).with_name('reloaded_helper.py')\n"
        "helper_py.write_text('VALUE = 1\\n')\nimport reloaded_helper\nseen = [reloaded_helper.VALUE]\n"
        "helper_py.write_text('VALUE = 22\\n')\nseen.append(importlib.reload(reloaded_helper).VALUE)\n"
        "helper_py.write_text('VALUE = 333\\n')\ndel sys.modules['reloaded_helper']\n"
        "import reloaded_helper\nseen.append(reloaded_helper.VALUE)\nprint(seen)\n")
    alone = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60)
    assert alone.stdout == "[1, 22, 333]\n", alone.stderr
    result = run(tmp_path, JobSpec(name="a", script=str(script)))
    assert result.exit_code == 0, log(result, "a", "stderr")
    assert log(result, "a") == alone.stdout


def test_same_sibling_module_name_stays_apart(tmp_path):
    result = run(
        tmp_path,
        job("a", "sibling_a/train.py", tmp_path / "a.pt"),
        job("b", "sibling_b/train.py", tmp_path / "b.pt"),
    )
    assert result.exit_code == 0, result.to_dict()
    # Each job got its own `model`, and pickling of its class round-tripped.
    assert "who=a in_features=3 module=model" in log(result, "a")
    assert "who=b in_features=5 module=model" in log(result, "b")


def test_script_without_main_guard_reads_its_own_argv_and_env(tmp_path):
    result = run(
        tmp_path,
        job("x", "no_guard.py", "--lr", "0.1", env={"EXTRA": "yes"}),
        job("y", "no_guard.py", "--lr", "0.2"),
    )
    assert result.exit_code == 0
    x, y = log(result, "x"), log(result, "y")
    assert "job=x argv=['--lr', '0.1'] argv0=no_guard.py joined=--lr 0.1" in x
    assert "job=y argv=['--lr', '0.2'] argv0=no_guard.py joined=--lr 0.2" in y
    # __main__ as with python; RANK is not invented; the recipe env reaches one job only.
    assert "main=__main__ rank=None extra=yes" in x
    assert "extra=None" in y


def test_working_directory_is_per_job_including_cpp_writes(tmp_path):
    import shutil

    folders = []
    for name in ("r1", "r2"):
        folder = tmp_path / name
        shutil.copytree(SCRIPTS / "relative", folder)
        folders.append(folder)
    result = run(
        tmp_path,
        JobSpec(name="r1", script=str(folders[0] / "train.py"), cwd=str(folders[0])),
        JobSpec(name="r2", script=str(folders[1] / "train.py"), cwd=str(folders[1])),
    )
    assert result.exit_code == 0, log(result, "r1", "stderr")
    for folder in folders:
        assert (folder / "ckpt.pt").is_file()  # written by torch.save's C++ code
        assert (folder / "out" / "done.txt").read_text() == str(folder)
    assert f"cwd {folders[0]} hidden 7" in log(result, "r1")
    assert Path.cwd() not in folders  # the launcher itself did not move


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_dataloader_workers_carry_the_job(tmp_path, context):
    result = run(
        tmp_path,
        job("dl1", "dataloader.py", "--context", context),
        job("dl2", "dataloader.py", "--context", context, cwd=str(tmp_path)),
    )
    assert result.exit_code == 0, log(result, "dl1", "stderr")
    expected = sum(i * i for i in range(16))
    for name, cwd in (("dl1", Path.cwd()), ("dl2", tmp_path)):
        out = log(result, name)
        assert f"total={expected}" in out
        # Worker processes write into their job's log, with its environment and folder.
        assert f"worker 0 job={name} cwd={cwd}" in out
        assert f"worker 1 job={name} cwd={cwd}" in out


def test_threads_logging_and_child_processes_carry_the_job(tmp_path):
    # Through the real CLI: in-process, pytest's own root-logger handlers would make
    # the script's logging.basicConfig a no-op.
    recipe = tmp_path / "children.yaml"
    script = SCRIPTS / "children.py"
    recipe.write_text(
        f"jobs:\n  - {{name: c1, script: {script}}}\n  - {{name: c2, script: {script}, cwd: {tmp_path}}}\n"
    )
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path / "logs"), "--report", str(report), str(recipe)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    logs = Path(json.loads(report.read_text())["run"]["log_dir"])
    for name, cwd in (("c1", Path.cwd()), ("c2", tmp_path)):
        out = (logs / name / "stdout.log").read_bytes().decode()  # bytes: keep the '\r'
        err = (logs / name / "stderr.log").read_text()
        assert f"thread job={name} cwd={cwd}" in out
        assert f"INFO logged from {name}" in err
        assert f"bar-{name}: 100%" in err  # tqdm writes to the job's stderr
        assert f"child {name} {cwd}" in out  # the job's own os.environ change reached it
        assert "progress 1/2\rprogress 2/2" in out


@pytest.mark.parametrize(
    "how, code, state",
    [
        ("exit3", 3, JobState.FAILED),
        ("exit256", 0, JobState.SUCCEEDED),
        ("exit_minus1", 255, JobState.FAILED),
        ("exit_builtin", 4, JobState.FAILED),
        ("exit_text", 1, JobState.FAILED),
        ("raise", 1, JobState.FAILED),
        ("os_exit", 5, JobState.FAILED),
        ("ok", 0, JobState.SUCCEEDED),
    ],
)
def test_each_way_of_ending_ends_that_job_only(tmp_path, how, code, state):
    result = run(tmp_path, job("end", "ending.py", how), job("other", "ending.py", "ok", 0.3))
    ending, other = result.jobs
    assert (ending.state, ending.exit_code) == (state, code)
    assert (other.state, other.exit_code) == (JobState.SUCCEEDED, 0)
    assert "after ok" in log(result, "other")
    assert result.exit_code == code
    assert result.root_cause == (None if code == 0 else "end")
    assert "atexit ran" in log(result, "other")
    assert ("atexit ran" in log(result, "end")) == (how != "os_exit")  # os._exit skips them, as in Python


def test_uncaught_exception_keeps_its_traceback(tmp_path):
    result = run(tmp_path, job("bad", "ending.py", "raise"), job("good", "ending.py", "ok"))
    error = json.loads((Path(result.log_dir) / "bad" / "error.json").read_text())
    assert error["exit_code"] == 1
    assert error["error"] == "RuntimeError: boom in job"
    assert 'ending.py", line' in error["traceback"]
    launcher_frames = f'File "{Path(wwrun.__file__).parent}{os.sep}'
    assert launcher_frames not in error["traceback"]  # (the checkout's path may contain "wwrun")
    assert "RuntimeError: boom in job" in log(result, "bad", "stderr")
    assert not (Path(result.log_dir) / "good" / "error.json").exists()


def test_module_job_runs_like_python_dash_m(tmp_path):
    spec = JobSpec(name="mod", module="mypkg", args=["--flag"], cwd=str(SCRIPTS / "pkgjob"))
    result = run(tmp_path, spec, job("other", "ending.py", "ok"))
    assert result.exit_code == 0, log(result, "mod", "stderr")
    assert "module main=__main__ package=mypkg value=42 argv=['--flag']" in log(result, "mod")


def test_a_job_s_environ_is_python_s_own_mapping_type_holding_its_variables(tmp_path):
    """A plain dict failed what code may ask of `os.environ`: Hydra's `vars(os.environ)`
    (TypeError), so that every `@hydra.main` script failed under wwrun."""
    result = run(tmp_path, job("a", "environ_type.py"), job("b", "environ_type.py"))
    assert result.exit_code == 0, [log(result, n, "stderr") for n in ("a", "b")]
    for name in ("a", "b"):
        # As under python, but C's getenv: the launcher's environment (the README's table).
        assert log(result, name) == "True dict dict yes yes False None\nTypeError: str expected, not int\n"
    assert "SET_BY_JOB" not in os.environ


def test_each_job_s_logging_configuration_writes_its_own_file(tmp_path):
    """The root logger's handlers were the process's: the first job's `basicConfig`
    took every job's records into its file, and the others' calls did nothing. A
    `dictConfig` (Hydra's job logging) replaced the other jobs' handlers, and closed
    every handler of the process: one opened with mode "w" dropped its records."""
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    names = {"a": "basic", "b": "basic", "c": "dict"}
    launchers = list(logging.getLogger().handlers)  # pytest's own
    result = run(tmp_path, *(job(n, "basic_config.py", tmp_path / f"{n}.log", n, rendezvous, len(names), how)
                             for n, how in names.items()), policy="concurrent")
    assert result.exit_code == 0, [log(result, n, "stderr") for n in names]
    for name in names:
        assert (tmp_path / f"{name}.log").read_text() == (
            f"root {name} step 0\nlibrary {name} from a shared logger\n"
            f"root {name} step 1\nlibrary {name} from a shared logger\n")
        assert log(result, name) == "handlers 1\n"
    assert logging.getLogger().handlers == launchers


def test_launcher_state_is_untouched_by_jobs(tmp_path):
    import os

    argv, cwd, env = list(sys.argv), os.getcwd(), dict(os.environ)
    run(tmp_path, job("x", "no_guard.py", "--a"), job("c", "children.py", cwd=str(tmp_path)))
    assert list(sys.argv) == argv
    assert os.getcwd() == cwd
    assert "SET_BY_JOB" not in os.environ and dict(os.environ) == env
    assert sys.modules["__main__"].__name__ == "__main__"


@pytest.mark.gpu
@pytest.mark.fresh_process  # wwrun's allocator installs only before CUDA is initialised
def test_each_job_runs_on_its_own_cuda_stream(tmp_path):
    result = run(tmp_path, job("s1", "stream.py"), job("s2", "stream.py"), device="cuda")
    assert result.exit_code == 0, log(result, "s1", "stderr")
    assert result.extra["allocator"] == "waterwave"  # the job streams wwrun's allocator makes
    lines = [log(result, name).strip() for name in ("s1", "s2")]
    streams = {line.split()[0] for line in lines}
    assert len(streams) == 2  # two different streams
    assert all("default=False ok=True" in line for line in lines)


def test_pyplot_figures_are_per_job(tmp_path):
    pytest.importorskip("matplotlib")
    rendezvous = tmp_path / "drawn"
    rendezvous.mkdir()
    names = ["p", "q", "r"]
    result = run(
        tmp_path,
        *(job(n, "pyplot_figures.py", rendezvous, len(names), n, env={"MPLBACKEND": "Agg"}) for n in names),
    )
    assert result.exit_code == 0, result.to_dict()
    for name in names:
        # Each job numbers its figures from 1, as when run alone, and draws only into its own.
        assert "fignums=[1] own=True" in log(result, name)
        assert "after_close=[]" in log(result, name)


def test_an_interrupt_landing_in_a_finalizer_still_reaches_the_job(tmp_path):
    """Python drops an exception raised in `__del__` ("Exception ignored in ..."); an
    interrupt that lands there is raised again in the job, so its `finally:` runs."""
    import threading

    count = 4
    ready = [tmp_path / f"ready{i}" for i in range(count)]

    def interrupt_once_all_run():
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in ready) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.3)  # deep in their loops, mostly inside finalizers
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt_once_all_run, daemon=True).start()
    jobs = [job(f"f{i}", "finalizers.py", ready[i], tmp_path / f"ckpt{i}") for i in range(count)]
    result = run(tmp_path, *jobs, policy="concurrent", grace_period_s=20)
    assert [j.state.value for j in result.jobs] == ["interrupted"] * count, result.to_dict()
    assert [j.error for j in result.jobs if "grace period" in (j.error or "")] == []
    assert all((tmp_path / f"ckpt{i}").read_text() == "saved" for i in range(count))


def _interrupt_while_inside(enter_and_wait, gate) -> list[str]:
    """Interrupt a thread while `enter_and_wait()` holds it inside lock-taking code
    until `gate.release` is set; what the thread saw, in order."""
    import threading


    outcome = []

    def target():
        try:
            enter_and_wait()
            outcome.append("done")
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                time.sleep(0.01)
            outcome.append("never interrupted")
        except KeyboardInterrupt:
            outcome.append("interrupted")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    assert gate.entered.wait(60), "the thread never got inside"
    assert isolation.interrupt(thread.ident)
    gate.release.set()
    thread.join(60)
    return outcome


def _gate(monkeypatch):
    import threading
    import types

    gate = types.ModuleType("wwrun_test_gate")
    gate.entered, gate.release = threading.Event(), threading.Event()
    monkeypatch.setitem(sys.modules, gate.__name__, gate)
    return gate


WAIT_AT_GATE = "entered.set()\nwhile not release.is_set():\n    time.sleep(0.01)\n"


def test_an_interrupt_waits_for_the_import_it_would_break(tmp_path, monkeypatch):
    """Landing inside an import, an interrupt can leave one of importlib's module locks
    held by a thread that is gone (the next job importing the module then waits
    forever): it is raised once the import is done, and the module is imported whole."""
    gate = _gate(monkeypatch)
    (tmp_path / "wwrun_test_slow_import.py").write_text(
        "import time\nfrom wwrun_test_gate import entered, release\n" + WAIT_AT_GATE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "wwrun_test_slow_import", raising=False)

    def import_it():
        import wwrun_test_slow_import  # noqa: F401

    assert _interrupt_while_inside(import_it, gate) == ["done", "interrupted"]
    assert "wwrun_test_slow_import" in sys.modules


def test_an_interrupt_waits_for_the_logging_call_it_would_break(monkeypatch):
    """logging takes its locks in Python code too (an interrupt landing there left its
    module lock held, and torch's log call at exit hung the process after the
    summary): it is raised once the call is done."""
    import logging

    gate = _gate(monkeypatch)

    class SlowHandler(logging.Handler):
        def emit(self, record):
            exec(WAIT_AT_GATE, {"time": time, "entered": gate.entered, "release": gate.release})

    logger = logging.getLogger("wwrun_test_slow_logging")
    logger.propagate = False
    handler = SlowHandler()
    logger.addHandler(handler)
    try:
        assert _interrupt_while_inside(lambda: logger.warning("slow"), gate) == ["done", "interrupted"]
    finally:
        logger.removeHandler(handler)


def test_an_interrupt_not_raised_before_the_job_ended_is_dropped(tmp_path):
    """A Ctrl-C set in a job's thread while it waits in C (a lock, a DataLoader's
    queue) is raised when the wait returns: if the job's script ended meanwhile, it
    would land in wwrun's cleanup of the job (a finalizer's "Exception ignored", the
    thread ending unreported). Once the job is closed, it is dropped, and later ones
    are not delivered."""
    import signal
    import threading


    ctx = isolation.JobContext(name="j", argv=["j"], environ={}, cwd=str(tmp_path), local_roots=[],
                               stdout=sys.stdout, stderr=sys.stderr, stdout_fd=1, stderr_fd=2)
    release, outcome = threading.Event(), []

    def target():
        ctx.thread_id = threading.get_ident()
        try:
            release.wait(60)
            outcome.append("cleaned up")
        except KeyboardInterrupt:
            outcome.append("interrupted in cleanup")

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not _waiting_in(thread, "wait"):
        assert time.monotonic() < deadline, "the thread never waited"
        time.sleep(0.01)
    isolation.deliver_signal(ctx, signal.SIGINT)  # set, raised once the wait returns
    isolation.close_interrupts(ctx)  # the job ended meanwhile
    isolation.deliver_signal(ctx, signal.SIGINT)  # too late: nothing to interrupt
    release.set()
    thread.join(60)
    assert outcome == ["cleaned up"]


def test_a_trace_function_set_after_another_job_ended_runs(tmp_path):
    """Ending a job drops its undelivered interrupt; on Python 3.11 that left the
    interpreter's "asynchronous exception pending" flag up for good, and the next
    thread to set a trace function (a debugger, coverage) spun at its next call."""
    script = str(SCRIPTS / "traced.py")
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--policy", "sequential", "--log-dir", str(tmp_path / "logs"),
         "--report", str(tmp_path / "report.json"), script, ":", script],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    logs = Path(json.loads((tmp_path / "report.json").read_text())["run"]["log_dir"])
    assert [(path / "stdout.log").read_text() for path in sorted(logs.iterdir()) if path.is_dir()] \
        == ["traced calls=3 total=6\n"] * 2


def test_thread_trace_and_profile_functions_stay_in_their_job(tmp_path):
    """threading.settrace/setprofile (coverage, a profiler) in one job: its threads run
    its functions, as under python, and another job's threads run none (they ran the
    first job's tracer, in their own namespace)."""
    import threading

    flag = tmp_path / "hooks-set"
    result = run(tmp_path, job("hooks", "thread_hooks.py", "set", flag), job("plain", "thread_hooks.py", "none", flag))
    assert result.exit_code == 0, log(result, "plain", "stderr")
    assert log(result, "hooks") == ("set: thread has trace=tracer profile=profiler; threading has tracer, profiler; "
                                    "traced step 2, profiled step 2\n")
    assert log(result, "plain") == ("none: thread has trace=None profile=None; threading has None, None; "
                                    "traced step 0, profiled step 0\n")
    assert (threading.gettrace(), threading.getprofile()) == (None, None)  # the launcher's: untouched


def test_excepthooks_and_thread_names_are_the_job_s_own(tmp_path):
    """One job's `sys.excepthook` prints its uncaught error, and its
    `threading.excepthook` its threads' (wwrun printed its own traceback, and the hook
    a job set caught the other jobs' threads' errors); a job's threads are numbered
    from Thread-1, with no wwrun frame in their tracebacks: each job's stderr is what
    `python` prints."""
    flag = tmp_path / "hooks-set"
    result = run(tmp_path, job("hooks", "excepthooks.py", "hooks", flag), job("plain", "excepthooks.py", "plain", flag))
    assert [j.error for j in result.jobs] == ["ValueError: hooks", "ValueError: plain"]
    assert log(result, "hooks", "stderr") == "own thread hook: KeyError in Thread-1 (fail)\nown hook: ValueError: hooks\n"
    for mode in ("hooks", "plain"):
        alone = subprocess.run([sys.executable, str(SCRIPTS / "excepthooks.py"), mode, str(flag)],
                               capture_output=True, text=True, timeout=120)
        assert log(result, mode, "stderr") == alone.stderr


def test_a_job_s_thread_is_its_main_thread(tmp_path):
    result = run(tmp_path, job("a", "main_thread.py"), job("b", "main_thread.py"))
    assert result.exit_code == 0, log(result, "a", "stderr")
    alone = subprocess.run([sys.executable, str(SCRIPTS / "main_thread.py")], capture_output=True, text=True,
                           timeout=120)
    assert alone.stdout == "MainThread True\nThread-1 (helper) sees the main thread: True\n"
    assert log(result, "a") == log(result, "b") == alone.stdout


def test_each_job_sets_its_own_multiprocessing_start_method(tmp_path, recwarn):
    """Shared, the second job's `set_start_method` failed ("context has already been
    set"): a sweep of such a script lost every job but the first."""
    import multiprocessing

    launchers = multiprocessing.get_start_method(allow_none=True)
    jobs = [job(f"m{i}", "start_method.py", method) for i, method in enumerate(("spawn", "forkserver", "spawn"))]
    result = run(tmp_path, *jobs)
    assert result.exit_code == 0, [log(result, j.name, "stderr") for j in jobs]
    assert [log(result, j.name) for j in jobs] == [f"{m} [0, 1, 4, 9]\n" for m in ("spawn", "forkserver", "spawn")]
    assert multiprocessing.get_start_method(allow_none=True) == launchers  # untouched
    # multiprocessing's resource tracker, which the first run started, was stopped as
    # at exit, not killed: the next run's jobs start their own, with nothing said.
    again = run(tmp_path / "again", job("m", "start_method.py", "spawn"))
    assert again.exit_code == 0
    assert [str(w.message) for w in recwarn if "resource_tracker" in str(w.message)] == []


def test_a_run_forgets_a_resource_tracker_that_ended_before_it(recwarn):
    """A tracker this process started that has since ended (killed here) is forgotten at
    a run's start, as a fresh process has none: the run's jobs start their own without
    "resource_tracker: process died unexpectedly, relaunching" in their output."""
    import multiprocessing.resource_tracker

    from wwrun import host

    tracker = multiprocessing.resource_tracker._resource_tracker
    tracker.ensure_running()
    os.kill(tracker._pid, signal.SIGKILL)
    os.waitid(os.P_PID, tracker._pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped
    host.forget_dead_resource_tracker()
    assert tracker._fd is None and tracker._pid is None
    tracker.ensure_running()  # a fresh one, silently
    assert [str(w.message) for w in recwarn if "resource_tracker" in str(w.message)] == []
    host.forget_dead_resource_tracker()  # alive: left as it is
    assert tracker._fd is not None and os.waitpid(tracker._pid, os.WNOHANG) == (0, 0)


def test_each_job_s_forkserver_workers_run_in_its_environment_and_print_to_its_log(tmp_path):
    """multiprocessing's forkserver was one for the process, started in the first job's
    environment and output: the other job's workers ran there."""
    jobs = [job(name, "forkserver_env.py", env={"TAG": name}) for name in ("one", "two")]
    result = run(tmp_path, *jobs)
    assert result.exit_code == 0, [log(result, j.name, "stderr") for j in jobs]
    for name in ("one", "two"):
        assert sorted(log(result, name).splitlines()) == [f"got ['{name}']", f"worker of {name}"]


def test_a_child_of_os_fork_ends_with_the_script_s_exit_code(tmp_path):
    """The child went on into wwrun's cleanup of the job and waited for good for a
    lock that a thread of the launcher held at the fork, and so did its parent."""
    done = subprocess.run([sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path / "logs"),
                           "--report", str(tmp_path / "report.json"), str(SCRIPTS / "forks.py")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    logs = Path(json.loads((tmp_path / "report.json").read_text())["run"]["log_dir"])
    assert (logs / "forks" / "stdout.log").read_text() == "first child: 3\nsecond child: 0\n"


def test_a_signal_sent_to_the_process_reaches_each_job_s_handler_or_ends_the_job(tmp_path):
    """SIGUSR1 (a cluster's "checkpoint now"), SIGUSR2, SIGHUP: left to the process,
    one ended every job at once, even a lone job with its own handler."""
    import threading

    flags = [tmp_path / "handler-ready", tmp_path / "default-ready"]

    def signal_once_both_wait():
        deadline = time.monotonic() + 60
        while not all(flag.exists() for flag in flags) and time.monotonic() < deadline:
            time.sleep(0.01)
        os.kill(os.getpid(), signal.SIGUSR1)

    threading.Thread(target=signal_once_both_wait, daemon=True).start()
    result = run(tmp_path, job("handler", "signals.py", "handler", flags[0]),
                 job("default", "signals.py", "default", flags[1]))
    fresh = "fresh: 0 True\n"  # SIG_DFL and Python's own SIGINT handler, not the launcher's
    assert log(result, "handler") == fresh + "handled [10]\n"
    assert log(result, "default") == fresh  # ended as SIGUSR1 ends a process: silently
    assert [(j.state.value, j.exit_code, j.error) for j in result.jobs] == [
        ("succeeded", 0, None), ("failed", 138, "killed by SIGUSR1")]


def test_a_signal_ignored_at_the_start_stays_ignored_as_under_python(tmp_path):
    """`nohup wwrun ...` ignores SIGHUP, and a `python` process keeps it ignored. Under
    wwrun the SIGHUP nohup was there to ignore (a closing terminal's) ended the job
    (code 129)."""
    script = str(SCRIPTS / "ignored_signals.py")

    def ignoring():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    alone = subprocess.run([sys.executable, script], preexec_fn=ignoring, capture_output=True, text=True,
                           timeout=60)
    assert alone.stdout == "True\nsurvived\n", alone.stderr
    done = subprocess.run([sys.executable, "-m", "wwrun", "--quiet", "--log-dir", str(tmp_path / "logs"), script],
                          preexec_fn=ignoring, capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "logs" / "latest" / "ignored_signals" / "stdout.log").read_text() == alone.stdout


def test_a_job_s_own_signals_and_alarms_reach_it_alone(tmp_path):
    """`os.kill(os.getpid(), ...)` and an alarm's SIGALRM are the job's: they reached
    every job (ending those without a handler), and an alarm a job left set ended the
    others after it was over; a handler's exception keeps its message."""
    result = run(tmp_path, job("self", "signals.py", "self"), job("alarm", "signals.py", "alarm"))
    assert result.exit_code == 0, [j.error for j in result.jobs]
    for mode in ("self", "alarm"):
        alone = subprocess.run([sys.executable, str(SCRIPTS / "signals.py"), mode], capture_output=True, text=True,
                               timeout=120)
        assert log(result, mode) == alone.stdout
    assert log(result, "alarm").endswith("timed out: step took too long alarm left: 0\n")
    assert log(result, "self").endswith("handled [10]\n")


def test_one_job_switching_the_collector_off_leaves_the_others_collecting(tmp_path):
    flag = tmp_path / "off"
    result = run(tmp_path, job("off", "gc_switch.py", "off", flag), job("cycles", "gc_switch.py", "cycles", flag))
    assert result.exit_code == 0, [j.error for j in result.jobs]
    assert log(result, "off") == "enabled: False threshold: 10000\nenabled again: True\n"
    assert log(result, "cycles") == "enabled: True mostly collected: True\n"
    import gc

    assert gc.isenabled()  # the launcher's


def test_an_exec_replaces_the_job_and_os_exit_skips_atexit(tmp_path):
    """`os.execv` in a job replaced the whole process: every job ended, without a
    word, exit code 0. The program now runs in the job's place (its folder, its
    environment, its log) and the job ends with its code; neither an exec nor
    `os._exit` runs atexit handlers (wwrun ran them after `os._exit`)."""
    folder = tmp_path / "here"
    folder.mkdir()
    result = run(tmp_path, job("exec", "exec_self.py", "exec", cwd=str(folder), env={"TAG": "mine"}),
                 job("exit", "exec_self.py", "_exit"), job("after", "ending.py", "ok"))
    assert [(j.name, j.exit_code) for j in result.jobs] == [("exec", 5), ("exit", 3), ("after", 0)]
    assert log(result, "exec") == "before\nexec: here mine\n"
    assert log(result, "exit") == "before\n"
    for mode, expected in (("exec", log(result, "exec")), ("_exit", "before\n")):
        alone = subprocess.run([sys.executable, str(SCRIPTS / "exec_self.py"), mode], capture_output=True, text=True,
                               timeout=120, cwd=folder, env={**os.environ, "TAG": "mine"})
        assert alone.stdout == expected


def test_two_jobs_profiling_at_once_take_turns(tmp_path):
    """torch's profiler is one per process: two jobs profiling at once crashed the
    process (a segfault as the first stopped). The second waits for the first's
    session, and each profile holds its own job's ops only."""
    script = str(SCRIPTS / "profiled.py")
    done = subprocess.run([sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path / "logs"),
                           "--report", str(tmp_path / "report.json"), script, "mm", ":", script, "sin"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    logs = Path(json.loads((tmp_path / "report.json").read_text())["run"]["log_dir"])
    assert (logs / "profiled" / "stdout.log").read_text() == "mm saw aten::mm True aten::sin False\n"
    assert (logs / "profiled-2" / "stdout.log").read_text() == "sin saw aten::mm False aten::sin True\n"


def test_a_job_s_faulthandler_watchdog_ends_that_job_alone(tmp_path):
    """`faulthandler.dump_traceback_later(exit=True)` was the process's: it ended
    every job, also once the job that armed it had ended; `faulthandler.enable()` in
    a job took the run's crash log over."""
    result = run(tmp_path, job("enable", "watchdog.py", "enable"), job("hang", "watchdog.py", "hang"),
                 job("armed", "watchdog.py", "armed"), job("outlive", "watchdog.py", "outlive"))
    states = {j.name: (j.exit_code, j.state.value) for j in result.jobs}
    assert states == {"enable": (0, "succeeded"), "hang": (1, "failed"), "armed": (0, "succeeded"),
                      "outlive": (0, "succeeded")}, [j.error for j in result.jobs]
    assert log(result, "enable") == "enabled: True\ndisabled: True\n"
    assert log(result, "outlive") == "outlived it\n"
    alone = subprocess.run([sys.executable, str(SCRIPTS / "watchdog.py"), "hang"], capture_output=True, text=True,
                           timeout=120)
    thread = re.compile("Thread 0x[0-9a-f]+")
    assert alone.returncode == 1 and alone.stderr.startswith("Timeout (0:00:00.300000)!\nThread 0x")
    assert thread.sub("Thread", log(result, "hang", "stderr")) == thread.sub("Thread", alone.stderr)


def test_modules_in_a_folder_a_job_adds_to_its_path_are_its_own(tmp_path):
    """Two repositories, each `sys.path.insert(0, <repo>/lib)` then `import models`:
    the second job got the first one's `models` (already in sys.modules) and trained
    the wrong model without a word. A folder without `__init__.py` in a package
    (a namespace package, as in locuslab/TCN) is the job's too."""
    jobs = []
    for repo in ("repoA", "repoB"):
        (tmp_path / repo / "lib" / "models" / "nets").mkdir(parents=True)
        (tmp_path / repo / "lib" / "models" / "__init__.py").write_text(f"WHO = {repo!r}\n")
        (tmp_path / repo / "lib" / "models" / "nets" / "mlp.py").write_text(f"WHO = {repo + '.mlp'!r}\n")
        script = tmp_path / repo / "train.py"
        script.write_text("import os, sys\n"
                          "sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), 'lib'))\n"
                          "import models\nfrom models.nets import mlp\nprint(models.WHO, mlp.WHO)\n")
        jobs.append(JobSpec(name=repo, script=str(script)))
    result = run(tmp_path, *jobs)
    assert result.exit_code == 0, [log(result, j.name, "stderr") for j in jobs]
    assert [log(result, repo) for repo in ("repoA", "repoB")] == ["repoA repoA.mlp\n", "repoB repoB.mlp\n"]


def test_each_job_has_its_own_main_logger(tmp_path):
    """`logging.getLogger(__name__)` is "__main__" in every script: one logger, so each
    job's handler printed both jobs' records and one job's level hid the other's."""
    flags = [tmp_path / "a", tmp_path / "b"]
    result = run(tmp_path, job("a", "named_logger.py", "a", "INFO", flags[0], flags[1]),
                 job("b", "named_logger.py", "b", "WARNING", flags[1], flags[0]))
    assert result.exit_code == 0, [j.error for j in result.jobs]
    tail = "handlers: 1 child's parent is mine: True\n"
    assert log(result, "a") == "a: INFO info\na: WARNING warning\n" + tail
    assert log(result, "b") == "b: WARNING warning\n" + tail
    alone = subprocess.run([sys.executable, str(SCRIPTS / "named_logger.py"), "b", "WARNING", flags[1], flags[0]],
                           capture_output=True, text=True, timeout=120)
    assert alone.stdout == log(result, "b")


def test_os_write_and_os_system_output_lands_in_the_job_s_log(tmp_path):
    """`os.write(1, ...)` went to wwrun's console, untagged and in no log; `os.system`
    ran with the launcher's environment and wrote there too."""
    result = run(tmp_path, job("raw", "raw_output.py"), job("other", "ending.py", "ok"))
    assert result.exit_code == 0, log(result, "raw", "stderr")
    alone = subprocess.run([sys.executable, str(SCRIPTS / "raw_output.py")], capture_output=True, text=True,
                           timeout=120)
    assert alone.stdout == "raw stdout\nsystem: set by the script\nstatus 768 3\n"
    assert (log(result, "raw"), log(result, "raw", "stderr")) == (alone.stdout, alone.stderr)


def test_a_job_s_dataloader_workers_end_with_it(tmp_path):
    """Python terminates a process's daemonic children at exit; left alive, each of a
    DataLoader's 4 workers held the job's end for its 5 s join timeout (20 s), in the
    iterator's finalizer, as the job's namespaces were collected."""
    from torch.utils.data._utils import MP_STATUS_CHECK_INTERVAL

    result = run(tmp_path, job("workers", "loader_workers.py"))
    assert result.exit_code == 0, log(result, "workers", "stderr")
    assert log(result, "workers") == "fit 4032\n"
    assert result.wall_s < 2 * MP_STATUS_CHECK_INTERVAL, result.wall_s  # not 4 of them


def test_a_run_ends_beside_a_child_a_timed_out_job_left_holding_the_resource_tracker(tmp_path):
    """The run's end stopped multiprocessing's resource tracker before it ended the
    jobs' children, and waited for it: the tracker ends only once every holder of its
    pipe has, and a spawned child of a job its timeout ended held it. The run never
    ended."""
    done = subprocess.run([sys.executable, "-m", "wwrun", "--timeout", "2s", "--grace-period", "1s",
                           "--log-dir", str(tmp_path / "logs"), "--report", str(tmp_path / "report.json"),
                           str(SCRIPTS / "child_forever.py")], capture_output=True, text=True, timeout=60)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["jobs"][0]["exit_code"] == 124, done.stderr
    child = int((Path(report["run"]["log_dir"]) / "child_forever" / "stdout.log").read_text())
    try:
        state = Path(f"/proc/{child}/stat").read_text().split()[2]
    except FileNotFoundError:
        state = "gone"
    assert state in ("gone", "Z")


def test_sys_dunder_streams_are_the_job_s_own(tmp_path):
    """`sys.__stdout__` was wwrun's console: `sys.stdout = sys.__stdout__` (restoring
    after a redirect) sent the rest of the job's output there, untagged, in no log."""
    result = run(tmp_path, job("a", "restore_stdout.py", tmp_path / "a.txt"),
                 job("b", "restore_stdout.py", tmp_path / "b.txt"))
    assert result.exit_code == 0, [j.error for j in result.jobs]
    alone = subprocess.run([sys.executable, str(SCRIPTS / "restore_stdout.py"), str(tmp_path / "alone.txt")],
                           capture_output=True, text=True, timeout=120)
    assert alone.stdout == "to __stdout__\nrestored via __stdout__\n" and alone.stderr == "to __stderr__\n"
    for name in ("a", "b"):
        assert (log(result, name), log(result, name, "stderr")) == (alone.stdout, alone.stderr)
        assert (tmp_path / f"{name}.txt").read_text() == "redirected\n"


def test_runpy_running_a_script_as_main_swaps_only_its_job_s_main(tmp_path):
    """runpy put its module in `sys.modules["__main__"]` for every job: another job's
    `__main__` was the inner script's meanwhile, and its classes did not pickle."""
    flag, done = tmp_path / "inner-running", tmp_path / "checked"
    result = run(tmp_path, job("outer", "runpy_outer.py", flag, done), job("side", "pickles_main.py", flag, done))
    assert result.exit_code == 0, [log(result, j, "stderr") for j in ("outer", "side")]
    assert log(result, "outer") == "inner: runpy_inner.py Inner\nouter's __main__ again: runpy_outer.py\n"
    assert log(result, "side") == "mine: pickles_main.py Mine\n"


PENDING_ELSEWHERE = """
import sys, threading, time
from wwrun import isolation

outcome, release = [], threading.Event()

def blocked():  # its Ctrl-C is set while it waits in C, where none reaches it
    try:
        release.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pass
        outcome.append("B never interrupted")
    except KeyboardInterrupt:
        outcome.append("B interrupted")

def step():
    return 1

def finalizer(frame):  # where the Ctrl-C landed: it is raised again in `frame`
    isolation._raise_at_next_line(frame, KeyboardInterrupt)
    step()  # the finalizer goes on, and calls

def redelivered():
    try:
        finalizer(sys._getframe())
        outcome.append("A not interrupted")
    except KeyboardInterrupt:
        outcome.append("A interrupted")

b = threading.Thread(target=blocked, daemon=True)
b.start()
while sys._current_frames()[b.ident].f_code.co_name != "wait":
    time.sleep(0.01)
isolation._set_async_exc(b.ident, KeyboardInterrupt)
a = threading.Thread(target=redelivered, daemon=True)
a.start()
a.join(30)
release.set()
while b.is_alive():  # this thread's turns at the GIL are where B looks for its own
    time.sleep(0.01)
print(outcome)
"""


def test_an_interrupt_raised_again_is_raised_while_another_job_s_is_pending():
    """A Ctrl-C that landed in a finalizer is raised again at the job's next line, by
    a trace function; while another job's Ctrl-C was still pending (that job waiting
    in C), Python 3.11 kept the trace from ever running: the job spun, perhaps with
    the engine's lock held, and the other waited for the lock. The other job still
    gets its own Ctrl-C."""
    done = subprocess.run([sys.executable, "-c", PENDING_ELSEWHERE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "['A interrupted', 'B interrupted']"


def _waiting_in(thread, function: str) -> bool:
    frame = sys._current_frames().get(thread.ident)
    return frame is not None and frame.f_code.co_name == function


def test_rebinding_process_wide_names_stays_in_the_job(tmp_path):
    # sys.argv, os.environ, sys.path and sys.stdout rebound by two jobs at once.
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    names = ["a", "b"]
    result = run(tmp_path, *(job(n, "rebind.py", n, rendezvous, len(names), tmp_path) for n in names))
    assert result.exit_code == 0, [log(result, n, "stderr") for n in names]
    for name in names:
        out = log(result, name)
        tee = (tmp_path / f"{name}.tee").read_text()
        for text in (out, tee):
            assert f"argv=['prog', '--who={name}'] json=[\"prog\", \"--who={name}\"]" in text
            assert f"environ={name} {name} merged={name}" in text
            assert f"path0=/nonexistent/{name} types=list,list,dict" in text
            assert "plain=True" in text  # pickle and torch.save see plain list/dict
        assert f"restored {name}" in out and "restored" not in tee
    assert "--who=a" not in sys.argv and "WHO" not in os.environ
    assert not any(p.startswith("/nonexistent") for p in sys.path)


def test_memory_of_ended_jobs_is_returned(tmp_path):
    # Each hog keeps a tensor in a module global; by the time the watcher runs, every
    # earlier hog has ended and its tensor must be gone (a weak reference, not RSS).
    sys.modules.pop("_wwrun_test_hogs", None)
    hogs = [job(f"hog{i}", "memory/hog.py", 16) for i in range(3)]
    result = run(tmp_path, *hogs, job("watch", "memory/watch.py"), policy="sequential")
    assert result.exit_code == 0, log(result, "watch", "stderr")
    assert "hogs=3 alive=0" in log(result, "watch")
    sys.modules.pop("_wwrun_test_hogs", None)


def test_closing_standard_fds_in_a_job_leaves_the_console_to_the_others(tmp_path):
    # Through the CLI in a subprocess: os.close(1) there would close pytest's own fd.
    report = tmp_path / "closed"
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--tee", "--log-dir", str(tmp_path / "logs"),
         str(SCRIPTS / "close_std.py"), str(report), ":",
         str(SCRIPTS / "wait_then_print.py"), str(report), "talker still heard"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert report.read_text() == "print raised errno 9"  # EBADF, as under python
    assert "[wait_then_print] talker still heard" in done.stdout
    assert "closer before" in done.stdout and "closer after" not in done.stdout


@pytest.fixture
def fresh_circular():
    saved = sys.getswitchinterval()
    for name in [n for n in sys.modules if n.split(".")[0] == "circular"]:
        del sys.modules[name]
    yield
    sys.setswitchinterval(saved)
    for name in [n for n in sys.modules if n.split(".")[0] == "circular"]:
        del sys.modules[name]


def test_jobs_importing_a_circular_package_at_once_see_it_whole(tmp_path, fresh_circular, monkeypatch):
    # On the launcher's path too: a library every job shares (a folder only the jobs
    # add to their sys.path holds modules of their own).
    monkeypatch.syspath_prepend(str(SCRIPTS / "imports" / "shared"))
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    entries = ["circular.a", "circular.b"] * 2
    result = run(
        tmp_path,
        *(job(f"i{i}", "imports/import_race.py", entry, rendezvous, len(entries)) for i, entry in enumerate(entries)),
        policy="concurrent",
    )
    errors = {f"i{i}": log(result, f"i{i}", "stderr") for i in range(len(entries))}
    assert result.exit_code == 0, errors
    for i, entry in enumerate(entries):
        late = "A_LATE" if entry.endswith("a") else "B_LATE"
        assert f"imported {entry} late=['{late}']" in log(result, f"i{i}")
    # One job at a time ran the package's modules: no job's run interleaves another's.
    order = [name for name, _, _ in sys.modules["circular"].events]
    runs = [name for k, name in enumerate(order) if k == 0 or order[k - 1] != name]
    assert len(runs) == len(set(runs)), order


@pytest.fixture
def fresh_replaced():
    sys.modules.pop("replaced", None)
    yield
    sys.modules.pop("replaced", None)


def test_a_job_waiting_for_a_module_that_replaces_itself_gets_its_names(tmp_path, fresh_replaced, monkeypatch):
    """transformers puts a lazy module in sys.modules as its import ends. A job that
    waited for another's import of it was handed the first module object, without the
    lazy one's names: `from transformers import GPT2Config` failed ("cannot import
    name") in each job but the first."""
    monkeypatch.syspath_prepend(str(SCRIPTS / "imports" / "shared"))
    marker = tmp_path / "importing"
    result = run(tmp_path, *(job(role, "imports/import_replaced.py", role, marker) for role in ("first", "second")),
                 policy="concurrent")
    assert result.exit_code == 0, [log(result, role, "stderr") for role in ("first", "second")]
    assert [log(result, role) for role in ("first", "second")] == ["first: VALUE 42\n", "second: VALUE 42\n"]


def test_jobs_first_using_torch_inductor_at_once_all_import_it(tmp_path):
    # The failure seen with three jobs whose first AdamW/torch.compile imported
    # torch._inductor together; a fresh process, as torch._inductor must not be loaded.
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    modules = ["torch._inductor.utils", "torch._inductor.codegen.common", "torch._inductor.compile_fx"]
    command = [sys.executable, "-m", "wwrun", "--policy", "concurrent", "--log-dir", str(tmp_path / "logs")]
    for i, module in enumerate(modules):
        command += [*([":"] if i else []), str(SCRIPTS / "imports" / "import_race.py"), module, str(rendezvous), "3"]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]


def test_a_forked_child_imports_a_module_another_thread_was_still_importing(tmp_path, monkeypatch):
    """fork() copies only the forking thread: an import another job's thread was running
    at that moment never ends in the child, and the child's own import of that module
    waited for it for good (a `datasets` `map(num_proc=2)` pool worker unpickling its
    task, about 1 run in 10 of two such jobs)."""
    (tmp_path / "half_made.py").write_text(
        "import os, wwrun_test_gate as gate\n"
        "if os.getpid() == gate.parent:  # only the parent's import stops half-way\n"
        "    gate.entered.set()\n"
        "    gate.leave.wait(60)\n"
        "value = 42\n")
    gate = types.SimpleNamespace(parent=os.getpid(), entered=threading.Event(), leave=threading.Event())
    monkeypatch.setitem(sys.modules, "wwrun_test_gate", gate)
    monkeypatch.syspath_prepend(str(tmp_path))
    importer = threading.Thread(target=importlib.import_module, args=("half_made",))
    importer.start()
    try:
        assert gate.entered.wait(30)
        pid = os.fork()
        if pid == 0:
            try:
                import half_made
                os._exit(0 if half_made.value == 42 else 1)
            finally:
                os._exit(2)
        code = exit_code_of(pid, "importing the module")
    finally:
        gate.leave.set()
        importer.join(30)
        in_parent = sys.modules.pop("half_made", None)
    assert code == 0
    assert in_parent.value == 42  # the parent's own import ended as usual


@pytest.fixture
def fresh_half_made():
    for name in [n for n in sys.modules if n.split(".")[0] == "half_made"]:
        del sys.modules[name]
    yield
    for name in [n for n in sys.modules if n.split(".")[0] == "half_made"]:
        del sys.modules[name]


def test_a_job_s_fork_waits_for_another_job_s_import_to_end(tmp_path, fresh_half_made, monkeypatch):
    """A package half imported by another job at the fork (a submodule in, the rest not)
    could not be imported afresh in the child either: it failed ("partially
    initialized module 'half_made' has no attribute 'part'"), where before it hung. A
    job's fork now waits for the other job's import to end, as an import does."""
    monkeypatch.syspath_prepend(str(SCRIPTS / "imports" / "shared"))  # a library: the launcher's path
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    result = run(tmp_path, job("importer", "imports/half_made_importer.py", rendezvous),
                 job("forker", "imports/fork_during_import.py", rendezvous), policy="concurrent")
    assert result.exit_code == 0, [log(result, name, "stderr") for name in ("importer", "forker")]
    assert log(result, "importer") == "imported 42\n"
    assert log(result, "forker") == "child exit 0\n"


_FORKS_WATCHED = {"on": False, "inside": 0, "most": 0}


def _fork_begins():
    if _FORKS_WATCHED["on"]:
        _FORKS_WATCHED["inside"] += 1
        _FORKS_WATCHED["most"] = max(_FORKS_WATCHED["most"], _FORKS_WATCHED["inside"])
        time.sleep(0.3)  # a slow fork hook: another thread's fork would begin meanwhile


def _fork_ends():
    if _FORKS_WATCHED["on"]:
        _FORKS_WATCHED["inside"] -= 1


os.register_at_fork(before=_fork_begins, after_in_parent=_fork_ends)


def test_threads_fork_one_at_a_time():
    """Two jobs' forks at once overlapped between their fork hooks, which filelock
    refuses (next test); a script alone never forks from two threads at once."""
    isolation.install()
    start = threading.Barrier(2)
    codes = []

    def fork():
        start.wait(30)
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        codes.append(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))

    _FORKS_WATCHED.update(on=True, inside=0, most=0)
    try:
        threads = [threading.Thread(target=fork) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
    finally:
        _FORKS_WATCHED["on"] = False
    assert codes == [0, 0] and _FORKS_WATCHED["most"] == 1


def test_a_fork_whose_child_cannot_register_an_exit_function_is_made_again(monkeypatch):
    """A fork while another thread registers an exit function (its first call of a torch
    op) leaves glibc's lock of them held in the child for good: a DataLoader worker hung
    at its first op. Such a child is ended by its probe's alarm, and the fork made again;
    here the first two children's probes end them so."""
    isolation.install()
    forks = []
    fork, probe = isolation._originals["os.fork"], isolation._probe_exit_lock

    def counted_fork():
        forks.append(1)
        return fork()

    def first_two_held():
        if len(forks) <= 2:
            os.kill(os.getpid(), signal.SIGALRM)  # as the alarm ends a child whose lock is held
        probe()

    monkeypatch.setitem(isolation._originals, "os.fork", counted_fork)
    monkeypatch.setattr(isolation, "_probe_exit_lock", first_two_held)
    pid = os.fork()
    if pid == 0:
        os._exit(7)
    assert os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) == 7
    assert len(forks) == 3


@pytest.mark.skipif(sys.version_info < (3, 12), reason="filelock audits forks from Python 3.12")
def test_two_jobs_fork_at_once_beside_filelock(tmp_path):
    """filelock (4.3; torch.compile, triton and the Hugging Face libraries import it)
    refuses a fork while another thread is between its fork hooks: "os.fork is unsafe
    while filelock is changing descriptor ownership". Two jobs' DataLoaders starting
    their workers at once failed so; a script alone never forks from two threads. Here
    one job's fork waits for a third job's import, and a second job forks meanwhile."""
    if importlib.util.find_spec("filelock") is None:
        pytest.skip("filelock is not installed")
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    shared = SCRIPTS / "imports" / "shared"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        "jobs:\n"
        f"  - {{name: importer, script: {SCRIPTS / 'imports' / 'half_made_importer.py'}, args: [{rendezvous}, second, filelock]}}\n"
        f"  - {{name: first, script: {SCRIPTS / 'imports' / 'fork_beside.py'}, args: [{rendezvous}, importing, forking]}}\n"
        f"  - {{name: second, script: {SCRIPTS / 'imports' / 'fork_beside.py'}, args: [{rendezvous}, forking, second, 0.5]}}\n")
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--quiet", "--policy", "concurrent", "--timeout", "120s",
         "--log-dir", str(tmp_path / "logs"), str(recipe)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(shared), str(ROOT)])})
    assert done.returncode == 0, done.stderr
    for name in ("first", "second"):
        assert (tmp_path / "logs" / "latest" / name / "stdout.log").read_text() == "child exit 0\n"


def test_modules_made_after_install_keep_plain_attributes():
    # importlib makes modules with type(sys)(name): sys's per-job names must not
    # reach them (matplotlib.path once read as the job's sys.path).
    import importlib.util
    import types


    isolation.install()
    for module in (type(sys)("made_by_type_of_sys"), importlib.util.module_from_spec(
        importlib.util.spec_from_loader("made_by_importlib", loader=None)
    )):
        assert not hasattr(module, "path")
        module.path, module.argv = "p", "a"
        assert (module.path, module.argv) == ("p", "a")
    assert type(importlib.util.module_from_spec(importlib.util.spec_from_loader("x", loader=None))) is types.ModuleType


def test_a_lone_job_reads_the_launchers_stdin(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--tee", "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "read_stdin.py")],
        input="hello from the pipe\n", capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "read 'hello from the pipe'" in done.stdout
    assert "then end of file" in done.stdout


def test_with_several_jobs_only_the_stdin_job_reads_it(tmp_path):
    script = SCRIPTS / "read_stdin.py"
    recipe = tmp_path / "stdin.yaml"
    recipe.write_text(
        f"jobs:\n  - {{name: reader, script: {script}, stdin: true}}\n  - {{name: other, script: {script}}}\n"
    )
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--tee", "--log-dir", str(tmp_path / "logs"), str(recipe)],
        input="only for the reader\n", capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "[reader] read 'only for the reader'" in done.stdout
    assert "[other] read ''" in done.stdout


def test_conflicting_process_wide_settings_are_named_once(tmp_path):
    script = str(SCRIPTS / "settings.py")
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path / "logs"),
         script, "high", "on", "INFO", ":", script, "highest", "on", "INFO", ":", script, "medium", "on", "INFO"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    warnings = [line for line in done.stderr.splitlines() if "is process-wide" in line]
    assert len(warnings) == 1, done.stderr  # the same benchmark and level everywhere: no warning
    assert "torch.set_float32_matmul_precision" in warnings[0]
    # Said at the first conflict: the jobs that had set it by then, whichever two or
    # three of them the threads' order made that.
    named = re.findall(r"(settings(?:-\d)?)='(\w+)'", warnings[0])
    assert len(named) >= 2 and len({value for _, value in named}) == len(named)
    assert set(named) <= {("settings", "high"), ("settings-2", "highest"), ("settings-3", "medium")}


def _as_job(name: str, cwd: Path, watch, body) -> None:
    """Run `body` in a thread that is job `name` (its own folder), as the launcher would."""
    import io
    import threading


    isolation.install()
    context = isolation.JobContext(
        name=name, argv=["x"], environ={}, cwd=str(cwd), local_roots=[],
        stdout=io.StringIO(), stderr=io.StringIO(), stdout_fd=-1, stderr_fd=-1, writes=watch,
    )
    failure = []

    def target():
        isolation.enter(context)
        try:
            body()
        except BaseException as exc:  # noqa: BLE001 - handed to the test
            failure.append(exc)
        finally:
            isolation.leave()

    thread = threading.Thread(target=target)
    thread.start()
    thread.join(60)
    assert not thread.is_alive(), f"job {name} did not end within 60 s"
    assert not failure, failure


def test_two_jobs_writing_one_path_are_named_whatever_opens_it(tmp_path):
    import numpy as np
    import torch

    from wwrun.isolation import WriteWatch

    said = []
    watch = WriteWatch(on_collision=lambda path, jobs: said.append((path, jobs)))
    shared, own_a, own_b = tmp_path / "shared", tmp_path / "a", tmp_path / "b"
    for folder in (shared, own_a, own_b):
        folder.mkdir()

    def writes():
        with open("text.txt", "w") as f:  # relative: the job's own folder decides
            f.write("x")
        Path("path.txt").write_text("x")
        np.save("array.npy", np.zeros(2))
        torch.save({"w": torch.zeros(2)}, "ckpt.pt")  # opened from C++
        os.close(os.open("raw.bin", os.O_WRONLY | os.O_CREAT))
        with open("results.csv", "a") as f:  # appends are deliberate: not a collision
            f.write("x\n")
        with open("text.txt") as f:  # reads neither
            f.read()

    for name in ("a", "b"):
        _as_job(name, shared, watch, writes)
    names = ["text.txt", "path.txt", "array.npy", "ckpt.pt", "raw.bin"]
    assert said == [(str(shared / name), ["a", "b"]) for name in names]
    # A third job writing there joins the record; the live warning was said once per path.
    _as_job("c", shared, watch, writes)
    assert watch.collisions[str(shared / "ckpt.pt")] == ["a", "b", "c"]
    assert len(said) == len(names)
    # The same relative names in each job's own folder, or another run's watch: apart.
    apart = WriteWatch()
    _as_job("a", own_a, apart, writes)
    _as_job("b", own_b, apart, writes)
    assert apart.collisions == {}


def test_a_sweep_writing_one_checkpoint_is_warned_and_job_placeholders_write_apart(tmp_path):
    """Two jobs saving `ckpt.pt` in one folder keep one file: said live, in the summary
    and in the report. `{job}` (the job's name) in args or cwd keeps them apart."""
    script = str(SCRIPTS / "save.py")
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path / "logs"), "--report", str(tmp_path / "r.json"),
         script, "ckpt.pt", "a", ":", script, "ckpt.pt", "b"],
        capture_output=True, text=True, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    report = json.loads((tmp_path / "r.json").read_text())["run"]
    [collision] = report["write_collisions"]
    first, second = collision["jobs"]  # in the order they wrote: the jobs run at once
    assert collision["path"] == str(tmp_path / "ckpt.pt") and {first, second} == {"save", "save-2"}
    said = f"jobs {first} and {second} both write {tmp_path / 'ckpt.pt'}"
    live, summary = done.stderr.split("wwrun run ", 1)
    assert said in live and said in summary, done.stderr

    result = run(
        tmp_path,
        job("a", "save.py", "{job}.pt", "{job}", cwd=str(tmp_path)),
        job("b", "save.py", "{job}.pt", "{job}", cwd=str(tmp_path)),
        job("c", "save.py", "ckpt.pt", "{job}", cwd=str(tmp_path / "runs" / "{job}")),
        job("d", "save.py", "ckpt.pt", "{job}", cwd=str(tmp_path / "runs" / "{job}")),
        job("e", "temp_file.py"), job("f", "temp_file.py"),  # unnamed files: the folder is no path they write
    )
    assert result.exit_code == 0 and "write_collisions" not in result.extra, result.to_dict()
    import torch

    for name, path in (("a", "a.pt"), ("b", "b.pt"), ("c", "runs/c/ckpt.pt"), ("d", "runs/d/ckpt.pt")):
        assert torch.load(tmp_path / path) == {"job": name}
    assert [j.args for j in result.jobs][:1] == [["a.pt", "a"]]  # the report shows what ran


def test_an_open_noted_under_a_librarys_lock_takes_no_other_lock(tmp_path):
    """tempfile probes the temporary folder with os.open under its own lock; noting that
    write once asked tempfile for the folder again and the job hung forever."""
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path / "logs"), str(SCRIPTS / "tempdir.py")],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0 and "tempdir /" in done.stdout, done.stderr


def test_patched_builtins_do_not_bind_as_methods(tmp_path):
    # `class C: opener = open` works under python (C functions do not bind); the
    # Python functions wwrun puts in their place must not bind either.
    result = run(tmp_path, job("files", "builtins_as_attributes.py", tmp_path / "out.txt"))
    assert result.exit_code == 0, log(result, "files", "stderr")
    out = log(result, "files")
    assert "read one" in out
    assert "open close" in out


def test_a_job_s_end_leaves_torch_compile_its_own_globals_to_delete(tmp_path):
    """dynamo deletes the globals it installed in a script's namespace once the
    compiled code is collected; a job's end had emptied the namespace first, and each
    deletion printed "Exception ignored ... KeyError" on wwrun's stderr."""
    script = str(SCRIPTS / "compile_own_module.py")
    done = subprocess.run([sys.executable, "-m", "wwrun", "--quiet", "--log-dir", str(tmp_path), script, ":", script],
                          capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "Exception ignored" not in done.stderr, done.stderr
