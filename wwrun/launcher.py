"""`launch(config) -> RunResult`: run every job of a `LaunchConfig` as a thread of this
process, each isolated by `wwrun.isolation`, and report how each ended.

Blueprint, instance and outcome are separate: `JobSpec` (config.py) says what to run,
`_Job` is one running copy, `JobResult` is what a job did, `RunResult` the whole run.
One job's failure never stops the others; the run's exit code is that of the earliest
failure (the root cause), or 0.

Signals: the first SIGINT/SIGTERM reaches every running job (its own handler if it
set one, else KeyboardInterrupt) and starts nothing more; jobs then have `grace_period_s` to end. The second ends the
process at once with code 130. Child processes the jobs started are ended with the run,
orphaned ones too (the launcher is a child subreaper while it runs).

Sweeps: a job's `timeout` ends it alone as SIGTERM would (exit code 124, as GNU
timeout); the run's `timeout` ends every job so. A failed job is queued again up to
`retries` times, each attempt logged in `<job>/attempt_N/`; after running out of
memory, once another job has ended. `halt` (GNU parallel's --halt): after the first
failure start nothing new (`soon`) or also interrupt the running jobs (`now`).

A crash of the process (a segfault in one job's C extension) cannot be contained by
threads: `<run>/crash.log` then holds every thread's stack and which thread ran
which job, and `<run>/report.json`, rewritten while the run goes on, every job's
state and last lines (`wwrun show`).
"""

from __future__ import annotations

import builtins
import ctypes
import datetime
import enum
import gc
import io
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from wwrun import isolation, libstate, rng
from wwrun.config import (
    ConfigError, JobSpec, LaunchConfig, preflight, refuse_job_memory_limits, resolve_size, select_shard,
)
from wwrun.output import JobOutput, Pump

_WWRUN_DIR = os.path.dirname(os.path.abspath(__file__))
EXIT_INTERRUPTED = 130
EXIT_TIMEOUT = 124  # as GNU timeout


class JobState(str, enum.Enum):
    """Where a job is in its life.

    pending -> queued -> running -> succeeded | failed | interrupted
    pending -> running            (a slot was free at once)
    running -> queued -> running  (admission beside the running jobs' memory; a retry)
    running <-> waiting           (its next NodeGroup waits for memory)
    pending | queued -> cancelled (interrupt, --halt or the run's timeout before it started)

    `queued`: waiting for a slot (`max_concurrent`, `sequential`), for admission
    beside the running jobs' memory (the engine says so), or to be retried; its
    script (attempt) has not started.
    """

    PENDING = "pending"
    QUEUED = "queued"
    RUNNING = "running"
    WAITING = "waiting"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    INTERRUPTED = "interrupted"
    CANCELLED = "cancelled"

    @property
    def is_final(self) -> bool:
        return self not in (JobState.PENDING, JobState.QUEUED, JobState.RUNNING, JobState.WAITING)


@dataclass(kw_only=True)
class JobResult:
    """What one job did. `extra` holds fields later stages add (memory, waits)."""

    name: str
    script: str | None
    module: str | None
    args: list[str]
    cwd: str
    state: JobState = JobState.PENDING
    exit_code: int | None = None
    started: float | None = None
    ended: float | None = None
    error: str | None = None
    log_dir: str | None = None
    extra: dict = field(default_factory=dict)

    @property
    def wall_s(self) -> float | None:
        if self.started is None:
            return None
        return (self.ended or time.time()) - self.started

    def is_failed(self) -> bool:
        return self.state in (JobState.FAILED, JobState.INTERRUPTED, JobState.CANCELLED)

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "script": self.script if self.script is not None else f"-m {self.module}",
            "args": self.args,
            "cwd": self.cwd,
            "state": self.state.value,
            "exit_code": self.exit_code,
            "started": _iso(self.started),
            "wall_s": _round(self.wall_s),
            "error": self.error,
            **self.extra,
        }


@dataclass(kw_only=True)
class RunResult:
    """The whole run: `exit_code` is 0, or the code of the earliest failure, whose job
    `root_cause` names."""

    run_id: str
    device: str
    policy: str
    jobs: list[JobResult]
    started: float
    ended: float
    log_dir: str
    exit_code: int = 0
    root_cause: str | None = None
    extra: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    """The launcher options the run resolved, under their recipe keys (as `--dry-run`)."""

    @property
    def wall_s(self) -> float:
        return self.ended - self.started

    def is_failed(self) -> bool:
        return self.exit_code != 0

    def to_dict(self) -> dict:
        import torch

        return {
            "run": {
                "run_id": self.run_id,
                "device": self.device,
                "policy": self.policy,
                "torch": torch.__version__,
                "host": socket.gethostname(),
                "started": _iso(self.started),
                "wall_s": _round(self.wall_s),
                "exit_code": self.exit_code,
                "root_cause": self.root_cause,
                "log_dir": self.log_dir,
                **self.extra,
                "options": self.options,
            },
            "jobs": [job.to_dict() for job in self.jobs],
        }


def launch(config: LaunchConfig, *, display=None) -> RunResult:
    """Run the config's jobs concurrently in this process and wait for them.

    `display` receives job lines and state changes; by default one is chosen from the
    config (`quiet`, `tee`) and whether stdout is a terminal.
    """
    from wwrun.display import make_display

    config = select_shard(config)
    preflight(config)  # every check that can be made before anything starts
    from wwrun import scale

    if scale.needs_driver(config):  # several engines: each its own process (wwrun.scale)
        return scale.launch(config, display=display)
    isolation.install()
    libstate.install()
    rng.install()
    return _Runner(config, display or make_display(config)).run()


def resolve_device(requested: str) -> str:
    """'auto' -> 'cuda' when a CUDA device is present, else 'cpu'."""
    if requested == "cpu":
        # Hide GPUs from the jobs; effective only before CUDA is first touched.
        import torch

        if not torch.cuda.is_initialized():
            os.environ["CUDA_VISIBLE_DEVICES"] = ""
        return "cpu"
    import torch

    available = torch.cuda.is_available()
    if requested == "cuda" and not available:
        raise ConfigError("device", "'cuda' was asked for but no CUDA device is available")
    return "cuda" if available else "cpu"


class _Job:
    """One running copy of a JobSpec (its attempts, when it is retried)."""

    def __init__(self, spec: JobSpec, index: int, run_dir: Path, launcher_cwd: str, retries: int):
        self.spec = spec
        self.index = index
        self.folder = run_dir / spec.name
        self.retries = retries
        cwd = spec.cwd or launcher_cwd
        self.result = JobResult(
            name=spec.name, script=spec.script, module=spec.module, args=list(spec.args),
            cwd=cwd, log_dir=str(self.folder),
        )
        self.output: JobOutput | None = None
        self.context: isolation.JobContext | None = None
        self.thread: threading.Thread | None = None
        self.interrupted = False
        self.attempts = 0
        self.out_of_memory = False
        """The last attempt failed for want of memory: a retry waits for another job's end."""
        self.no_room = False
        """It fits alone but not beside the running jobs (the engine's NoRoomYet): it
        starts again, not counted as an attempt, once another job has ended."""
        self.retry_after_ends = 0
        self.stop: tuple[int, str] | None = None
        """(exit code, error) the launcher ended this job with (timeout, --halt now)."""
        self.stop_asked_at: float | None = None
        self.stop_delivered = False
        self.deadline: float | None = None

    def attempt_folder(self) -> Path:
        """`<job>/attempt_N/` when the job may be retried (as torchrun's attempts), else `<job>/`."""
        return self.folder / f"attempt_{self.attempts - 1}" if self.retries else self.folder


def write_run_report(run_dir: Path, data: dict, note: Callable[[str], None]) -> None:
    """<run>/report.json, replaced whole (a crash mid-write leaves the previous one);
    a failure to write is said, never raised: the run goes on."""
    path = run_dir / "report.json"
    try:
        partial = path.with_suffix(".json.tmp")
        partial.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(partial, path)
    except OSError as err:
        note(f"could not write {path}: {err}")


# The handlers in place before the run's (see handle_interrupts), for forked children.
_handlers_before_run: dict[int, object] = {}


def handle_interrupts(handler) -> Callable[[], None]:
    """`handler` for Ctrl-C and SIGTERM while a run goes on (from the main thread
    only, as Python allows); returns what puts the previous handlers back.

    Only the launcher's process runs it: a process a job forks (a DataLoader
    worker) gets the previous handlers back at once (_restore_handlers_in_child),
    as under `python`; a terminal's Ctrl-C reaches those workers too, and the run's
    handler there printed its message again and stopped "every job" of a copy of
    the launcher, holding locks that threads of the parent held at fork."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    launcher = os.getpid()

    def in_launcher(signum, frame):
        if os.getpid() == launcher:
            handler(signum, frame)
        elif signum == signal.SIGINT:  # a child the fork hook did not reach (os.fork from C)
            raise KeyboardInterrupt
        else:  # SIGTERM's default action there
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


class _Runner:
    def __init__(self, config: LaunchConfig, display, *, fed: bool = False):
        """`fed`: start with no job; `submit` adds them while the run goes on, and the
        run ends once `close` was called and every job has ended (an engine of
        wwrun.scale, fed by its driver)."""
        self.config = config
        self.display = display
        self.policy = config.resolved_policy
        self.device = resolve_device(config.device)
        self.log_root = Path(config.log_dir).absolute()
        self.run_dir = self.log_root / config.run_id
        self._launcher_cwd = os.getcwd()
        self.jobs = [] if fed else [
            _Job(spec, i, self.run_dir, self._launcher_cwd, config.retries if spec.retries is None else spec.retries)
            for i, spec in enumerate(config.jobs)
        ]
        self._queue = sorted(self.jobs, key=lambda j: (-j.spec.priority, j.index))
        self._open = fed
        self._cond = threading.Condition()
        self._interrupted_at: float | None = None
        self._halted: str | None = None
        """Why nothing new starts (a failure under --halt, the run's timeout)."""
        self._ends = 0
        self._events = _EventLog(config.events, config.run_id)
        self._children_before: set[int] = set()
        self._report_due = 0.0
        self._crash_log = None
        self.started = time.time()
        from wwrun.memory import Memory

        self.memory = Memory(
            self.device, config.memory_limit, self.policy,
            nodegroups=config.nodegroups, queue=config.queue, trace=bool(config.trace or config.memory_plot),
            note=self.display.note, current_job=lambda: getattr(isolation.current_job(), "name", None),
        )
        if self.memory.allocator == "native":
            try:
                refuse_job_memory_limits(config, "under PyTorch's allocator")
            except ConfigError:
                self.memory.close()
                raise
        if self.memory.engine is not None:
            self.memory.engine.state_listeners.append(self._on_engine_state)

    # -- the run ------------------------------------------------------------------

    def run(self) -> RunResult:
        try:
            return self._run()
        finally:
            self.memory.close()  # torch's own CPU allocator serves again, whatever happened

    def _run(self) -> RunResult:
        from wwrun.recipe import dump_recipe

        # The log folder is made only now that jobs start: a refused run leaves none.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "recipe.yaml").write_text(dump_recipe(self.config))
        _point_latest(self.log_root, self.run_dir)
        self.display.note(f"run {self.config.run_id}: logs in {self.run_dir}", important=False)
        self._children_before = _child_pids()
        end_subreaper = _become_subreaper()
        end_crash_log = self._watch_for_crashes()
        pump = Pump(self.display.line)
        restore_signals = self._install_signal_handlers()
        self.display.start(self)
        restore_threads = self._share_cpu_threads()
        thaw = _freeze_launcher_objects()
        try:
            for job in self.jobs:
                self._set_state(job, JobState.PENDING)
            self._schedule(pump)
        finally:
            thaw()
            restore_threads()
            restore_signals()
            self._end_children()
            end_subreaper()
            end_crash_log()  # still here: no crash to tell of
            for job in self.jobs:
                if job.output:
                    job.output.close_writers()
            pump.close()
            self._events.close()
        result = self._result()
        self._write_report(result)
        self._write_outputs()
        self.display.stop(result)
        if self.config.explain:
            engine = self.memory.engine
            self.display.explain(engine.explain() if engine else "no NodeGroups: the policy is not waterwave")
        if self.config.report:
            Path(self.config.report).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        return result

    def _write_outputs(self) -> None:
        engine = self.memory.engine
        if engine is None:
            for option in ("trace", "memory_plot"):
                if getattr(self.config, option):
                    self.display.note(f"--{option.replace('_', '-')} needs the waterwave policy; nothing written")
            return
        if self.config.trace:
            engine.write_trace(self.config.trace)
        if self.config.memory_plot:
            try:
                engine.write_memory_plot(self.config.memory_plot, run_id=self.config.run_id)
            except (ImportError, RuntimeError) as err:
                self.display.note(f"no memory plot: {err}")

    def _schedule(self, pump: Pump) -> None:
        """Start jobs as slots free up, enforce timeouts and --halt, and return when
        every job has ended. Never waits on a thread that is gone, nor unboundedly."""
        limit = self.concurrency
        run_deadline = time.monotonic() + self.config.timeout if self.config.timeout else None
        with self._cond:
            while True:
                now = time.monotonic()
                self._reap_dead_threads()
                active = self._active()
                if run_deadline is not None and now > run_deadline and self._halted is None:
                    self._halted = f"the run timed out after {_seconds(self.config.timeout)}"
                    for job in active:
                        self._stop(job, EXIT_TIMEOUT, self._halted)
                for job in active:
                    if job.stop is not None and not job.stop_delivered:  # asked before its thread ran
                        self._deliver_stop(job)
                    if job.deadline is not None and now > job.deadline and job.stop is None:
                        self._stop(job, EXIT_TIMEOUT, f"timed out after {_seconds(job.spec.timeout)}")
                    elif job.stop_asked_at is not None and now > job.stop_asked_at + self.config.grace_period_s:
                        self._finish(job, *job.stop, abandoned=True)
                if self._interrupted_at is not None or self._halted is not None:
                    for job in self._queue:
                        self._set_state(job, JobState.CANCELLED, why=self._halted or "the run was interrupted")
                    self._queue = []
                active = self._active()
                if self._interrupted_at is not None:
                    if not active or now > self._interrupted_at + self.config.grace_period_s:
                        for job in active:  # past the grace period: abandoned, reported as such
                            self._finish(job, EXIT_INTERRUPTED, "did not stop within the grace period", abandoned=True)
                        return
                while self._queue and len(active) < limit:
                    job = self._next_to_start(active)
                    if job is None:
                        break
                    self._queue.remove(job)
                    self._start(job, pump)
                    active.append(job)
                for job in self._queue:
                    if job.result.state == JobState.PENDING:
                        self._set_state(job, JobState.QUEUED)
                if not active and not self._queue and not (self._open and self._interrupted_at is None):
                    return
                self._refresh_report(now)
                self._cond.wait(0.25)

    def submit(self, spec: JobSpec, index: int, folder: str | None = None) -> None:
        """Queue one more job while the run goes on (a `fed` runner). `index` is its
        WWRUN_JOB_INDEX; `folder` its log folder (default `<run>/<name>`). It is run
        once: its retries are the feeder's to decide."""
        with self._cond:
            job = _Job(spec, index, self.run_dir, self._launcher_cwd, retries=0)
            if folder is not None:
                job.folder = Path(folder)
                job.result.log_dir = folder
            self.jobs.append(job)
            self._set_state(job, JobState.PENDING)
            if self._interrupted_at is not None or self._halted is not None:
                self._set_state(job, JobState.CANCELLED, why=self._halted or "the run was interrupted")
                return
            self._queue.append(job)
            self._queue.sort(key=lambda j: (-j.spec.priority, j.index))
            self._cond.notify_all()

    def close(self) -> None:
        """No more `submit`: the run ends once its jobs have."""
        with self._cond:
            self._open = False
            self._cond.notify_all()

    def interrupt(self) -> None:
        """As the first Ctrl-C (the second ends the process), from any thread."""
        self._on_signal(signal.SIGINT, None)

    def _active(self) -> list[_Job]:
        """Jobs started and not yet ended (running, waiting, or queued for admission)."""
        return [j for j in self.jobs if j.thread is not None and not j.result.state.is_final
                and j not in self._queue]

    def _next_to_start(self, active: list[_Job]) -> _Job | None:
        """The first job in the queue that may start; a retry after running out of
        memory waits until another job has ended (memory then frees up), unless
        nothing else runs."""
        for job in self._queue:
            if not job.out_of_memory or self._ends > job.retry_after_ends or not active:
                return job
        return None

    def _reap_dead_threads(self) -> None:
        """A job whose thread has ended without reporting is finished here: the
        launcher never waits on a thread that is gone."""
        for job in self._active():
            if not job.thread.is_alive():
                self._finish(job, 1, "the job's thread ended without reporting how (a wwrun bug)")

    def _stop(self, job: _Job, code: int, error: str) -> None:
        """End one job as SIGTERM would (its handler, else KeyboardInterrupt); it has
        the grace period to stop, then it is abandoned."""
        job.stop = (code, error)
        job.stop_asked_at = time.monotonic()
        job.stop_delivered = False
        self._deliver_stop(job)

    def _deliver_stop(self, job: _Job) -> None:
        if job.context is not None and job.context.thread_id:
            job.stop_delivered = True
            isolation.deliver_signal(job.context, signal.SIGTERM)

    def _start(self, job: _Job, pump: Pump) -> None:
        spec = job.spec
        job.attempts += 1
        job.interrupted = False
        folder = job.attempt_folder()
        job.result.log_dir = str(folder)
        job.result.extra["attempts"] = job.attempts
        job.output = JobOutput(spec.name, folder)
        pump.add(job.output)
        script_dir = os.path.dirname(spec.script) if spec.script else job.result.cwd
        job.context = isolation.JobContext(
            name=spec.name,
            argv=list(spec.argv),
            environ=self._job_environ(job),
            cwd=job.result.cwd,
            local_roots=[script_dir],
            stdout=job.output.stdout,
            stderr=job.output.stderr,
            stdout_fd=job.output.fds["stdout"],
            stderr_fd=job.output.fds["stderr"],
            stdin=isolation.job_stdin(spec.stdin or len(self.jobs) == 1),
        )
        job.result.started = time.time()
        job.result.ended = job.result.exit_code = job.result.error = None
        job.deadline = time.monotonic() + spec.timeout if spec.timeout else None
        job.stop = job.stop_asked_at = None
        job.out_of_memory = job.no_room = False
        self._set_state(job, JobState.RUNNING)
        # Daemon: a job stuck past the grace period must not keep the process alive.
        job.thread = threading.Thread(target=self._job_main, args=(job,), name=f"wwrun:{spec.name}", daemon=True)
        job.thread.start()
        self._note_thread(job)
        self._report_due = 0.0  # the running report names the new thread at once

    def _job_environ(self, job: _Job) -> dict[str, str]:
        env = dict(isolation.process_environ())
        env.update(job.spec.env)
        env.update(
            WWRUN_JOB_NAME=job.spec.name,
            WWRUN_JOB_INDEX=str(job.index),
            WWRUN_RUN_ID=self.config.run_id,
            WWRUN_DEVICE=self.device,
        )
        return env

    # -- inside the job's thread ----------------------------------------------------

    def _job_main(self, job: _Job) -> None:
        code, error = 1, "wwrun failed to run the job"
        try:
            code, error = self._run_job(job)
        except BaseException as exc:  # noqa: BLE001 - a bug of ours, or a late async interrupt
            code, error = 1, f"wwrun: {type(exc).__name__}: {exc}"
        finally:
            # Whatever happened above, the launcher hears that this job ended: it
            # waits on the job's state, and a thread that dies silently would leave
            # it waiting forever (issue 11).
            with self._cond:
                if not job.result.state.is_final:
                    self._finish(job, code, error)
                self._cond.notify_all()

    def _run_job(self, job: _Job) -> tuple[int, str | None]:
        ctx = job.context
        code, error = 0, None
        memory = self.memory.session(job.spec.name, job.spec.priority, job.spec.memory_limit)
        try:
            isolation.enter(ctx)
            _threads_default_to_non_daemon()
            rng.enter_job()
            ctx.thread_hooks.append(lambda: self.memory.join_thread(job.spec.name))
            memory.__enter__()  # may wait until the job fits beside the others
            _run_code(job.spec, ctx)
        except BaseException as exc:  # noqa: BLE001 - every way a script can end
            code, error = _outcome(exc, ctx)
            if isinstance(exc, KeyboardInterrupt):
                job.interrupted = True
            job.out_of_memory = _is_out_of_memory(exc)
            job.no_room = type(exc).__name__ == "NoRoomYet"
        try:  # as at interpreter exit: first the non-daemon threads, then atexit
            _join_job_threads(ctx)
            isolation.run_atexit_handlers(ctx)
        except BaseException as exc:  # noqa: BLE001 - a late Ctrl-C, a crash in atexit
            if code == 0:
                code, error = _outcome(exc, ctx)
        finally:
            for stream in (ctx.stdout, ctx.stderr):
                try:
                    stream.flush()
                except (OSError, ValueError):
                    pass
            ctx.stdin.close()
            rng.leave_job()
            try:
                isolation.leave()  # drops the job's namespaces: its tensors are freed here
            finally:
                # Only then are its reserved bytes handed back: waking the others
                # while its model still held memory made them fail in turn.
                memory.leave()
            job.output.release_writers()
        return code, error

    def _on_engine_state(self, name: str, state: str) -> None:
        """From the engine, on the job's thread: queued for admission, waiting for
        memory for its next NodeGroup, or running again."""
        job = next((j for j in self.jobs if j.spec.name == name), None)
        if job is not None and not job.result.state.is_final:
            self._set_state(job, JobState(state))

    # -- bookkeeping ----------------------------------------------------------------

    def _finish(self, job: _Job, code: int, error: str | None, abandoned: bool = False) -> None:
        """The job (or one attempt of it) ended: record it, then retry it, or halt
        the run, as the config says. Called under `_cond`."""
        result = job.result
        result.ended = time.time()
        self._ends += 1
        if job.stop is not None:  # the launcher ended it: its code and reason, whatever the script did
            code, error = job.stop
            if abandoned:
                error += " (did not stop within the grace period)"
        if abandoned:
            # Its thread goes on, but the memory it reserved and its hooks go back now.
            self.memory.abandon(job.spec.name)
        result.exit_code = code
        result.error = error
        if code == 0:
            state = JobState.SUCCEEDED
        elif job.stop is not None:
            state = JobState.FAILED if code == EXIT_TIMEOUT else JobState.INTERRUPTED
        elif job.interrupted or code == EXIT_INTERRUPTED and self._interrupted_at is not None:
            state = JobState.INTERRUPTED
        else:
            state = JobState.FAILED
        if state == JobState.FAILED and job.no_room and self._may_retry(job, counted=False):
            # It fits alone: not a failure of the script's, which starts again from the top.
            self.display.note(f"{job.spec.name} does not fit beside the running jobs yet: "
                              "it starts again once one of them ends")
            job.attempts -= 1
            self._requeue(job)
            return
        if code != 0:
            _write_error_json(job, code, error)
        if state == JobState.FAILED and self._may_retry(job):
            self.display.note(
                f"{job.spec.name} failed ({error or f'exit {code}'}): attempt {job.attempts + 1} of "
                f"{job.retries + 1}{', once memory frees up' if job.out_of_memory else ''}"
            )
            self._requeue(job)
            return
        self._set_state(job, state)
        if state == JobState.FAILED and self.config.halt != "never" and self._halted is None:
            self._halted = f"not started: {job.spec.name} failed (--halt {self.config.halt})"
            if self.config.halt == "now":
                for other in self._active():
                    if other is not job and other.stop is None:
                        other.interrupted = True
                        self._stop(other, EXIT_INTERRUPTED, f"interrupted: {job.spec.name} failed (--halt now)")

    def _requeue(self, job: _Job) -> None:
        job.retry_after_ends = self._ends
        job.thread = None
        self._queue.append(job)
        self._queue.sort(key=lambda j: (-j.spec.priority, j.index))
        self._set_state(job, JobState.QUEUED)

    def _may_retry(self, job: _Job, counted: bool = True) -> bool:
        """A failed attempt is queued again while retries are left (`counted`), unless
        the run is stopping or the attempt's thread is still alive (abandoned past its
        grace)."""
        if counted and job.attempts > job.retries:
            return False
        if self._interrupted_at is not None or self._halted is not None:
            return False
        if job.stop is not None and job.stop[0] != EXIT_TIMEOUT:
            return False
        return job.thread is None or job.thread is threading.current_thread() or not job.thread.is_alive()

    def _set_state(self, job: _Job, state: JobState, why: str | None = None) -> None:
        job.result.state = state
        if why is not None and state == JobState.CANCELLED:
            job.result.error = why
        self._events.emit(job, state)
        self.display.state(job.result)

    def _result(self, partial: bool = False) -> RunResult:
        """The run's result; `partial` while it goes on (for the running report: no
        engine figures, but each job's threads and last lines, for a crash)."""
        results = [job.result for job in self.jobs]
        for result in results:
            if partial:
                break
            result.extra.update(self.memory.job_report(result.name, started=result.started is not None))
        failures = [r for r in results if r.exit_code not in (0, None)]
        failures.sort(key=lambda r: r.ended or float("inf"))
        cancelled = any(r.state == JobState.CANCELLED for r in results)
        root = failures[0] if failures else None
        exit_code = root.exit_code if root else (EXIT_INTERRUPTED if cancelled else 0)
        from wwrun.recipe import resolved_options

        return RunResult(
            run_id=self.config.run_id, device=self.device, policy=self.policy, jobs=results,
            started=self.started, ended=time.time(), log_dir=str(self.run_dir),
            exit_code=exit_code, root_cause=root.name if root else None,
            extra={"state": "running"} if partial else {"state": "ended", **self._run_extra()},
            options=resolved_options(self.config),
        )

    def _refresh_report(self, now: float) -> None:
        """Rewrite <run>/report.json while the run goes on (about once a second): if the
        process dies (a segfault in one job), what is known stays on disk."""
        if now < self._report_due:
            return
        self._report_due = now + REPORT_EVERY_S
        data = self._result(partial=True).to_dict()
        for job, record in zip(self.jobs, data["jobs"]):
            record["threads"] = [_thread_hex(t.ident) for t in self._threads_of(job)]
            record["last_lines"] = list(job.output.tail) if job.output else []
        self._write_report_data(data)

    def _write_report(self, result: RunResult) -> None:
        self._write_report_data(result.to_dict())

    def _write_report_data(self, data: dict) -> None:
        write_run_report(self.run_dir, data, self.display.note)

    def _threads_of(self, job: _Job) -> list[threading.Thread]:
        threads = [job.thread] if job.thread is not None and job.thread.is_alive() else []
        if job.context is not None:
            threads += [t for t in list(job.context.threads) if t.is_alive()]
        return threads

    def _watch_for_crashes(self) -> Callable[[], None]:
        """A segfault or abort in one job ends the process (threads cannot prevent it):
        faulthandler then writes every thread's stack into <run>/crash.log, whose
        first lines say which thread runs which job (see `_note_thread`); report.json
        holds every job's state and last lines. Removed after a clean end."""
        import faulthandler

        path = self.run_dir / "crash.log"
        was_enabled = faulthandler.is_enabled()
        try:
            self._crash_log = open(path, "w", encoding="utf-8")  # noqa: SIM115
            faulthandler.enable(self._crash_log, all_threads=True)
        except (OSError, ValueError, RuntimeError):
            return lambda: None

        def end():
            faulthandler.disable()
            if was_enabled:
                try:
                    faulthandler.enable(sys.__stderr__, all_threads=True)
                except (AttributeError, OSError, ValueError, RuntimeError):
                    pass
            self._crash_log.close()
            self._crash_log = None
            path.unlink(missing_ok=True)

        return end

    def _note_thread(self, job: _Job) -> None:
        if self._crash_log is None:
            return
        self._crash_log.write(
            f"wwrun: thread {_thread_hex(job.thread.ident)} runs job {job.spec.name} (attempt {job.attempts - 1})\n"
        )
        self._crash_log.flush()

    def _run_extra(self) -> dict:
        return self.memory.run_report()

    @property
    def concurrency(self) -> int:
        """How many jobs may run at once."""
        return self.config.concurrency

    def _share_cpu_threads(self) -> Callable[[], None]:
        """Divide torch's intra-op threads among the jobs that run at once.

        All jobs share the process's one intra-op pool; with each job's ops asking
        for every core, OpenMP's spinning threads oversubscribe the CPU (measured on
        2 busy cores: 50 steps of the transformer example, 3.0s with one thread
        against 11.2s with two). torchrun
        sets OMP_NUM_THREADS=1 per worker for the same reason; as there, an explicit
        OMP_NUM_THREADS from the user wins.
        """
        import torch

        if "OMP_NUM_THREADS" in isolation.process_environ() or self.concurrency == 1:
            return lambda: None
        before = torch.get_num_threads()
        share = max(1, (os.cpu_count() or 1) // self.concurrency)
        if share == before:
            return lambda: None
        torch.set_num_threads(share)
        self.display.note(
            f"{self.concurrency} jobs share {os.cpu_count()} CPUs: torch uses {share} thread(s) per op "
            "(set OMP_NUM_THREADS to choose)",
            important=False,
        )
        return lambda: torch.set_num_threads(before)

    def memory_of(self, name: str) -> int | None:
        """A job's current memory, for the live table; None while unknown."""
        return self.memory.memory_of(name)

    # -- signals and children -------------------------------------------------------

    def _install_signal_handlers(self) -> Callable[[], None]:
        return handle_interrupts(self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        if self._interrupted_at is not None:
            self.display.note("second interrupt: stopping now")
            self._end_children()
            isolation._originals.get("os._exit", os._exit)(EXIT_INTERRUPTED)
        self._interrupted_at = time.monotonic()
        self.display.note(
            f"interrupted: stopping every job (up to {self.config.grace_period_s:g}s; again to force)"
        )
        for job in self.jobs:
            started = job.thread is not None and not job.result.state.is_final  # running, waiting or admitting
            if started and job.context and job.context.thread_id:
                job.interrupted = True
                isolation.deliver_signal(job.context, signum)

    def _end_children(self) -> None:
        """End the processes the jobs started (DataLoader workers, spawned children)."""
        if not _child_pids() - self._children_before:
            return  # none (and psutil stays unloaded)
        import psutil

        try:
            children = [
                p for p in psutil.Process().children(recursive=True) if p.pid not in self._children_before
            ]
        except psutil.Error:
            return
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


REPORT_EVERY_S = 1.0
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def _thread_hex(ident: int | None) -> str:
    """A thread id as faulthandler prints it ('Thread 0x00007f...')."""
    return f"0x{ident or 0:016x}"


def _seconds(value: float | None) -> str:
    return f"{value:g}s"


def _point_latest(log_root: Path, run_dir: Path) -> None:
    """<log_dir>/latest -> the run's folder, replaced atomically."""
    link = log_root / "latest"
    staged = log_root / f".latest-{os.getpid()}"
    try:
        staged.unlink(missing_ok=True)
        staged.symlink_to(run_dir.name)
        os.replace(staged, link)
    except OSError:  # a file system without links, or 'latest' is a real folder
        staged.unlink(missing_ok=True)


def _become_subreaper() -> Callable[[], None]:
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


def _child_pids() -> set[int]:
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


def _outcome(exc: BaseException, ctx: isolation.JobContext) -> tuple[int, str | None]:
    """(exit code, error message) for the way a script ended, printing what Python
    would print at exit into the job's stderr."""
    if isinstance(exc, SystemExit):
        code = exc.code
        if code is None:
            return 0, None
        if isinstance(code, int):
            return code, None if code == 0 else f"exited with code {code}"
        _write_quietly(ctx.stderr, f"{code}\n")
        return 1, str(code)
    if isinstance(exc, isolation.JobExit):
        return exc.code, None if exc.code == 0 else f"os._exit({exc.code})"
    if isinstance(exc, KeyboardInterrupt):
        _write_quietly(ctx.stderr, "KeyboardInterrupt\n")
        return EXIT_INTERRUPTED, "interrupted"
    ctx.traceback = _script_traceback(exc)
    _write_quietly(ctx.stderr, ctx.traceback)
    return 1, f"{type(exc).__name__}: {exc}"


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
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_WWRUN_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _freeze_launcher_objects() -> Callable[[], None]:
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
        pending = [t for t in list(ctx.threads) if t is not me and not t.daemon and t.is_alive()]
        if not pending:
            return
        for thread in pending:
            thread.join(0.1)


def _shut_down_executors(ctx: isolation.JobContext) -> None:
    """What interpreter exit does for concurrent.futures (its `threading._register_atexit`
    hook), for this job's executors only: their idle workers are told to stop once
    the queued work is done, so that a script that never called `shutdown()` ends as
    under python instead of waiting on them forever. The hook itself is process-wide:
    it would stop every job's executors."""
    thread_pools = sys.modules.get("concurrent.futures.thread")
    process_pools = sys.modules.get("concurrent.futures.process")
    for thread in list(ctx.threads):
        reference = None
        if thread_pools is not None and getattr(thread, "_target", None) is thread_pools._worker:
            reference = thread._args[0]
        elif process_pools is not None and isinstance(thread, process_pools._ExecutorManagerThread):
            reference = thread.executor_reference
        executor = reference() if reference is not None else None
        if executor is not None:
            executor.shutdown(wait=False)


def _write_error_json(job: _Job, code: int, error: str | None) -> None:
    if job.result.log_dir is None:
        return
    record = {
        "job": job.spec.name,
        "exit_code": code,
        "error": error,
        "traceback": getattr(job.context, "traceback", None),
        "timestamp": _iso(job.result.ended),
    }
    path = Path(job.result.log_dir) / "error.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    except OSError:  # the log folder went away: the report still says it all
        pass


class _EventLog:
    """`--events FILE|-`: one JSON line per job state change."""

    def __init__(self, target: str | None, run_id: str):
        self._run_id = run_id
        self._lock = threading.Lock()
        if target is None:
            self._file = None
        elif target == "-":
            self._file = isolation.original_stdout()
        else:
            self._file = open(target, "a", encoding="utf-8")  # noqa: SIM115

    def emit(self, job: _Job, state: JobState) -> None:
        if self._file is None:
            return
        record = {
            "time": _iso(time.time()),
            "run_id": self._run_id,
            "job": job.spec.name,
            "index": job.index,
            "state": state.value,
            "exit_code": job.result.exit_code,
            "attempt": job.attempts,
        }
        with self._lock:
            try:
                self._file.write(json.dumps(record) + "\n")
                self._file.flush()
            except (BrokenPipeError, ValueError):
                # The reader went away (`--events - | head`): the jobs go on without it.
                self._file = None

    def close(self) -> None:
        if self._file is not None and self._file is not isolation.original_stdout():
            self._file.close()


def _iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="milliseconds")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
