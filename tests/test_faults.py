"""The fault matrix (issue 12): each fault in one job, beside a healthy seeded job whose
output must equal its solo `python` run, byte for byte. Integration tests: each runs
the launcher in-process with two jobs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wwrun import JobSpec, JobState, LaunchConfig, launch

SCRIPTS = Path(__file__).parent / "scripts"
HEALTHY = str(SCRIPTS / "healthy.py")
FAULT = str(SCRIPTS / "fault.py")

# fault -> (the faulty job's state, its exit code)
FAULTS = {
    "raise": (JobState.FAILED, 1),
    "exit3": (JobState.FAILED, 3),
    "os_exit": (JobState.FAILED, 5),
    "keyboard_interrupt": (JobState.INTERRUPTED, 130),
    "memory_error": (JobState.FAILED, 1),
    "recursion": (JobState.FAILED, 1),
    "chdir": (JobState.SUCCEEDED, 0),
    "background_thread": (JobState.SUCCEEDED, 0),  # as under python: the thread's error is printed
    "hang": (JobState.FAILED, 124),  # ended by its timeout
}


@pytest.fixture(scope="module")
def solo_output() -> str:
    done = subprocess.run([sys.executable, HEALTHY], capture_output=True, text=True, timeout=120, check=True)
    return done.stdout


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # background_thread
@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_fault_in_one_job_leaves_a_healthy_job_exactly_as_alone(tmp_path, fault, solo_output):
    faulty = JobSpec(name="faulty", script=FAULT, args=[fault], timeout=1 if fault == "hang" else None)
    healthy = JobSpec(name="healthy", script=HEALTHY)
    config = LaunchConfig(jobs=[faulty, healthy], log_dir=str(tmp_path / "logs"), quiet=True, grace_period_s=5)
    result = launch(config)
    bad, good = result.jobs
    assert (bad.state, bad.exit_code) == FAULTS[fault], bad.error
    assert (good.state, good.exit_code) == (JobState.SUCCEEDED, 0), good.error
    assert (Path(good.log_dir) / "stdout.log").read_text() == solo_output
