"""Helpers shared by the fork tests: a forked child's exit code, waited for with a bound."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time

import pytest


def exit_code_of(pid: int, what: str, timeout_s: float = 30.0) -> int:
    """The exit code of forked child `pid`; fails the test (killing the child) if it has
    not ended within `timeout_s`, saying `what` it was doing."""
    deadline = time.monotonic() + timeout_s
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail(f"the forked child did not end within {timeout_s:.0f} s: {what}")
    return os.waitstatus_to_exitcode(done[1])


@contextlib.contextmanager
def holding(lock):
    """Another thread holds `lock` inside the block, until the block ends or calls the
    function it is given (as another job's thread inside a library call would)."""
    held, release = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            release.wait(30)

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(30)
        yield release.set
    finally:
        release.set()
        thread.join(30)


def child_can_take(lock, hold_in_other_thread: bool) -> int:
    """Fork while (another thread) holds `lock`; the child's exit code: 0 if it
    could take the lock within 5 s, 1 if not."""
    with holding(lock) if hold_in_other_thread else contextlib.nullcontext(lambda: None) as release:
        pid = os.fork()
        if pid == 0:
            try:
                os._exit(0 if lock.acquire(timeout=5) else 1)
            finally:
                os._exit(2)
        release()
    return exit_code_of(pid, "taking the lock")
