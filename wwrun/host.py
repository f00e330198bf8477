"""What a run changes in its host process while it goes on, each change made by one
function that returns its undo: signal handlers, the child subreaper, the cyclic
collector's frozen objects, torch's intra-op threads, the crash log; and the end of
the processes the jobs started.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from wwrun import isolation

_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


# The handlers in place before the run's (see handle_interrupts), for forked children.
_handlers_before_run: dict[int, object] = {}


RELAYED_SIGNALS = tuple(getattr(signal, name) for name in ("SIGUSR1", "SIGUSR2", "SIGHUP") if hasattr(signal, name))
"""Signals a script may handle itself (a cluster's "checkpoint now", a closed
terminal): `relay` hands them to every job, whose own handler runs, or which ends
as the signal's default action would end its process. Left to their default here,
one ended the whole run at once, with no summary."""


SAME_PRESS_S = 0.25
"""A second interrupt this soon after the first is the same one: `timeout -s INT`
signals the launcher and then its process group (the launcher in it). Only a later
one forces the stop."""


def end_at_a_later_interrupt(exit_code: int) -> None:
    """After a Ctrl-C outside a run (start-up, the summary), while the process exits: a
    later one ends it at once, and the same one delivered twice is let go. Python's
    own handler raised it again in `threading._shutdown`, a traceback after "wwrun:
    interrupted". From the main thread only, as Python allows."""
    if threading.current_thread() is not threading.main_thread():
        return
    first = time.monotonic()

    def on_interrupt(signum, frame):
        if time.monotonic() - first >= SAME_PRESS_S:
            sys.stdout.flush()
            sys.stderr.flush()
            isolation._originals.get("os._exit", os._exit)(exit_code)

    signal.signal(signal.SIGINT, on_interrupt)


_pressed_at_start_up = False


def watch_start_up_interrupts() -> None:
    """From the CLI, before start-up's imports (from the main thread, with Python's
    own Ctrl-C handler in place): a Ctrl-C is raised as before, and remembered. torch's
    C start-up drops an exception raised while it imports numpy (it asks whether numpy
    is there and clears the error), so a Ctrl-C landing then was lost and the whole
    run went on; the run ends before it starts (`pressed_at_start_up`)."""
    if threading.current_thread() is not threading.main_thread() \
            or signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return

    def on_interrupt(signum, frame):
        global _pressed_at_start_up
        _pressed_at_start_up = True
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_interrupt)


def pressed_at_start_up() -> bool:
    """Whether Ctrl-C was pressed since `watch_start_up_interrupts`."""
    return _pressed_at_start_up


def handle_interrupts(handler, relay=None) -> Callable[[], None]:
    """`handler` for Ctrl-C and SIGTERM while a run goes on (from the main thread
    only, as Python allows), `relay` for RELAYED_SIGNALS; returns what puts the
    previous handlers back.

    Only the launcher's process runs it: a process a job forks (a DataLoader
    worker) gets the previous handlers back at once (_restore_handlers_in_child),
    as under `python`; a terminal's Ctrl-C reaches those workers too, and the run's
    handler there printed its message again and stopped "every job" of a copy of
    the launcher, holding locks that threads of the parent held at fork."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    # Ctrl-C and SIGTERM ignored at the start stay ignored, as a `python` process keeps
    # them; a relayed signal ignored so is still relayed, and ignored by each job that
    # keeps Python's default (`isolation._python_default`).
    stops = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not signal.SIG_IGN]
    handled = (*stops, *(RELAYED_SIGNALS if relay is not None else ()))
    previous = {sig: signal.getsignal(sig) for sig in handled}
    launcher = os.getpid()

    def in_launcher(signum, frame):
        if os.getpid() == launcher:
            (relay if signum in RELAYED_SIGNALS else handler)(signum, frame)
        elif signum == signal.SIGINT:  # a child the fork hook did not reach (os.fork from C)
            raise KeyboardInterrupt
        else:  # the default action there (SIGTERM's, SIGUSR1's...)
            isolation._originals.get("os._exit", os._exit)(128 + signum)

    for sig in previous:
        signal.signal(sig, in_launcher)
    _handlers_before_run.update(previous)

    def restore():
        _handlers_before_run.clear()
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


def _restore_handlers_in_child() -> None:
    # After a fork the forking thread is the child's main thread: it may set handlers
    # (through the real signal.signal: a job's thread would only record them).
    set_handler = isolation._originals.get("signal.signal", signal.signal)
    for sig, old in _handlers_before_run.items():
        try:
            set_handler(sig, old if old is not None else signal.SIG_DFL)
        except (ValueError, TypeError, OSError):
            pass  # not the main thread after all: in_launcher stands aside
    _handlers_before_run.clear()


os.register_at_fork(after_in_child=_restore_handlers_in_child)


def thread_hex(ident: int | None) -> str:
    """A thread id as faulthandler prints it ('Thread 0x00007f...')."""
    return f"0x{ident or 0:016x}"


def become_subreaper() -> Callable[[], None]:
    """Make orphaned descendants (a job's double-forked daemon, `(setsid cmd &)`)
    children of this process rather than of init, as systemd and tini do, so that
    they are found and ended with the run. Linux only; returns the undo."""
    if not sys.platform.startswith("linux"):
        return lambda: None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        before = ctypes.c_int(0)
        libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(before), 0, 0, 0)
        if libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
            return lambda: None
    except (OSError, AttributeError):
        return lambda: None
    return lambda: libc.prctl(_PR_SET_CHILD_SUBREAPER, before.value, 0, 0, 0)


def child_pids() -> set[int]:
    """The pids of this process's descendants: from /proc on Linux, as importing
    psutil would cost every run ~25 ms (benchmarks/launcher_overhead.py)."""
    try:
        return _proc_descendants(os.getpid())
    except OSError:  # not Linux, or a kernel without /proc/<pid>/task/<tid>/children
        pass
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def _proc_descendants(root: int) -> set[int]:
    found: set[int] = set()
    todo = [root]
    while todo:
        pid = todo.pop()
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as f:
                    children = {int(child) for child in f.read().split()} - found
                found |= children
                todo += children
        except OSError:
            if pid == root:
                raise
            # a descendant that ended meanwhile
    return found


def others_alive(before: set[int]) -> bool:
    """Whether a process the jobs started is still alive, besides the helpers that
    live on with this process (`_LIBRARY_TRACKERS`)."""
    return bool(child_pids() - before - helper_pids())


def end_children(before: set[int]) -> None:
    """End the processes the jobs started (DataLoader workers, spawned children):
    this process's descendants but those in `before` (from `child_pids` at the start).

    multiprocessing's own helpers the jobs started are stopped as at interpreter exit,
    not killed: killed, the next run in this process found them gone
    ("resource_tracker: process died unexpectedly, relaunching" in a job's output).
    The resource tracker goes last: it ends once every process holding its pipe has,
    and frees what their semaphores and shared memory left behind. Stopped first,
    the run waited for it for good beside a child a timed-out job left running."""
    _stop_forkserver(before)
    if child_pids() - before:
        import psutil

        try:
            children = psutil.Process().children(recursive=True)
        except psutil.Error:
            children = []
        helpers = helper_pids()  # read after the listing: one a collection restarted meanwhile is in it
        children = [p for p in children if p.pid not in before and p.pid not in helpers]
        for child in children:
            try:
                child.terminate()
            except psutil.Error:
                pass
        _, alive = psutil.wait_procs(children, timeout=3)
        for child in alive:
            try:
                child.kill()
            except psutil.Error:
                pass
        psutil.wait_procs(alive, timeout=3)
    _stop_resource_tracker(before)


HELPER_STOP_S = 5.0
"""How long the resource tracker has to end once told to; then it is killed."""


_LIBRARY_TRACKERS = ("joblib.externals.loky.backend.resource_tracker", "loky.backend.resource_tracker")
"""Resource trackers libraries keep beside Python's (joblib's loky). Their objects are
the process's (an executor's semaphores, freed at its exit), so the tracker must still
be there when they go, as under `python`: spared by `end_children`, it ends with this
process. Killed, loky said "resource_tracker: process died unexpectedly" after the
summary, and the tracker it started again printed a KeyError for each semaphore."""


def helper_pids() -> set[int]:
    """multiprocessing's forkserver and resource trackers (Python's, and libraries'):
    helpers of the process, not of one job."""
    import multiprocessing.forkserver
    import multiprocessing.resource_tracker

    trackers = [multiprocessing.resource_tracker._resource_tracker,
                *(getattr(sys.modules.get(name), "_resource_tracker", None) for name in _LIBRARY_TRACKERS)]
    return ({getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)}
            | {getattr(tracker, "_pid", None) for tracker in trackers}) - {None}


def _stop_forkserver(before: set[int]) -> None:
    import multiprocessing.forkserver

    server = multiprocessing.forkserver._forkserver
    if getattr(server, "_forkserver_pid", None) not in (None, *before):
        try:
            server._stop()  # closes the pipe it lives on, then reaps it (it ends at once)
        except Exception:  # noqa: BLE001 - a Python without it, or gone already: end_children ends it
            pass


def _stop_resource_tracker(before: set[int], wait_s: float = HELPER_STOP_S) -> None:
    """Python's `ResourceTracker._stop`, bounded: it closes the tracker's pipe and waits
    for the tracker, which ends only once every holder of the pipe has closed it (a
    process that escaped `end_children` may not); after `wait_s` it is killed. The
    tracker is then reset, so that the next use starts a fresh one, silently."""
    import multiprocessing.resource_tracker

    tracker = multiprocessing.resource_tracker._resource_tracker
    lock = getattr(tracker, "_lock", None)
    if lock is None or getattr(tracker, "_pid", None) in (None, *before):
        return
    if not lock.acquire(timeout=wait_s):
        return  # an abandoned job's thread is inside it: left as it is, running
    try:
        pid, fd = tracker._pid, tracker._fd
        if pid is None or fd is None:
            return
        with contextlib.suppress(OSError):
            os.close(fd)
        tracker._fd = None
        try:
            if not _reaped(pid, wait_s):
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
        except ChildProcessError:
            pass  # reaped elsewhere
        tracker._pid = None
    finally:
        lock.release()


def forget_dead_resource_tracker() -> None:
    """At a run's start: a resource tracker this process started and that has since
    ended (whatever ended it) is forgotten, as a fresh process has none, so that the
    run's jobs start their own without Python's "resource_tracker: process died
    unexpectedly, relaunching" in their output. A live one is left as it is."""
    import multiprocessing.resource_tracker

    pid = getattr(multiprocessing.resource_tracker._resource_tracker, "_pid", None)
    try:
        ended = pid is not None and _reaped(pid, 0.0)
    except ChildProcessError:  # not ours to look at
        return
    if ended:
        _stop_resource_tracker(set(), 0.0)  # its pipe closed and the tracker reset


def _reaped(pid: int, wait_s: float) -> bool:
    deadline = time.monotonic() + wait_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def freeze_launcher_objects() -> Callable[[], None]:
    """Keep what exists before the jobs start (torch, its modules, ours: ~300,000
    objects) out of the cyclic collector until the run ends (`gc.freeze`).

    An ended job's namespaces are collected at once (`isolation.release`), and a full
    collection holds the GIL for as long as it takes to walk every object: 150 ms with
    torch imported, a stall of every other job at each job's end. Frozen, it walks only
    what the jobs made. A script's own `gc.collect()` gains the same."""
    if gc.get_freeze_count():
        return lambda: None  # the embedding program froze its own; leave it as it is
    gc.freeze()
    return gc.unfreeze


def cpu_threads_per_job(concurrency: int) -> int | None:
    """torch's intra-op threads for each of `concurrency` jobs that run at once on
    this machine: its CPUs divided among them. None: leave torch as it is (one job,
    or an explicit OMP_NUM_THREADS from the user, which wins as under torchrun).

    All jobs share a process's one intra-op pool (and the engines of a scaled-out
    run share the machine); with each job's ops asking for every core, OpenMP's
    spinning threads oversubscribe the CPU (measured on 2 busy cores: 50 steps of
    the transformer example, 3.0s with one thread against 11.2s with two). torchrun
    sets OMP_NUM_THREADS=1 per worker for the same reason.
    """
    if "OMP_NUM_THREADS" in isolation.process_environ() or concurrency <= 1:
        return None
    return max(1, (os.cpu_count() or 1) // concurrency)


def cpu_share_note(concurrency: int, threads: int) -> str:
    return (f"{concurrency} jobs share {os.cpu_count()} CPUs: torch uses {threads} thread(s) per op "
            "(set OMP_NUM_THREADS to choose)")


def share_cpu_threads(concurrency: int, note: Callable[..., None], threads: int | None = None) -> Callable[[], None]:
    """Set torch's intra-op threads for the run: `threads` when the caller divided the
    CPUs (a scale-out driver, among every engine's jobs, and said so), else
    `cpu_threads_per_job(concurrency)`, said through `note` when it changes them."""
    import torch

    given = threads is not None
    if not given:
        threads = cpu_threads_per_job(concurrency)
    before = torch.get_num_threads()
    if threads is None or threads == before:
        return lambda: None
    torch.set_num_threads(threads)
    if not given:
        note(cpu_share_note(concurrency, threads), important=False)
    return lambda: torch.set_num_threads(before)


class CrashLog:
    """A segfault or abort in one job ends the process (threads cannot prevent it):
    faulthandler then writes every thread's stack into <run>/crash.log, whose first
    lines say which thread runs which job (`note_thread`); report.json holds every
    job's state and last lines. Removed by `close` after a clean end."""

    def __init__(self, run_dir: Path):
        import faulthandler

        self.path = run_dir / "crash.log"
        self._was_enabled = faulthandler.is_enabled()
        try:
            self._file = open(self.path, "w", encoding="utf-8")  # noqa: SIM115
            faulthandler.enable(self._file, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            self._file = None

    def note_thread(self, thread: threading.Thread, job: str, attempt: int) -> None:
        if self._file is None:
            return
        self._file.write(f"wwrun: thread {thread_hex(thread.ident)} runs job {job} (attempt {attempt})\n")
        self._file.flush()

    def close(self) -> None:
        """No crash to tell of: faulthandler back as it was, the file removed."""
        import faulthandler

        if self._file is None:
            return
        faulthandler.disable()
        if self._was_enabled:
            try:
                faulthandler.enable(sys.__stderr__, all_threads=True)
            except (AttributeError, OSError, ValueError, RuntimeError):
                pass
        self._file.close()
        self._file = None
        self.path.unlink(missing_ok=True)
