"""The driver: one queue for several engines. It places each job on an engine by
memory (`placement.choose`), relays the engines' states, lines and memory to the
display and the events, retries a failed job (on another engine when one fits), and
writes the run's merged report.

A job's life, as the driver sees it:

    pending -> (placed on engine k) -> the engine's states: running | queued | waiting
            -> succeeded | failed | interrupted
    failed (retries left) -> queued -> placed again, another engine first
    pending | queued -> cancelled   (Ctrl-C, --halt, the run's timeout, no engine left)

An engine that dies (a segfault in one of its jobs, a lost Ray node) ends only its
own jobs: each fails with the shell's code for the signal (139 for SIGSEGV) and,
with retries left, is queued again for the engines still alive.

Files: `<run>/report.json` (each job gains `engine`), `<run>/recipe.yaml`,
`<run>/<job>/` (logs, written by the engine that ran it, `attempt_N/` with retries),
`<run>/engine-<k>/<run_id>/` (each engine's own report and crash.log).
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path

from wwrun.config import JobSpec, LaunchConfig
from wwrun.host import cpu_share_note, handle_interrupts
from wwrun.result import (
    EXIT_INTERRUPTED, REPORT_EVERY_S, EventLog, JobResult, JobState, RunResult, attempt_folder,
    retry_note, run_exit_code, seconds, start_run_folder, write_error_json, write_run_report,
)
from wwrun.scale.engines import START_TIMEOUT_S, death_exit_code
from wwrun.scale.placement import EngineView, Estimates, choose

WAIT_S = 0.1
CLOSE_TIMEOUT_S = 30.0


class _Tail:
    """A job's last lines, for the live table and the running report."""

    def __init__(self):
        self.tail = collections.deque(maxlen=20)

    @property
    def last_line(self) -> str:
        return self.tail[-1] if self.tail else ""


class _DriverJob:
    """One job of the run, across its attempts and engines."""

    def __init__(self, spec: JobSpec, index: int, run_dir: Path, retries: int):
        self.spec = spec
        self.index = index
        self.folder = run_dir / spec.name
        self.retries = retries
        placed = spec.placed()  # as the engine runs it: `{job}` filled in
        self.result = JobResult(name=spec.name, script=spec.script, module=spec.module, args=list(placed.args),
                                cwd=placed.cwd, log_dir=str(self.folder))
        self.output = _Tail()
        self.key = spec.script or f"-m {spec.module}"
        """Sweep siblings share it: the same script (or module), other arguments."""
        self.attempts = 0
        self.engine: int | None = None
        self.avoid: set[int] = set()
        """Engines this job failed on: tried last."""
        self.counted = 0
        """Bytes the driver counts on for it on its engine: its known peak, else its peak so far."""
        self.profiled = False
        self.out_of_memory = False
        self.retry_after_ends = 0
        self.hint = spec.memory
        """Its `memory` hint, until it runs out of memory: then what was measured."""
        self.context = None  # as the launcher's jobs have (error.json reads its traceback)


class Driver:
    def __init__(self, config: LaunchConfig, fleet, display):
        self.config = config
        self.fleet = fleet
        self.display = display
        self.policy = config.resolved_policy
        self.device = fleet.plan.device
        self.run_dir = Path(config.log_dir).absolute() / config.run_id
        cwd = os.getcwd()
        # Engines may run elsewhere (Ray): every path they get is absolute.
        self.jobs = [
            _DriverJob(_with_cwd(spec, cwd), i, self.run_dir, config.retries if spec.retries is None else spec.retries)
            for i, spec in enumerate(config.jobs)
        ]
        self._by_name = {job.spec.name: job for job in self.jobs}
        self._queue: list[_DriverJob] = []
        self.views: list[EngineView] = []
        self.estimates = Estimates()
        self._events = EventLog(config.events, config.run_id)
        self._interrupted_at: float | None = None
        self._interrupt_asked = False
        self._halted: str | None = None
        self._ends = 0
        self._report_due = 0.0
        self.started = time.time()

    # -- the run ------------------------------------------------------------------

    def run(self) -> RunResult:
        start_run_folder(self.config, self.run_dir, self.display.note)
        restore_signals = self._install_signal_handlers()
        self.display.start(self)
        try:
            for job in self.jobs:
                self._set_state(job, JobState.PENDING)
            self._queue = sorted(self.jobs, key=lambda j: (-j.spec.priority, j.index))
            if self.fleet.cpu_threads is not None:  # said once here, not by each engine
                self.display.note(cpu_share_note(self.fleet.jobs_at_once, self.fleet.cpu_threads), important=False)
            self.fleet.start()
            self._await_engines()
            self._loop()
            self._close_engines()
        finally:
            restore_signals()
            self._events.close()
            self.fleet.shutdown(5.0)
        result = self._result()
        self._write_report_data(result.to_dict())
        self.display.stop(result)
        if self.config.report:
            Path(self.config.report).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        return result

    def _await_engines(self) -> None:
        """Until every engine said it is ready (or died), bounded."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline and self._interrupted_at is None:
            self._pump(0.2)
            if all(e.ready or not e.alive for e in self.fleet.engines):
                break
        for engine in self.fleet.engines:
            if not engine.ready and engine.alive:
                engine.alive = False
                engine.death = ("interrupted before it started" if self._interrupted_at is not None
                                else f"did not start within {START_TIMEOUT_S:g}s")
        self.views = [
            EngineView(index=e.index, capacity=e.info.get("capacity"), slots=self.config.concurrency,
                       alive=e.ready and e.alive)
            for e in self.fleet.engines
        ]
        started = [e for e in self.fleet.engines if e.ready]
        self.display.note(
            f"{len(started)} engine(s): " + ", ".join(
                f"{e.label} on {e.info.get('host')} (pid {e.info.get('pid')}, "
                f"{_size(e.info.get('capacity'))})" for e in started),
            important=False,
        )
        if not started:
            why = "; ".join(f"{e.label}: {e.death}" for e in self.fleet.engines) or "no engine"
            for job in self._queue:
                job.result.exit_code, job.result.error = 1, f"no engine started ({why})"
                job.result.ended = time.time()
                self._set_state(job, JobState.FAILED)
            self._queue = []

    def _loop(self) -> None:
        run_deadline = time.monotonic() + self.config.timeout if self.config.timeout else None
        grace = self.config.grace_period_s
        while True:
            self._pump(WAIT_S)
            now = time.monotonic()
            if run_deadline is not None and now > run_deadline and self._halted is None:
                # The engines run under the same timeout and stop their own jobs.
                self._halted = f"the run timed out after {seconds(self.config.timeout)}"
            if not any(v.alive for v in self.views) and self._queue and self._halted is None:
                self._halted = "not started: every engine died"
            if self._interrupted_at is not None or self._halted is not None:
                for job in self._queue:
                    job.result.error = self._halted or "the run was interrupted"
                    self._set_state(job, JobState.CANCELLED)
                self._queue = []
            self._place()
            active = self._active()
            if not active and not self._queue:
                return
            if self._interrupted_at is not None and now > self._interrupted_at + grace + 5.0:
                for job in active:  # its engine did not answer in time
                    self._end(job, EXIT_INTERRUPTED, "did not stop within the grace period", JobState.INTERRUPTED)
                return
            self._refresh_report(now)

    def _close_engines(self) -> None:
        """No more jobs: each engine ends its run and says so (bounded)."""
        for engine in self.fleet.engines:
            if engine.alive:
                self.fleet.close(engine.index)
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        while time.monotonic() < deadline and any(e.alive and not e.done for e in self.fleet.engines):
            self._pump(0.2)

    def _active(self) -> list[_DriverJob]:
        return [j for j in self.jobs if j.engine is not None and not j.result.state.is_final]

    # -- placement ------------------------------------------------------------------

    def _place(self) -> None:
        if self._interrupted_at is not None or self._halted is not None:
            return
        budgets = any(v.capacity is not None for v in self.views)
        for job in list(self._queue):
            if not any(v.alive and v.running < v.slots for v in self.views):
                break  # no free slot anywhere: the rest wait
            if job.out_of_memory and self._ends <= job.retry_after_ends and self._active():
                continue  # after running out of memory: once another job has ended
            estimate = self.estimates.of(job.key, job.hint)
            if estimate is None and budgets and job.key in self.estimates.scouting:
                continue  # a sibling is being profiled: its figure will place this one
            index = choose(estimate, self.views, frozenset(job.avoid))
            if index is not None:
                self._submit(job, index, estimate)

    def _submit(self, job: _DriverJob, index: int, estimate) -> None:
        view = self.views[index]
        self._queue.remove(job)
        job.attempts += 1
        job.engine = index
        job.profiled = estimate is not None
        job.counted = view.need(estimate) if estimate is not None else 0
        view.running += 1
        if estimate is None:
            view.profiling += 1
            self.estimates.scouting[job.key] = job.spec.name
        self._recount(index)
        folder = attempt_folder(job.folder, job.attempts - 1, job.retries)
        job.result.log_dir = str(folder)
        job.result.extra.update(attempts=job.attempts, engine=index)
        job.result.started = job.result.ended = job.result.exit_code = job.result.error = None
        self.fleet.submit(index, job.spec, job.index, str(folder))

    def _recount(self, index: int) -> None:
        self.views[index].committed = sum(j.counted for j in self._active() if j.engine == index)

    def _release(self, job: _DriverJob) -> None:
        """The job no longer runs on its engine: its slot and bytes go back."""
        view = self.views[job.engine]
        view.running -= 1
        if not job.profiled:
            view.profiling -= 1
            job.profiled = True
        if self.estimates.scouting.get(job.key) == job.spec.name:
            del self.estimates.scouting[job.key]

    # -- what the engines say -------------------------------------------------------

    def _pump(self, timeout: float) -> None:
        if self._interrupt_asked and self._interrupted_at is None:
            self._interrupt()
        messages, dead = self.fleet.wait(timeout)
        for index, message in messages:
            self._handle(index, message)
        for index in dead:
            self._engine_died(index)

    def _handle(self, index: int, message: tuple) -> None:
        kind = message[0]
        if kind == "line":
            _, name, stream, text = message
            job = self._by_name.get(name)
            if job is not None:
                job.output.tail.append(text)
            self.display.line(name, stream, text)
        elif kind == "note":
            self.display.note(f"{self.fleet.engines[index].label}: {message[1]}", message[2])
        elif kind == "memory":
            self._on_memory(index, message[1], message[2])
        elif kind == "state":
            self._on_state(index, *message[1:])
        elif kind == "error":
            self.display.note(message[1])

    def _on_memory(self, index: int, figures: dict, live: int) -> None:
        if index >= len(self.views):
            return
        self.views[index].live = live
        for name, (job_live, peak, iterations) in figures.items():
            job = self._by_name.get(name)
            if job is None or job.engine != index or job.result.state.is_final:
                continue
            job.result.extra["memory_bytes"] = job_live
            job.counted = max(job.counted, peak)
            if iterations >= 1 and not job.profiled:  # past its first step: its figure serves its siblings
                job.profiled = True
                self.views[index].profiling -= 1
                self.estimates.record(job.key, peak)
                if self.estimates.scouting.get(job.key) == name:
                    del self.estimates.scouting[job.key]
        self._recount(index)

    def _on_state(self, index: int, name: str, state: str, details: dict) -> None:
        job = self._by_name.get(name)
        if job is None or job.engine != index or job.result.state.is_final:
            return  # an earlier attempt's, or a job already given up on
        state = JobState(state)
        if state == JobState.PENDING:
            return
        job.result.started = details.get("started") or job.result.started
        if not state.is_final:
            self._set_state(job, state, details.get("reason"))
            return
        report = details.get("report") or {}
        job.result.extra.update(report)
        job.result.extra.pop("memory_bytes", None)
        peak = report.get("peak_memory_bytes")
        if report.get("iterations") or state == JobState.SUCCEEDED and peak is not None:
            # Past a step, or ran to its end: its figure holds (a script without a model measures 0).
            self.estimates.record(job.key, peak or 0)
        job.out_of_memory = bool(details.get("out_of_memory"))
        if job.out_of_memory:  # the hint was too low (or the siblings' figure): what it used now counts
            job.hint = max(peak or 0, job.counted) or None
        job.result.ended = details.get("ended") or time.time()
        self._end(job, details.get("exit_code"), details.get("error"), state)

    def _engine_died(self, index: int) -> None:
        engine = self.fleet.engines[index]
        if index < len(self.views):
            self.views[index].alive = False
        lost = [j for j in self._active() if j.engine == index]
        crash_log = self.run_dir / f"engine-{index}" / self.config.run_id / "crash.log"
        where = f"; its stacks are in {crash_log}" if crash_log.exists() and crash_log.stat().st_size else ""
        why = f"{engine.label}: {engine.death}{where}"
        self.display.note(f"{why}; {len(lost)} job(s) ran there")
        for job in lost:
            job.result.ended = time.time()
            code = death_exit_code(engine.exit_code)
            write_error_json(job, code, why)  # its engine cannot: it is gone
            self._end(job, code, why, JobState.FAILED)

    def _end(self, job: _DriverJob, code: int | None, error: str | None, state: JobState) -> None:
        """An attempt ended: retry it, or record how the job ended (and --halt)."""
        self._release(job)
        self._ends += 1
        engine = job.engine
        self._recount(engine)
        job.result.exit_code = code
        job.result.error = error
        if state == JobState.FAILED and self._may_retry(job):
            job.avoid.add(engine)
            retry = retry_note(job.attempts, job.retries, job.out_of_memory)
            self.display.note(f"{job.spec.name} failed on engine {engine} ({error or f'exit {code}'}): {retry}")
            job.engine = None
            job.retry_after_ends = self._ends
            self._queue.append(job)
            self._queue.sort(key=lambda j: (-j.spec.priority, j.index))
            self._set_state(job, JobState.QUEUED, retry)
            return
        self._set_state(job, state)
        if state == JobState.FAILED and self.config.halt != "never" and self._halted is None:
            self._halted = f"not started: {job.spec.name} failed (--halt {self.config.halt})"
            if self.config.halt == "now":
                for engine_ in self.fleet.engines:
                    self.fleet.interrupt(engine_.index)

    def _may_retry(self, job: _DriverJob) -> bool:
        return (job.attempts <= job.retries and self._interrupted_at is None and self._halted is None
                and any(v.alive for v in self.views))

    def _set_state(self, job: _DriverJob, state: JobState, why: str | None = None) -> None:
        """`why`: what a queued or waiting job waits for."""
        job.result.set_state(state, why)
        self._events.emit(job, state)
        self.display.state(job.result)

    # -- for the display --------------------------------------------------------------

    def memory_of(self, name: str) -> int | None:
        job = self._by_name.get(name)
        return None if job is None else job.result.extra.get("memory_bytes")

    # -- signals ----------------------------------------------------------------------

    def _install_signal_handlers(self):
        return handle_interrupts(self._on_signal)

    def _on_signal(self, signum, frame) -> None:
        """The first interrupt goes to every engine (each interrupts its jobs, which
        have the grace period), the second ends every engine and this process.

        The handler only notes the first: it runs on the main thread, between any two
        of its bytecodes, maybe while that thread holds the display's lock or writes
        to an engine's pipe; `_pump` acts on it."""
        if self._interrupted_at is not None or self._interrupt_asked:
            os.write(2, b"[wwrun] second interrupt: stopping now\n")
            self.fleet.shutdown(0)  # every engine, and a Ray this run started
            os._exit(EXIT_INTERRUPTED)
        self._interrupt_asked = True

    def _interrupt(self) -> None:
        self._interrupted_at = time.monotonic()
        self.display.note(
            f"interrupted: stopping every job on every engine (up to {self.config.grace_period_s:g}s; again to force)"
        )
        for engine in self.fleet.engines:
            self.fleet.interrupt(engine.index)

    # -- the report -------------------------------------------------------------------

    def _result(self, partial: bool = False) -> RunResult:
        from wwrun.recipe import resolved_options

        results = [job.result for job in self.jobs]
        exit_code, root_cause = run_exit_code(results)
        engines = [
            {"engine": e.index, "label": e.label, "host": e.info.get("host"), "pid": e.info.get("pid"),
             "device": e.info.get("device"), "memory_limit_bytes": e.info.get("capacity"),
             "allocator": e.info.get("allocator"),
             "state": "died" if e.death else ("ended" if e.done else "running"), "error": e.death}
            for e in self.fleet.engines
        ]
        extra = {"state": "running" if partial else "ended", "scale": self.fleet.kind, "engines": engines}
        return RunResult(
            run_id=self.config.run_id, device=self.device, policy=self.policy, jobs=results,
            started=self.started, ended=time.time(), log_dir=str(self.run_dir),
            exit_code=exit_code, root_cause=root_cause, extra=extra,
            options=resolved_options(self.config),
        )

    def _refresh_report(self, now: float) -> None:
        if now < self._report_due:
            return
        self._report_due = now + REPORT_EVERY_S
        data = self._result(partial=True).to_dict()
        for job, record in zip(self.jobs, data["jobs"]):
            record["last_lines"] = list(job.output.tail)
        self._write_report_data(data)

    def _write_report_data(self, data: dict) -> None:
        write_run_report(self.run_dir, data, self.display.note)


def _with_cwd(spec: JobSpec, cwd: str) -> JobSpec:
    import dataclasses

    return dataclasses.replace(spec, cwd=os.path.abspath(spec.cwd or cwd))


def _size(capacity) -> str:
    from wwrun.config import format_size

    return "no memory limit" if capacity is None else f"{format_size(capacity)} limit"
