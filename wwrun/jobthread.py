"""What runs in a job's thread: the job's script (or module) as `__main__`, as
`python` would run it, then what interpreter exit does (the script's non-daemon
threads joined, its executors shut down, its atexit handlers), all inside the job's
isolation context, its RNG and its memory session.
"""

from __future__ import annotations

import builtins
import io
import os
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable

from wwrun import isolation, libstate, rng
from wwrun.config import JobSpec
from wwrun.result import EXIT_INTERRUPTED

_WWRUN_DIR = os.path.dirname(os.path.abspath(__file__))


def run_job(job, memory, interrupted: Callable[[], bool]) -> tuple[int, str | None]:
    """Run one attempt of `job` (a `wwrun.runner.Job`, its context made) in this, its
    thread, under `memory` (the run's `wwrun.memory.Memory`); (exit code, error).
    Sets the job's `interrupted`, `out_of_memory` and `no_room` as the script ended.
    `interrupted` says whether the run was interrupted (Ctrl-C, SIGTERM)."""
    ctx = job.context
    session = memory.session(job.spec.name, job.spec.priority, job.spec.memory_limit)
    try:
        return _run_attempt(job, ctx, memory, session, interrupted)
    finally:
        _clean_up(job, ctx, session)


def _run_attempt(job, ctx, memory, session, interrupted) -> tuple[int, str | None]:
    """The script, its non-daemon threads and atexit handlers; (exit code, error)."""
    code, error, exited = 0, None, False
    try:
        isolation.enter(ctx)
        # The launcher interrupts the jobs whose thread it knows; one being started as
        # the Ctrl-C came had none yet and trained on to its end. Asked after its
        # thread is known (`enter`), so either the launcher reached it or it sees this.
        if interrupted():
            isolation.interrupt(ctx.thread_id, KeyboardInterrupt, ctx)
        _threads_default_to_non_daemon()
        rng.enter_job()
        ctx.thread_hooks.append(lambda: memory.join_thread(job.spec.name))
        session.__enter__()  # may wait until the job fits beside the others
        _run_code(job.spec, ctx)
    except BaseException as exc:  # noqa: BLE001 - every way a script can end
        job.no_room = type(exc).__name__ == "NoRoomYet"
        # Not fitting yet is a wait, not the script's error: nothing in its output.
        code, error = _outcome(exc, ctx, quiet=job.no_room)
        if isinstance(exc, KeyboardInterrupt):
            job.interrupted = True
        job.out_of_memory = _is_out_of_memory(exc)
        exited = isinstance(exc, isolation.JobExit)  # os._exit, a signal's end, an exec: no atexit
    try:  # as at interpreter exit: first the non-daemon threads, then atexit
        if not exited:
            _join_job_threads(ctx)
            isolation.run_atexit_handlers(ctx)
    except BaseException as exc:  # noqa: BLE001 - a late Ctrl-C, a crash in atexit
        if code == 0:
            code, error = _outcome(exc, ctx)
    if isolation.in_forked_child():
        _end_forked_child(ctx, code)
    return code, error


def _end_forked_child(ctx: isolation.JobContext, code: int) -> None:
    """The script called os.fork() and this is the child, at the script's end: it
    exits with the script's code, as under `python`. wwrun's cleanup is not its to
    run: it would wait for locks that threads of the launcher held at the fork."""
    _flush_output(ctx)
    os._exit(code & 0xFF)  # a child's os._exit is Python's own


def _flush_output(ctx: isolation.JobContext) -> None:
    for stream in (ctx.stdout, ctx.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed by the script
            pass


def _clean_up(job, ctx, session) -> None:
    """Whatever ended the attempt (a second interrupt landing while the first was
    handled, too), the job's streams, namespaces and memory are handed back."""
    isolation.close_interrupts(ctx)  # what follows is wwrun's, not the job's
    _flush_output(ctx)
    ctx.stdin.close()
    libstate.profiler_sessions.release(ctx)  # a session it never stopped ends with it
    isolation.end_daemon_processes(ctx)  # as at a process's exit: before its namespaces are collected
    rng.leave_job()
    try:
        isolation.leave()  # drops the job's namespaces: its tensors are freed here
    finally:
        # Only then are its reserved bytes handed back: waking the others
        # while its model still held memory made them fail in turn.
        session.leave()
    job.output.release_writers()


def _run_code(spec: JobSpec, ctx: isolation.JobContext) -> None:
    """Execute the script or module as `__main__` in the job's own module object."""
    main = ctx.main
    main.__dict__.update(__builtins__=builtins, __package__=None, __cached__=None)
    if spec.script is not None:
        try:
            with io.open_code(spec.script) as f:
                source = f.read()
        except OSError as err:  # what python itself says, and its exit code
            print(f"wwrun: can't open file {spec.script!r}: [Errno {err.errno}] {err.strerror}", file=ctx.stderr)
            raise SystemExit(2) from None
        code = compile(source, spec.script, "exec", dont_inherit=True)
        main.__dict__.update(__file__=spec.script, __spec__=None, __loader__=None)
    else:
        module_spec = isolation.find_spec(ctx, spec.module)
        if module_spec is not None and module_spec.submodule_search_locations is not None:
            module_spec = isolation.find_spec(ctx, f"{spec.module}.__main__")
        if module_spec is None or module_spec.loader is None:
            raise ModuleNotFoundError(f"No module named {spec.module}", name=spec.module)
        code = module_spec.loader.get_code(module_spec.name)
        main.__dict__.update(
            __file__=module_spec.origin, __spec__=module_spec, __loader__=module_spec.loader,
            __package__=module_spec.parent,
        )
        ctx.argv[0] = module_spec.origin
    exec(code, main.__dict__)


def _outcome(exc: BaseException, ctx: isolation.JobContext, quiet: bool = False) -> tuple[int, str | None]:
    """(exit code, error message) for the way a script ended, printing what Python
    would print at exit into the job's stderr (unless `quiet`)."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0, None
        if isinstance(code, int):
            code &= 0xFF  # what its process's parent would see: sys.exit(256) is 0, -1 is 255
            return code, None if code == 0 else f"exited with code {code}"
        _write_quietly(ctx.stderr, f"{code}\n")
        return 1, str(code)
    if isinstance(exc, isolation.KilledBySignal):  # as the signal ends a script's process: silently
        return exc.code, f"killed by {signal.Signals(exc.signum).name}"
    if isinstance(exc, isolation.JobExit):
        code = exc.code & 0xFF
        return code, None if code == 0 else f"os._exit({exc.code})"
    if isinstance(exc, KeyboardInterrupt):
        _write_quietly(ctx.stderr, "KeyboardInterrupt\n")
        return EXIT_INTERRUPTED, "interrupted"
    ctx.traceback = _script_traceback(exc)
    if quiet:
        pass
    elif ctx.excepthook is not sys.__excepthook__:  # the script's own prints it, as at python's exit
        _call_excepthook(ctx, exc)
    else:
        _write_quietly(ctx.stderr, ctx.traceback)
    return 1, f"{type(exc).__name__}: {exc}"


def _call_excepthook(ctx: isolation.JobContext, exc: BaseException) -> None:
    """The job's `sys.excepthook` on its uncaught exception; one that fails is
    reported as Python reports it, with the original traceback after."""
    try:
        ctx.excepthook(type(exc), exc, _script_frames(exc.__traceback__))
    except BaseException as failure:  # noqa: BLE001 - Python's "Error in sys.excepthook"
        _write_quietly(ctx.stderr, f"Error in sys.excepthook:\n{_script_traceback(failure)}\n"
                                   f"Original exception was:\n{ctx.traceback}")


def _is_out_of_memory(exc: BaseException) -> bool:
    """torch.OutOfMemoryError, the engine's JobTooLarge, or the host's MemoryError."""
    names = {cls.__name__ for cls in type(exc).__mro__}
    return bool(names & {"OutOfMemoryError", "JobTooLarge", "MemoryError"})


def _write_quietly(stream, text: str) -> None:
    """Write what Python would print at exit; a job may have closed its own stream."""
    try:
        stream.write(text)
    except (OSError, ValueError):
        pass


def _script_traceback(exc: BaseException) -> str:
    """The traceback Python would print, without wwrun's own frames."""
    return "".join(traceback.format_exception(type(exc), exc, _script_frames(exc.__traceback__)))


def _script_frames(tb):
    """The traceback from the script's first frame on (wwrun's own left out)."""
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_WWRUN_DIR):
        tb = tb.tb_next
    return tb


def _threads_default_to_non_daemon() -> None:
    """In a job's thread: threads the script starts are non-daemon unless it says
    otherwise, as under `python script.py`, whose main thread is not a daemon.

    The job's own thread stays a daemon for the interpreter (it was started as one:
    a job stuck past the grace period must not keep the process alive); only the
    flag new threads copy from their starter changes."""
    threading.current_thread()._daemonic = False


def _join_job_threads(ctx: isolation.JobContext) -> None:
    """As at interpreter exit: wait for the non-daemon threads the job started,
    including those they start meanwhile. Short joins, so that an interrupt (Ctrl-C,
    a timeout) can land in this thread while it waits."""
    me = threading.current_thread()
    _shut_down_executors(ctx)
    while True:
        pending = [t for t in list(ctx.threads)
                   if t is not me and not t.daemon and t.is_alive() and not isolation.stopped_at_exit(t)]
        if not pending:
            return
        for thread in pending:
            thread.join(0.1)


def _shut_down_executors(ctx: isolation.JobContext) -> None:
    """What interpreter exit does for concurrent.futures (its `threading._register_atexit`
    hook), for this job's executors only: their idle workers are told to stop once
    the queued work is done, so that a script that never called `shutdown()` ends as
    under python instead of waiting on them forever. The hook itself is process-wide:
    it would stop every job's executors. loky's reusable executor (joblib's) is the
    job's own too (`libstate`), and is shut down so."""
    thread_pools = sys.modules.get("concurrent.futures.thread")
    for thread in list(ctx.threads):
        reference = None
        if thread_pools is not None and getattr(thread, "_target", None) is thread_pools._worker:
            reference = thread._args[0]
        elif isinstance(getattr(thread, "executor_reference", None), weakref.ref):
            reference = thread.executor_reference  # a process pool's manager (loky's too)
        executor = reference() if reference is not None else None
        if executor is not None:
            executor.shutdown(wait=False)
