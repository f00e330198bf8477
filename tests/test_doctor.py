"""`wwrun doctor`: the quick check and the full proof's runner, in their CPU forms."""

from __future__ import annotations

import json
import subprocess
import sys

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
    assert any(line.startswith("– cuda") for line in lines)
    assert lines[-1] == "4 passed, 0 failed, 1 skipped"


def test_memory_flow_keeps_two_jobs_under_a_limit_that_holds_one():
    check = doctor.check_memory_flow("cpu")
    assert check.verdict == doctor.PASS, check
    limit, run_peak = check.figures["limit_bytes"], check.figures["run_peak_bytes"]
    peaks = [job["peak_memory_bytes"] for job in check.figures["jobs"].values()]
    assert len(peaks) == 2 and sum(peaks) > limit  # oversubscribed, so the check can fail
    assert 0 < run_peak <= limit


def test_full_writes_one_json_with_versions_command_and_verdicts(tmp_path):
    done = wwrun("doctor", "--full", "--only", "clean-exit", "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (path,) = (tmp_path / "out").glob("doctor-*.json")
    data = json.loads(path.read_text())
    assert data["device"] == "cpu" and data["torch"] and data["passed"] is True
    assert data["command"] == f"wwrun doctor --full --only clean-exit --out {tmp_path / 'out'}"
    assert [(s["name"], s["verdict"]) for s in data["steps"]] == [("environment", "pass"), ("clean-exit", "pass")]
    assert f"results: {path}" in done.stdout


def _step(name, code):
    return doctor.Step(name, name, lambda device, tmp: [sys.executable, "-c", code])


def test_a_crash_or_a_hang_in_one_step_is_reported_and_the_rest_go_on():
    steps = [
        _step("crashes", "import os; os.abort()"),
        _step("hangs", "import threading; threading.Event().wait()"),
        _step("fails", "import sys; print('partial'); sys.exit('it broke')"),
        _step("passes", "import json; print(json.dumps({'gbps': 1.5}))"),
    ]
    checks = {c.name: c for c in doctor.full("cpu", steps, step_limit_s=10) if c.name != "environment"}
    assert checks["crashes"].verdict == doctor.FAIL and "SIGABRT" in checks["crashes"].detail
    assert checks["hangs"].verdict == doctor.FAIL and checks["hangs"].detail.startswith("hung")
    assert checks["fails"].verdict == doctor.FAIL and "it broke" in checks["fails"].detail
    assert checks["passes"].verdict == doctor.PASS and checks["passes"].figures == {"gbps": 1.5}


def test_steps_without_a_cpu_form_are_skipped_on_the_cpu():
    gpu_only = [s for s in doctor.STEPS if s.name in ("gpu-tests", "cudnn-benchmark")]
    checks = list(doctor.full("cpu", gpu_only))
    assert [c.verdict for c in checks[1:]] == [doctor.SKIP, doctor.SKIP]


@pytest.mark.parametrize("args, message", [
    (["--only", "kernels"], "--only needs --full"),
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
