"""fork() from a job while other threads hold wwrun's locks (DataLoader workers)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.forking import child_can_take
from wwrun import forksafe

SCRIPTS = Path(__file__).parent / "scripts"
ROOT = Path(__file__).resolve().parent.parent
STRESS_LOADERS = int(os.environ.get("WWRUN_FORK_STRESS_LOADERS", "100"))
"""DataLoaders (of 2 forked workers each) in the stress test: about 30 s here on a
loaded 2-core machine; raise it for a soak run (WWRUN_FORK_STRESS_LOADERS=2000)."""


def test_a_lock_another_thread_held_at_fork_is_free_in_the_child():
    for make in (forksafe.Lock, forksafe.RLock, forksafe.Condition):
        assert child_can_take(make(), True) == 0, make


def test_a_registered_multiprocessing_lock_a_child_took_and_released_is_free_again_in_the_parent():
    """Its semaphore is shared with the child; its count of holds is per process. A
    plain os.fork() child kept the count of the thread that held it at fork, so its
    release only lowered that count and kept the semaphore, for good."""
    import multiprocessing

    from tests.forking import exit_code_of, holding

    for make in (multiprocessing.RLock, multiprocessing.Lock):
        lock = make()
        forksafe.register(lock)
        with holding(lock) as release:
            pid = os.fork()
            if pid == 0:
                try:
                    taken = lock.acquire(timeout=10)
                    lock.release()
                    os._exit(0 if taken else 1)
                finally:
                    os._exit(2)
            release()
        assert exit_code_of(pid, f"taking and releasing a {make.__name__}") == 0, make
        assert lock.acquire(timeout=5), f"the child kept the {make.__name__}"
        lock.release()


def test_an_rlock_the_forking_thread_holds_stays_its_own_in_the_child():
    lock = forksafe.RLock()
    with lock:
        pid = os.fork()
        if pid == 0:
            try:
                lock.release()  # what the forking thread's `with` does on its way out
                os._exit(0)
            except RuntimeError:
                os._exit(1)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_dataloader_workers_forked_while_other_jobs_allocate_draw_print_and_import(tmp_path):
    """Not a benchmark: hundreds of forks; every job must finish (a worker that
    inherited a held lock never would)."""
    script = str(SCRIPTS / "fork_stress.py")
    argv = [sys.executable, "-m", "wwrun", "--device", "cpu", "--log-dir", str(tmp_path / "logs"),
            "--report", str(tmp_path / "report.json"), script, "loader", str(STRESS_LOADERS), str(tmp_path)]
    for role in ("allocate", "draw", "print", "import"):
        argv += [":", script, role, str(tmp_path)]
    done = _run_or_show_stacks(argv, 120 + STRESS_LOADERS, tmp_path / "logs", cwd=tmp_path,
                               env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-3000:]
    report = json.loads((tmp_path / "report.json").read_text())
    assert [job["state"] for job in report["jobs"]] == ["succeeded"] * 5
    assert f"loader: {STRESS_LOADERS} loaders, {2 * STRESS_LOADERS} forks" in done.stdout
    assert done.stdout.count("finished") == 5


def _run_or_show_stacks(argv: list[str], timeout: float, log_dir: Path, **popen) -> subprocess.CompletedProcess:
    """Runs wwrun; if it has not ended within `timeout`, a SIGABRT to its process group
    makes faulthandler write every thread's stack, the forked workers' too, into the
    run's crash.log, and the failure shows them: a hang says where it hangs."""
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **popen)
    try:
        out, err = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGABRT)
        try:
            process.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.communicate()
        stacks = "".join(log.read_text(errors="replace") for log in log_dir.glob("*/crash.log"))
        pytest.fail(f"wwrun did not end within {timeout} s; its threads' stacks:\n{stacks[-30000:]}", pytrace=False)
    return subprocess.CompletedProcess(argv, process.returncode, out, err)
