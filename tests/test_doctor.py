"""`wwrun doctor`: the quick check and the full proof's runner, in their CPU forms."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wwrun import doctor


def wwrun(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "wwrun", *args], capture_output=True, text=True,
                          cwd=cwd, timeout=300)


def test_quick_checks_the_cpu_path_and_says_what_it_skipped(tmp_path):
    done = wwrun("doctor", "--device", "cpu", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    for name in ("environment", "allocator build", "triton kernels", "memory flow"):
        assert any(line.startswith(f"✓ {name}") for line in lines), done.stdout
    assert any(line.startswith("– headroom") and "does not apply on the CPU" in line for line in lines)
    assert any(line.startswith("– cuda") for line in lines)
    assert lines[-1] == "4 passed, 0 failed, 2 skipped"


def test_memory_flow_keeps_two_jobs_under_a_limit_that_holds_one():
    check = doctor.check_memory_flow("cpu")
    assert check.verdict == doctor.PASS, check
    limit, run_peak = check.figures["limit_bytes"], check.figures["run_peak_bytes"]
    peaks = [job["peak_memory_bytes"] for job in check.figures["jobs"].values()]
    assert len(peaks) == 2 and sum(peaks) > limit  # oversubscribed, so the check can fail
    assert 0 < run_peak <= limit
    assert check.allocator == check.figures["allocator"] == "waterwave"


def test_full_writes_its_json_and_artefacts_outside_the_checkout_by_default(tmp_path):
    """Without --out, doctor.json goes to a new folder under the system's temporary
    folder, not into the checkout; each step's line is printed once."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    done = subprocess.run([sys.executable, "-m", "wwrun", "doctor", "--full", "--only", "clean-exit"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300,
                          env={**os.environ, "TMPDIR": str(scratch)})
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = scratch.glob("wwrun-doctor-*/doctor.json")
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["torch"] and data["passed"] is True and data["complete"] is False
    assert data["commands"] == ["wwrun doctor --full --only clean-exit"]
    steps = [(s["name"], s["verdict"], s["allocator"]) for s in data["steps"]]
    assert steps == [("environment", "pass", None), ("build", "pass", None), ("clean-exit", "pass", "waterwave")]
    assert set(data["steps"][1]["figures"]["seconds"]) == {"host", "cpu", "rng"}  # each part, timed
    assert f"results: {path}" in done.stdout
    lines = done.stdout.splitlines()
    assert sum(line.startswith("✓ clean-exit") for line in lines) == 1  # one table, not two
    assert "3 passed, 0 failed, 0 skipped" in lines


def _step(name, code, allocator=None, estimate=1):
    return doctor.Step(name, name, lambda device, tmp, out: [sys.executable, "-c", code],
                       allocator=allocator, estimate_s=(estimate, estimate))


def test_a_crash_or_a_hang_in_one_step_is_reported_and_the_rest_go_on():
    steps = [
        _step("crashes", "import os; os.abort()"),
        _step("hangs", "import threading; threading.Event().wait()"),
        _step("fails", "import sys; print('partial'); sys.exit('it broke')"),
        _step("passes", "import json; print(json.dumps({'gbps': 1.5}))"),
    ]
    checks = {c.name: c for c in doctor.full("cpu", steps, step_limit_s=10)}
    assert checks["crashes"].verdict == doctor.FAIL and "SIGABRT" in checks["crashes"].detail
    assert checks["hangs"].verdict == doctor.FAIL and checks["hangs"].detail.startswith("hung")
    assert checks["fails"].verdict == doctor.FAIL and "it broke" in checks["fails"].detail
    assert checks["passes"].verdict == doctor.PASS and checks["passes"].figures == {"gbps": 1.5}


def test_a_step_whose_figures_name_another_allocator_than_it_claims_fails():
    """A fallback to PyTorch's allocator must not pass as wwrun's figures."""
    printing = "import json; print(json.dumps({'ratio': 2.0%s}))"
    steps = [
        _step("native", printing % ", 'allocator': 'native'", allocator="waterwave"),
        _step("unnamed", printing % "", allocator="waterwave"),
        _step("ours", printing % ", 'allocator': 'waterwave'", allocator="waterwave"),
        _step("no-allocator", printing % "", allocator=None),
    ]
    checks = {c.name: c for c in doctor.full("cpu", steps)}
    assert checks["native"].verdict == doctor.FAIL and "'native'" in checks["native"].detail
    assert checks["native"].allocator == "native"
    assert checks["unnamed"].verdict == doctor.FAIL and "do not say" in checks["unnamed"].detail
    assert checks["ours"].verdict == doctor.PASS and checks["ours"].allocator == "waterwave"
    assert checks["no-allocator"].verdict == doctor.PASS and checks["no-allocator"].allocator is None


def test_every_step_names_the_allocator_it_measures_and_passes_its_artefacts_out(tmp_path):
    """Benchmarks and pytest write their files into --out, never into the checkout.
    Only a pytest step may be 'mixed' (its tests assert their own allocators): a
    step with figures must claim one allocator, which its figures are checked
    against."""
    out = tmp_path / "out"
    for step in doctor.STEPS:
        for device in ("cpu", "cuda"):
            command = step.command(device, tmp_path, out)
            if command is None:
                continue
            benchmark = any(arg.startswith(str(doctor._CHECKOUT / "benchmarks")) for arg in command)
            assert not benchmark or "--out" in command, (step.name, command)
            for flag in ("--out", "--junitxml"):
                if flag in command:
                    assert Path(command[command.index(flag) + 1]).parent == out, (step.name, command)
            if step.allocator == doctor.MIXED:
                assert command[1:3] == ["-m", "pytest"], step.name
        assert step.allocator in ("waterwave", doctor.MIXED, None), step.name
    # Most GPU tests run in pytest's own process, on PyTorch's allocator.
    assert next(s for s in doctor.STEPS if s.name == "gpu-tests").allocator == doctor.MIXED


def test_figures_in_the_table_are_formatted():
    summary = doctor._summary({"host_pairs_per_s": 3369303.832402141, "ratio": 0.97123456, "jobs": 40,
                               "peak_bytes": 3 << 20, "allocator": "waterwave"})
    assert summary == ": host_pairs_per_s=3.37M, ratio=0.971, jobs=40, peak_bytes=3.0 MiB"
    waterwave = next(s for s in doctor.STEPS if s.name == "waterwave")
    figures = {"a_batch_fraction": {"waterwave_2jobs": 1.0}, "b_speedup_vs_sequential": 1.6012,
               "device": "cpu", "allocator": "waterwave"}
    assert doctor._summary(figures, waterwave.shown) == ": waterwave_2jobs=1, b_speedup_vs_sequential=1.6"


def test_a_pytest_step_s_figures_are_its_counts():
    assert doctor._pytest_figures("x\n3 passed, 1 skipped, 1 error, 40 deselected in 9.10s\n") == {
        "passed": 3, "skipped": 1, "errors": 1, "deselected": 40}
    assert doctor._pytest_figures("no tests ran in 0.01s") is None


def test_the_budget_plan_runs_what_fits_with_a_margin_and_leaves_the_rest():
    steps = [_step(name, "", estimate=seconds) for name, seconds in
             (("a", 300), ("b", 200), ("c", 100), ("d", 30), ("e", 600))]
    now, later = doctor.plan(steps, "cuda", 540)  # 486 s of it: a and b (500 s) would fill it
    assert [s.name for s in now] == ["a", "c", "d"] and [s.name for s in later] == ["b", "e"]
    now, later = doctor.plan(steps, "cuda", 540, measured={"a": 420, "c": 10})
    assert [s.name for s in now] == ["a", "c", "d"] and [s.name for s in later] == ["b", "e"]
    now, later = doctor.plan(steps[4:], "cuda", 540)  # longer than the budget: it runs alone
    assert [s.name for s in now] == ["e"] and later == []


@pytest.mark.parametrize("build_s", [0, 90])
def test_three_commands_of_540_s_cover_the_cuda_proof_each_with_room_to_spare(build_s):
    """By the CUDA estimates, with each command first spending `build_s` on a fresh
    machine's build: no plan of several steps fills more than 90% of what is left."""
    todo, commands = list(doctor.STEPS), 0
    while todo:
        left = 540 - build_s
        now, todo = doctor.plan(todo, "cuda", left)
        planned = sum(doctor.estimate(s, "cuda") for s in now)
        assert len(now) == 1 or planned <= left * (1 - doctor.PLAN_MARGIN), [s.name for s in now]
        commands += 1
    assert commands <= 3


def test_budget_then_resume_twice_covers_every_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "STEPS", [
        _step("one", "import json; print(json.dumps({'n': 1}))", estimate=60),
        _step("two", "import json; print(json.dumps({'n': 2}))", estimate=60),
        _step("three", "import json; print(json.dumps({'n': 3}))", estimate=60),
    ])
    out = tmp_path / "out"
    assert doctor.main(["--full", "--budget", "100", "--out", str(out), "--device", "cpu"]) == 0
    printed = capsys.readouterr().out
    assert "left for later: two, three" in printed
    assert f"wwrun doctor --full --resume {out} --budget 100" in printed
    data = json.loads((out / "doctor.json").read_text())
    assert [s["name"] for s in data["steps"]] == ["environment", "build", "one"]
    assert data["remaining"] == ["two", "three"] and not data["complete"]
    assert doctor.main(["--resume", str(out), "--budget", "100", "--device", "cpu"]) == 0
    assert doctor.main(["--resume", str(out), "--budget", "100", "--device", "cpu"]) == 0
    data = json.loads((out / "doctor.json").read_text())
    assert [s["name"] for s in data["steps"]] == ["environment", "build", "one", "two", "three"]
    assert data["complete"] and data["passed"] and data["remaining"] == []
    assert set(data["durations"]) == {"one", "two", "three"} and len(data["commands"]) == 3
    capsys.readouterr()
    assert doctor.main(["--resume", str(out), "--device", "cpu"]) == 0  # nothing left: runs none
    assert "nothing to run" in capsys.readouterr().out
    assert [s["name"] for s in json.loads((out / "doctor.json").read_text())["steps"]][-1] == "three"


def _once(name: str, folder: Path, first: str) -> doctor.Step:
    """A step that does `first` (code) the first time it runs, and passes later."""
    tried = folder / f"{name}.tried"
    return _step(name, f"import pathlib, sys, time; p = pathlib.Path({str(tried)!r}); first = not p.exists(); "
                       f"p.write_text('x')\nif first: {first}")


def test_resume_runs_again_each_step_that_did_not_pass_and_keeps_those_that_did(tmp_path, monkeypatch, capsys):
    runs = tmp_path / "passes.runs"
    monkeypatch.setattr(doctor, "STEPS", [
        _once("hangs-once", tmp_path, "time.sleep(600)"),
        _step("passes", f"open({str(runs)!r}, 'a').write('x')"),
        _once("fails-once", tmp_path, "sys.exit('it broke')"),
    ])
    out = tmp_path / "out"
    args = ["--device", "cpu"]
    # A step the budget kills (the only one, so it fails as a hang does) ...
    assert doctor.main(["--full", "--out", str(out), "--only", "hangs-once", "--budget", "20", *args]) == 1
    hung = json.loads((out / "doctor.json").read_text())["steps"][-1]
    assert hung["name"] == "hangs-once" and hung["verdict"] == "fail" and hung["detail"].startswith("hung")
    # ... runs again when resumed, even alone.
    assert doctor.main(["--resume", str(out), "--only", "hangs-once", *args]) == 0
    assert doctor.main(["--resume", str(out), *args]) == 1  # the others: one fails
    assert "failed: fails-once; go on with" in capsys.readouterr().out
    assert doctor.main(["--resume", str(out), *args]) == 0  # it alone runs again, and passes
    data = json.loads((out / "doctor.json").read_text())
    assert [(s["name"], s["verdict"]) for s in data["steps"]] == [
        ("environment", "pass"), ("build", "pass"), ("hangs-once", "pass"), ("passes", "pass"), ("fails-once", "pass")]
    assert data["passed"] and data["complete"] and runs.read_text() == "x"  # the pass was kept, not rerun


def test_the_build_is_measured_inside_the_budget(tmp_path, monkeypatch, capsys):
    """On a fresh machine each command builds the C++ parts first: the plan gets
    what the build left of the budget."""
    monkeypatch.setattr(doctor, "BUILD", _step("build", "import time; time.sleep(6)"))
    monkeypatch.setattr(doctor, "STEPS", [_step("a", "", estimate=10), _step("b", "", estimate=8)])
    out = tmp_path / "out"
    assert doctor.main(["--full", "--out", str(out), "--budget", "25", "--device", "cpu"]) == 0
    assert "left for later: b" in capsys.readouterr().out  # 25 s alone would hold both, with the margin
    data = json.loads((out / "doctor.json").read_text())
    assert data["steps"][1]["name"] == "build" and data["steps"][1]["seconds"] >= 6
    assert data["remaining"] == ["b"]


def test_a_build_that_fails_runs_no_step_and_leaves_them_for_resume(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(doctor, "BUILD", _step("build", "import sys; sys.exit('no compiler')"))
    monkeypatch.setattr(doctor, "STEPS", [_step("a", "")])
    out = tmp_path / "out"
    assert doctor.main(["--full", "--out", str(out), "--device", "cpu"]) == 1
    data = json.loads((out / "doctor.json").read_text())
    assert [(s["name"], s["verdict"]) for s in data["steps"]] == [("environment", "pass"), ("build", "fail")]
    assert "no compiler" in data["steps"][1]["detail"] and data["remaining"] == ["a"] and not data["passed"]
    assert f"remaining: a; go on with: wwrun doctor --full --resume {out}" in capsys.readouterr().out


def test_resume_refuses_a_folder_made_with_another_torch(tmp_path, capsys):
    (tmp_path / "doctor.json").write_text(json.dumps({"device": "cpu", "torch": "0.0", "steps": [], "durations": {},
                                                      "commands": []}))
    with pytest.raises(SystemExit) as exit:
        doctor.main(["--resume", str(tmp_path), "--device", "cpu"])
    assert exit.value.code == 2 and "made with another torch" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["[1]", "{}", '{"steps": [], "durations": {}}', '{"steps": [1], "durations": {}, "commands": []}'])
def test_resume_refuses_a_json_it_cannot_go_on_from(tmp_path, capsys, text):
    (tmp_path / "doctor.json").write_text(text)
    with pytest.raises(SystemExit) as exit:
        doctor.main(["--resume", str(tmp_path), "--device", "cpu"])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and "is not a doctor's JSON" in err and len(err.strip().splitlines()) == 1, err


_KILLED_DRIVER = """
import sys
from wwrun import doctor
def step(name, code):
    return doctor.Step(name, name, lambda d, t, o: [sys.executable, "-c", code.format(out=str(o))], allocator=None)
doctor.STEPS = [
    step("writes", "import json, pathlib; pathlib.Path({out!r}, 'artefact.txt').write_text('x'); print(json.dumps({{'n': 1}}))"),
    step("hangs", "import os, pathlib, threading; pathlib.Path({out!r}, 'hangs.pid').write_text(str(os.getpid())); "
                  "threading.Event().wait()"),
]
sys.exit(doctor.main(["--full", "--out", sys.argv[1], "--device", "cpu"]))
"""


def _kill_step(pid_file: Path) -> None:
    deadline = time.monotonic() + 30  # the step's start, if the doctor got that far
    while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        os.killpg(int(pid_file.read_text()), signal.SIGKILL)
    except (OSError, ValueError):
        pass


def test_a_run_killed_after_a_step_keeps_that_step_and_its_artefact(tmp_path):
    out = tmp_path / "out"
    child = subprocess.Popen([sys.executable, "-c", _KILLED_DRIVER, str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    path = out / "doctor.json"
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline:  # until the first step is in the JSON (bounded)
            if path.is_file() and "writes" in {s["name"] for s in json.loads(path.read_text())["steps"]}:
                break  # (written whole and renamed into place: never half a file)
            assert child.poll() is None, child.communicate()
            time.sleep(0.2)
        else:
            pytest.fail("the first step never reached doctor.json within 120 s")
    finally:
        os.killpg(child.pid, signal.SIGKILL)  # the doctor
        child.communicate()
        _kill_step(out / "hangs.pid")  # in a session of its own: a SIGKILLed doctor cannot end it
    data = json.loads(path.read_text())
    assert [(s["name"], s["verdict"]) for s in data["steps"]] == [
        ("environment", "pass"), ("build", "pass"), ("writes", "pass")]
    assert data["remaining"] == ["hangs"] and (out / "artefact.txt").read_text() == "x"


def test_steps_without_a_cpu_form_are_skipped_on_the_cpu():
    gpu_only = [s for s in doctor.STEPS if s.name in ("gpu-tests", "cudnn-benchmark", "headroom")]
    checks = list(doctor.full("cpu", gpu_only))
    assert [c.verdict for c in checks] == [doctor.SKIP] * 3
    assert all(c.detail.startswith("does not apply on cpu") for c in checks)


@pytest.mark.parametrize("args, message", [
    (["--only", "kernels"], "--only needs --full"),
    (["--budget", "540"], "--budget needs --full"),
    (["--full", "--budget", "0"], "more than 0 seconds"),
    (["--full", "--budget", "soon"], "not a number of seconds"),
    (["--resume", "/nonexistent"], "no doctor.json there"),
    (["--full", "--only", "nope"], "invalid choice"),
    (["--frobnicate"], "unrecognized arguments"),
])
def test_bad_input_is_one_line_and_exit_code_2(args, message):
    done = wwrun("doctor", *args)
    assert done.returncode == 2
    assert len(done.stderr.strip().splitlines()) == 1 and message in done.stderr
    assert "Traceback" not in done.stderr


def test_out_onto_a_file_is_refused(tmp_path):
    target = tmp_path / "file"
    target.write_text("")
    done = wwrun("doctor", "--full", "--only", "clean-exit", "--out", str(target))
    assert done.returncode == 2 and "not a folder" in done.stderr


def test_out_holding_an_earlier_run_s_json_is_refused_and_points_at_resume(tmp_path):
    """Writing over it would lose its steps; adding to it is --resume's part."""
    earlier = '{"steps": [{"name": "waterwave", "verdict": "pass"}]}'
    (tmp_path / "doctor.json").write_text(earlier)
    done = wwrun("doctor", "--full", "--only", "clean-exit", "--out", str(tmp_path))
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"--resume {tmp_path}" in done.stderr and "Traceback" not in done.stderr
    assert (tmp_path / "doctor.json").read_text() == earlier


def test_run_from_a_checkout_the_doctor_gives_the_offline_install(monkeypatch):
    monkeypatch.setattr(doctor, "_install_state", lambda: "not installed")
    check = doctor.check_environment("cpu")
    assert check.verdict == doctor.PASS and check.figures["install"] == "not installed"
    assert "pip install --no-index --no-build-isolation --no-deps -e ." in check.advice
    assert check.advice in doctor.line(check, 12)
    lacking = doctor.offline_install_lacks(doctor._setuptools_version(), importlib.util.find_spec("wheel") is not None)
    assert check.figures["offline_install"] == (lacking or "ready")
    assert ("needs setuptools>=70.1, or wheel" in check.advice) == bool(lacking)


@pytest.mark.parametrize("setuptools, wheel, lacks", [
    ("69.5.1", False, "setuptools 69.5.1 is older than 70.1 and wheel is not installed"),
    ("69.5.1", True, None),   # wheel's bdist_wheel
    ("70.1.0", False, None),  # its own bdist_wheel
    ("80.9", False, None),
    (None, True, "setuptools is not installed"),
])
def test_the_offline_install_needs_setuptools_70_1_or_wheel(setuptools, wheel, lacks):
    assert doctor.offline_install_lacks(setuptools, wheel) == lacks


def test_an_interrupted_doctor_ends_the_step_it_was_running(tmp_path):
    """A step runs in its own session (so that a hang is ended whole); a Ctrl-C of the
    doctor must end it too, not leave it running on the device beside the next command."""
    pid_file = tmp_path / "pid"
    step = _step("sleeps", f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(60)")

    import threading

    main_thread = threading.get_ident()

    def interrupt_once_started():
        deadline = time.monotonic() + 30  # the child's start
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        # To the main thread, which waits on its child in select(): sent to the
        # process, it may land on this thread instead.
        signal.pthread_kill(main_thread, signal.SIGINT)

    threading.Thread(target=interrupt_once_started, daemon=True).start()
    # Ctrl-C as a terminal gives it, whatever this process inherited: run in the
    # background by a shell without job control, Python starts with SIGINT ignored.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with pytest.raises(KeyboardInterrupt):
            doctor.run_step(step, "cpu", 60, tmp_path)
    finally:
        signal.signal(signal.SIGINT, previous)
    pid = int(pid_file.read_text())
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return
    os.killpg(pid, signal.SIGKILL)
    pytest.fail("the step's process outlived the interrupted doctor")


def test_the_headroom_line_says_whether_a_job_that_gives_way_at_the_limit_parks():
    figures = {"process_bytes": 500 << 20, "per_thread_bytes": 2 << 20, "stream_fixed_bytes": 65 << 20,
               "kept_bytes": 600 << 20}
    assert "parks in host memory" in doctor._headroom_detail({**figures, "can_park": True})
    assert "fails: the driver makes no pinned host memory" in doctor._headroom_detail({**figures, "can_park": False})
