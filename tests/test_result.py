"""wwrun.result: the run's exit code and root cause from its jobs' ends."""

from __future__ import annotations

from wwrun.result import JobResult, JobState, run_exit_code


def _ended(name: str, state: JobState, code: int, at: float) -> JobResult:
    return JobResult(name=name, script=f"{name}.py", module=None, args=[], cwd=".", state=state,
                     exit_code=code, started=0.0, ended=at)


def test_an_interrupted_run_names_no_job_as_its_root_cause():
    # Ctrl-C: every job interrupted; the first to end did not cause anything.
    jobs = [_ended("mlp", JobState.INTERRUPTED, 130, 2.0), _ended("lstm", JobState.INTERRUPTED, 130, 1.0)]
    assert run_exit_code(jobs) == (130, None)


def test_a_failure_is_the_root_cause_even_when_an_interrupted_job_ended_first():
    jobs = [_ended("stopped", JobState.INTERRUPTED, 130, 1.0), _ended("bad", JobState.FAILED, 3, 2.0),
            _ended("later", JobState.FAILED, 4, 3.0), _ended("ok", JobState.SUCCEEDED, 0, 0.5)]
    assert run_exit_code(jobs) == (3, "bad")


def test_a_job_cancelled_while_queued_again_causes_nothing():
    """A job that gave way (no room beside the others yet) was queued to start again
    with its attempt's exit code 1; Ctrl-C cancelled it there, and the run exited 1
    naming it, not 130."""
    jobs = [_ended("gave-way", JobState.CANCELLED, 1, 1.0), _ended("running", JobState.INTERRUPTED, 130, 2.0)]
    assert run_exit_code(jobs) == (130, None)


def test_an_interrupted_run_exits_130_whatever_code_a_script_chose_on_its_way_out():
    # Lightning catches KeyboardInterrupt and exits 1: the run was interrupted all the same.
    jobs = [_ended("lightning", JobState.INTERRUPTED, 1, 1.0), _ended("plain", JobState.INTERRUPTED, 130, 2.0)]
    assert run_exit_code(jobs) == (130, None)
