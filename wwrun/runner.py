"""The run of one engine: `Runner` runs a `LaunchConfig`'s jobs as threads of this
process, each isolated by `wwrun.isolation`, and reports how each ended.

Blueprint, instance and outcome are separate: `JobSpec` (config.py) says what to run,
`Job` is one running copy, `JobResult` is what a job did, `RunResult` the whole run
(wwrun/result.py). One job's failure never stops the others; the run's exit code is
that of the earliest failure (the root cause), or 0.

`wwrun.launch` runs one `Runner` for a run on one device; each engine of a scaled-out
run (wwrun.scale) runs a fed one, whose jobs its driver submits.

Parts: the queue and each job's life (`_schedule`, `_start`, `_finish`: this module);
what runs in a job's thread (wwrun/jobthread.py); what the run changes in the host
process, each with its undo (wwrun/host.py); the records (wwrun/result.py).

Signals: the first SIGINT/SIGTERM reaches every running job (its own handler if it
set one, else KeyboardInterrupt) and starts nothing more; jobs then have
`grace_period_s` to end. The second ends the process at once with code 130. Child
processes the jobs started are ended with the run, orphaned ones too (the runner is
a child subreaper while it runs).

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

import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
from pathlib import Path

from wwrun import host, isolation, jobthread
from wwrun.config import JOB_PLACEHOLDER, ConfigError, JobSpec, LaunchConfig, refuse_job_memory_limits
from wwrun.display import write_collision
from wwrun.output import JobOutput, Pump
from wwrun.result import (
    EXIT_INTERRUPTED, EXIT_TIMEOUT, REPORT_EVERY_S, EventLog, JobResult, JobState, RunResult, attempt_folder,
    retry_note, run_exit_code, seconds, start_run_folder, write_error_json, write_run_report,
)


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


class Job:
    """One running copy of a JobSpec (its attempts, when it is retried)."""

    def __init__(self, spec: JobSpec, index: int, run_dir: Path, launcher_cwd: str, retries: int):
        self.own_cwd = JOB_PLACEHOLDER in (spec.cwd or "")
        """Its cwd is a folder per job (`runs/{job}`): made when it starts. Any other
        cwd must exist (the job fails entering it, as a typo should)."""
        self.spec = spec = spec.placed()  # `{job}` in its args and cwd: its name
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
        self.no_room_since: float | None = None
        self.no_room_s = 0.0
        """Seconds queued, after not fitting, until it started again: part of its `queued_s`."""
        self.retry_after_ends = 0
        self.stop: tuple[int, str] | None = None
        """(exit code, error) the launcher ended this job with (timeout, --halt now)."""
        self.stop_asked_at: float | None = None
        self.stop_delivered = False
        self.deadline: float | None = None

    def attempt_folder(self) -> Path:
        return attempt_folder(self.folder, self.attempts - 1, self.retries)


class Runner:
    """One engine's run: `run()` starts the config's jobs as slots free up and returns
    the RunResult once every job has ended.

    `fed`: start with no job; `submit` adds them while the run goes on, and the run
    ends once `close` was called and every job has ended (an engine of wwrun.scale,
    fed by its driver). `display` receives lines, notes and state changes.
    `cpu_threads`: torch's intra-op threads, when the driver divided the machine's
    CPUs among every engine's jobs; None: the runner divides them among its own.
    """

    def __init__(self, config: LaunchConfig, display, *, fed: bool = False, cpu_threads: int | None = None):
        self.config = config
        self.display = display
        self._cpu_threads = cpu_threads
        self.policy = config.resolved_policy
        self.device = resolve_device(config.device)
        self.run_dir = Path(config.log_dir).absolute() / config.run_id
        self._launcher_cwd = os.getcwd()
        self.writes = isolation.WriteWatch(on_collision=self._on_write_collision)
        """Which job wrote which file: two writing one path are named."""
        self.jobs = [] if fed else [
            Job(spec, i, self.run_dir, self._launcher_cwd, config.retries if spec.retries is None else spec.retries)
            for i, spec in enumerate(config.jobs)
        ]
        self._queue = sorted(self.jobs, key=lambda j: (-j.spec.priority, j.index))
        self._open = fed
        self._cond = threading.Condition()
        self._interrupted_at: float | None = None
        self._halted: str | None = None
        """Why nothing new starts (a failure under --halt, the run's timeout)."""
        self._ends = 0
        self._events = EventLog(config.events, config.run_id)
        self._children_before: set[int] = set()
        self._report_due = 0.0
        self._crash_log: host.CrashLog | None = None
        self._pump: Pump | None = None  # drains every job's pipes while the run goes on
        self.started = time.time()
        from wwrun.memory import Memory

        self.memory = Memory(
            self.device, config.memory_limit, self.policy,
            nodegroups=config.nodegroups, queue=config.queue, trace=bool(config.trace or config.memory_plot),
            note=self.display.note, current_job=lambda: getattr(isolation.current_job(), "name", None),
            jobs_at_once=self.concurrency, offload=config.offload, offload_limit=config.offload_limit,
            in_shared_lock=isolation.in_shared_lock,
        )
        if self.memory.allocator != "waterwave":
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
        if host.pressed_at_start_up():  # and dropped by an import on the way (torch's)
            raise KeyboardInterrupt
        start_run_folder(self.config, self.run_dir, self.display.note)
        host.forget_dead_resource_tracker()
        self._children_before = host.child_pids()
        end_subreaper = host.become_subreaper()
        self._crash_log = host.CrashLog(self.run_dir)
        self._pump = Pump(self.display.line, self.display.prompt)
        restore_signals = host.handle_interrupts(self._on_signal, self._relay_signal)
        self.display.start(self)
        restore_threads = host.share_cpu_threads(self.concurrency, self.display.note, self._cpu_threads)
        thaw = host.freeze_launcher_objects()
        try:
            for job in self.jobs:
                self._set_state(job, JobState.PENDING)
            self._schedule()
        finally:
            thaw()
            restore_threads()
            # Before their services are ended; while a second Ctrl-C still ends the run.
            isolation.run_library_exit_handlers(self.display.note)
            restore_signals()
            host.end_children(self._children_before)
            end_subreaper()
            self._crash_log.close()  # still here: no crash to tell of
            for job in self.jobs:
                if job.output:
                    job.output.close_writers()
            # A helper that lives on with the process (joblib's resource tracker) holds
            # its job's pipe until then: with nothing else alive, what is left in the
            # pipes is read, and no end of file is waited for.
            self._pump.close(until_drained=not host.others_alive(self._children_before))
            self._events.close()
        result = self._result()
        self._write_report(result)
        self._write_outputs(result)
        self.display.stop(result)
        if self.config.explain:
            engine = self.memory.engine
            self.display.explain(engine.explain() if engine else "no NodeGroups: the policy is not waterwave")
        if self.config.report:
            Path(self.config.report).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        return result

    def _write_outputs(self, result: RunResult) -> None:
        engine = self.memory.engine
        if engine is None:
            for option in ("trace", "memory_plot"):
                if getattr(self.config, option):
                    self.display.note(f"--{option.replace('_', '-')} needs the waterwave policy; nothing written")
            return
        # Checked writable before the run (preflight); a job may still have taken the path:
        # said, never raised, as the jobs' results are in and the summary is still to come.
        if self.config.trace:
            try:
                engine.write_trace(self.config.trace)
            except OSError as err:
                self.display.note(f"no trace: {err}")
        if self.config.memory_plot:
            try:
                # Labelled with the report's peaks (the allocator's), not the samples' highest.
                engine.timeline.write_memory_plot(
                    self.config.memory_plot, engine.capacity, run_id=self.config.run_id, device=engine.device,
                    peaks={job.name: job.extra.get("peak_memory_bytes") for job in result.jobs},
                    peak_total=result.extra.get("peak_memory_bytes"),
                )
            except (ImportError, RuntimeError, OSError) as err:
                self.display.note(f"no memory plot: {err}")

    def _schedule(self) -> None:
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
                    self._halted = f"the run timed out after {seconds(self.config.timeout)}"
                    for job in active:
                        self._stop(job, EXIT_TIMEOUT, self._halted)
                for job in active:
                    if job.stop is not None and not job.stop_delivered:  # asked before its thread ran
                        self._deliver_stop(job)
                    if job.deadline is not None and now > job.deadline and job.stop is None:
                        self._stop(job, EXIT_TIMEOUT, f"timed out after {seconds(job.spec.timeout)}")
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
                    self._start(job)
                    active.append(job)
                for job in self._queue:
                    if job.result.state == JobState.PENDING:
                        self._set_state(job, JobState.QUEUED, why=f"waiting for a slot ({limit} job(s) at once)")
                if not active and not self._queue and not (self._open and self._interrupted_at is None):
                    return
                self._refresh_report(now)
                self._cond.wait(0.25)

    def submit(self, spec: JobSpec, index: int, folder: str | None = None) -> None:
        """Queue one more job while the run goes on (a `fed` runner). `index` is its
        WWRUN_JOB_INDEX; `folder` its log folder (default `<run>/<name>`). It is run
        once: its retries are the feeder's to decide."""
        with self._cond:
            job = Job(spec, index, self.run_dir, self._launcher_cwd, retries=0)
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

    def _active(self) -> list[Job]:
        """Jobs started and not yet ended (running, waiting, or queued for admission)."""
        return [j for j in self.jobs if j.thread is not None and not j.result.state.is_final
                and j not in self._queue]

    def _next_to_start(self, active: list[Job]) -> Job | None:
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

    def _stop(self, job: Job, code: int, error: str) -> None:
        """End one job as SIGTERM would (its handler, else KeyboardInterrupt); it has
        the grace period to stop, then it is abandoned."""
        job.stop = (code, error)
        job.stop_asked_at = time.monotonic()
        job.stop_delivered = False
        self._deliver_stop(job)

    def _deliver_stop(self, job: Job) -> None:
        if job.context is not None and job.context.thread_id:
            job.stop_delivered = True
            isolation.deliver_signal(job.context, signal.SIGTERM)

    def _start(self, job: Job) -> None:
        spec = job.spec
        job.attempts += 1
        job.interrupted = False
        folder = job.attempt_folder()
        job.result.log_dir = str(folder)
        job.result.extra["attempts"] = job.attempts
        job.output = JobOutput(spec.name, folder)
        self._pump.add(job.output)
        script_dir = os.path.dirname(spec.script) if spec.script else job.result.cwd
        if job.own_cwd and not os.path.isdir(spec.cwd):
            try:
                os.makedirs(spec.cwd, exist_ok=True)
            except OSError:
                pass  # the job fails entering it, saying why
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
            stdin=isolation.job_stdin(spec.stdin or len(self.jobs) == 1,
                                      before_terminal_read=functools.partial(self._pump.prompt, job.output)),
            writes=self.writes,
        )
        job.result.started = time.time()
        job.result.ended = job.result.exit_code = job.result.error = None
        job.deadline = time.monotonic() + spec.timeout if spec.timeout else None
        job.stop = job.stop_asked_at = None
        job.out_of_memory = job.no_room = False
        if job.no_room_since is not None:
            job.no_room_s += time.monotonic() - job.no_room_since
            job.no_room_since = None
        self._set_state(job, JobState.RUNNING)
        # Daemon: a job stuck past the grace period must not keep the process alive.
        # Named as a script's own thread is (logging's %(threadName)s in its output).
        job.thread = threading.Thread(target=self._job_main, args=(job,), name="MainThread", daemon=True)
        job.thread.wwrun_job = spec.name
        job.thread.start()
        self._crash_log.note_thread(job.thread, spec.name, job.attempts - 1)
        self._report_due = 0.0  # the running report names the new thread at once

    def _job_environ(self, job: Job) -> dict[str, str]:
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

    def _job_main(self, job: Job) -> None:
        code, error = 1, "wwrun failed to run the job"
        try:
            code, error = jobthread.run_job(job, self.memory, lambda: self._interrupted_at is not None)
        except KeyboardInterrupt:  # a second interrupt, landing while the job handled the first
            job.interrupted = True
            code, error = EXIT_INTERRUPTED, "interrupted"
        except BaseException as exc:  # noqa: BLE001 - a bug of ours
            code, error = 1, f"wwrun: {type(exc).__name__}: {exc}"
        finally:
            self._pump.settle(job.output)  # its last lines before the line saying it ended
            # Whatever happened above, the launcher hears that this job ended: it
            # waits on the job's state, and a thread that dies silently would leave
            # it waiting forever (issue 11).
            with self._cond:
                if not job.result.state.is_final:
                    self._finish(job, code, error)
                self._cond.notify_all()

    def _on_engine_state(self, name: str, state: str) -> None:
        """From the engine, on the job's thread: queued for admission, waiting for
        memory for its next NodeGroup, or running again."""
        job = next((j for j in self.jobs if j.spec.name == name), None)
        if job is not None and not job.result.state.is_final:
            self._set_state(job, JobState(state), why=_ENGINE_WAITS.get(state))

    # -- bookkeeping ----------------------------------------------------------------

    def _finish(self, job: Job, code: int, error: str | None, abandoned: bool = False) -> None:
        """The job (or one attempt of it) ended: record it, then retry it, or halt
        the run, as the config says. Called under `_cond`."""
        result = job.result
        result.ended = time.time()
        if job.stop is not None:  # the launcher ended it: its code and reason, whatever the script did
            code, error = job.stop
            if abandoned:
                error += " (did not stop within the grace period)"
        if abandoned:
            # Its thread goes on, but the memory it reserved and its hooks go back now.
            self.memory.abandon(job.spec.name)
            _note_where(job)
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
            result.exit_code = result.error = None
            job.attempts -= 1
            job.no_room_since = time.monotonic()
            self._requeue(job, NO_ROOM_YET)
            return  # not an end: it freed only what it had just taken, and others wait for an end
        self._ends += 1
        if code != 0:
            write_error_json(job, code, error)
        if state == JobState.FAILED and self._may_retry(job):
            retry = retry_note(job.attempts, job.retries, job.out_of_memory)
            self.display.note(f"{job.spec.name} failed ({error or f'exit {code}'}): {retry}")
            self._requeue(job, retry)
            return
        self._set_state(job, state)
        if state == JobState.FAILED and self.config.halt != "never" and self._halted is None:
            self._halted = f"not started: {job.spec.name} failed (--halt {self.config.halt})"
            if self.config.halt == "now":
                for other in self._active():
                    if other is not job and other.stop is None:
                        other.interrupted = True
                        self._stop(other, EXIT_INTERRUPTED, f"interrupted: {job.spec.name} failed (--halt now)")

    def _requeue(self, job: Job, why: str) -> None:
        job.retry_after_ends = self._ends
        job.thread = None
        self._queue.append(job)
        self._queue.sort(key=lambda j: (-j.spec.priority, j.index))
        self._set_state(job, JobState.QUEUED, why=why)

    def _may_retry(self, job: Job, counted: bool = True) -> bool:
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

    def _set_state(self, job: Job, state: JobState, why: str | None = None) -> None:
        """`why`: what a queued or waiting job waits for, why one was cancelled."""
        job.result.set_state(state, why)
        if why is not None and state == JobState.CANCELLED:
            job.result.error = why
        self._events.emit(job, state)
        self.display.state(job.result)

    def _result(self, partial: bool = False) -> RunResult:
        """The run's result; `partial` while it goes on (for the running report: no
        engine figures, but each job's threads and last lines, for a crash)."""
        results = [job.result for job in self.jobs]
        for job in self.jobs:
            if partial:
                break
            job.result.extra.update(self.job_report(job))
        exit_code, root_cause = run_exit_code(results)
        from wwrun.recipe import resolved_options

        return RunResult(
            run_id=self.config.run_id, device=self.device, policy=self.policy, jobs=results,
            started=self.started, ended=time.time(), log_dir=str(self.run_dir),
            exit_code=exit_code, root_cause=root_cause,
            extra={"state": "running"} if partial else {"state": "ended", **self._run_extra()},
            options=resolved_options(self.config),
        )

    def job_report(self, job: Job) -> dict:
        """The report's memory fields of a job (`Memory.job_report`); its `queued_s`
        also counts the time it waited queued after not fitting beside the others."""
        report = self.memory.job_report(job.spec.name, started=job.result.started is not None)
        if job.no_room_s:
            report["queued_s"] = round(report.get("queued_s", 0.0) + job.no_room_s, 6)
        return report

    def _refresh_report(self, now: float) -> None:
        """Rewrite <run>/report.json while the run goes on (about once a second): if the
        process dies (a segfault in one job), what is known stays on disk."""
        if now < self._report_due:
            return
        self._report_due = now + REPORT_EVERY_S
        data = self._result(partial=True).to_dict()
        for job, record in zip(self.jobs, data["jobs"]):
            record["threads"] = [host.thread_hex(t.ident) for t in self._threads_of(job)]
            record["last_lines"] = list(job.output.tail) if job.output else []
        self._write_report_data(data)

    def _write_report(self, result: RunResult) -> None:
        self._write_report_data(result.to_dict())

    def _write_report_data(self, data: dict) -> None:
        write_run_report(self.run_dir, data, self.display.note)

    def _threads_of(self, job: Job) -> list[threading.Thread]:
        threads = [job.thread] if job.thread is not None and job.thread.is_alive() else []
        if job.context is not None:
            threads += [t for t in list(job.context.threads) if t.is_alive()]
        return threads

    def _run_extra(self) -> dict:
        extra = self.memory.run_report()
        if self.writes.collisions:
            extra["write_collisions"] = [
                {"path": path, "jobs": list(jobs)} for path, jobs in self.writes.collisions.items()]
        return extra

    def _on_write_collision(self, path: str, jobs: list[str]) -> None:
        self.display.note(f"warning: {write_collision(path, jobs)}")

    @property
    def concurrency(self) -> int:
        """How many jobs may run at once."""
        return self.config.concurrency

    def memory_of(self, name: str) -> int | None:
        """A job's current memory, for the live table; None while unknown."""
        return self.memory.memory_of(name)

    # -- signals --------------------------------------------------------------------

    def _on_signal(self, signum, frame) -> None:
        if self._interrupted_at is not None and time.monotonic() - self._interrupted_at < host.SAME_PRESS_S:
            return  # one press, delivered twice: to the launcher and to its process group
        if self._interrupted_at is not None:
            self.display.note("second interrupt: stopping now")
            host.end_children(self._children_before)
            isolation._originals.get("os._exit", os._exit)(EXIT_INTERRUPTED)
        self._interrupted_at = time.monotonic()
        # The jobs first, the note after: writing it hands the GIL back to a job thread,
        # and a job reading from DataLoader workers the same Ctrl-C is ending took a
        # batch from a dead worker meanwhile (FileNotFoundError) instead of its interrupt.
        for job in self.jobs:
            started = job.thread is not None and not job.result.state.is_final  # running, waiting or admitting
            if started and job.context and job.context.thread_id:
                job.interrupted = True
                isolation.deliver_signal(job.context, signum)
        self.display.note(
            f"interrupted: stopping every job (up to {self.config.grace_period_s:g}s; again to force)"
        )


    def _relay_signal(self, signum, frame) -> None:
        """SIGUSR1, SIGUSR2, SIGHUP: each started job gets it, as each script's own
        process would (its handler runs, or it ends as the default action ends it)."""
        for job in self.jobs:
            started = job.thread is not None and not job.result.state.is_final
            if started and job.context and job.context.thread_id:
                isolation.deliver_signal(job.context, signum)


NO_ROOM_YET = "does not fit beside the running jobs yet: starts again once one of them ends"
_ENGINE_WAITS = {
    "queued": "waiting for memory to start beside the running jobs",
    "waiting": "waiting for memory for its next NodeGroup",
}


def _note_where(job: Job) -> None:
    """An abandoned job's error.json says where its thread was (what it waited for)."""
    context = job.context
    frame = sys._current_frames().get(context.thread_id) if context is not None and context.thread_id else None
    if frame is not None and not context.traceback:
        context.traceback = "Still running here when abandoned:\n" + "".join(traceback.format_stack(frame))
