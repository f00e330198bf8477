"""`launch(config) -> RunResult`: run every job of a `LaunchConfig` as a thread of this
process, each isolated by `wwrun.isolation`, and report how each ended.

Blueprint, instance and outcome are separate: `JobSpec` (config.py) says what to run,
`_Job` is one running copy, `JobResult` is what a job did, `RunResult` the whole run.
One job's failure never stops the others; the run's exit code is that of the earliest
failure (the root cause), or 0.

Signals: the first SIGINT/SIGTERM reaches every running job (its own handler if it
set one, else KeyboardInterrupt) and starts nothing more; jobs then have `grace_period_s` to end. The second ends the
process at once with code 130. Child processes the jobs started are ended with the run.
"""

from __future__ import annotations

import builtins
import datetime
import enum
import io
import json
import os
import signal
import socket
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from wwrun import isolation, libstate, rng
from wwrun.config import ConfigError, JobSpec, LaunchConfig, resolve_size
from wwrun.output import JobOutput, Pump

_WWRUN_DIR = os.path.dirname(os.path.abspath(__file__))
EXIT_INTERRUPTED = 130


class JobState(str, enum.Enum):
    """Where a job is in its life.

    pending -> queued -> running -> succeeded | failed | interrupted
    running <-> waiting          (its next NodeGroup waits for memory)
    pending | queued -> cancelled (the run was interrupted before the job started)

    `queued`: waiting for a slot (`max_concurrent`, `sequential`) or for admission
    beside the running jobs' memory; its script has not started.
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
            },
            "jobs": [job.to_dict() for job in self.jobs],
        }


def launch(config: LaunchConfig, *, display=None) -> RunResult:
    """Run the config's jobs concurrently in this process and wait for them.

    `display` receives job lines and state changes; by default one is chosen from the
    config (`quiet`, `tee`) and whether stdout is a terminal.
    """
    from wwrun.display import make_display

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
    """One running copy of a JobSpec."""

    def __init__(self, spec: JobSpec, index: int, run_dir: Path, launcher_cwd: str):
        self.spec = spec
        self.index = index
        cwd = spec.cwd or launcher_cwd
        self.result = JobResult(
            name=spec.name, script=spec.script, module=spec.module, args=list(spec.args),
            cwd=cwd, log_dir=str(run_dir / spec.name),
        )
        self.output: JobOutput | None = None
        self.context: isolation.JobContext | None = None
        self.thread: threading.Thread | None = None
        self.interrupted = False


class _Runner:
    def __init__(self, config: LaunchConfig, display):
        self.config = config
        self.display = display
        self.policy = config.resolved_policy
        self.device = resolve_device(config.device)
        self.run_dir = Path(config.log_dir).absolute() / config.run_id
        launcher_cwd = os.getcwd()
        self.jobs = [_Job(spec, i, self.run_dir, launcher_cwd) for i, spec in enumerate(config.jobs)]
        self._cond = threading.Condition()
        self._interrupted_at: float | None = None
        self._events = _EventLog(config.events, config.run_id)
        self._children_before: set[int] = set()
        self.started = time.time()
        self.allocator = self._install_allocator()
        self.capacity = self._capacity()
        self.engine = self._make_engine()
        self._expected_releases: dict[str, int] = {}

    # -- the run ------------------------------------------------------------------

    def run(self) -> RunResult:
        from wwrun.recipe import dump_recipe

        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "recipe.yaml").write_text(dump_recipe(self.config))
        self._children_before = _child_pids()
        pump = Pump(self.display.line)
        restore_signals = self._install_signal_handlers()
        self.display.start(self)
        restore_threads = self._share_cpu_threads()
        try:
            for job in self.jobs:
                self._set_state(job, JobState.PENDING)
            self._schedule(pump)
        finally:
            restore_threads()
            restore_signals()
            self._end_children()
            for job in self.jobs:
                if job.output:
                    job.output.close_writers()
            pump.close()
            self._events.close()
        result = self._result()
        self._write_outputs()
        self.display.stop(result)
        if self.config.explain:
            self.display.explain(self.engine.explain() if self.engine else "no NodeGroups: the policy is not waterwave")
        if self.config.report:
            Path(self.config.report).write_text(json.dumps(result.to_dict(), indent=2) + "\n")
        return result

    def _write_outputs(self) -> None:
        if self.engine is None:
            for option in ("trace", "memory_plot"):
                if getattr(self.config, option):
                    self.display.note(f"--{option.replace('_', '-')} needs the waterwave policy; nothing written")
            return
        if self.config.trace:
            self.engine.write_trace(self.config.trace)
        if self.config.memory_plot:
            try:
                self.engine.write_memory_plot(self.config.memory_plot)
            except (ImportError, RuntimeError) as err:
                self.display.note(f"no memory plot: {err}")

    def _schedule(self, pump: Pump) -> None:
        limit = self.concurrency
        waiting = sorted(self.jobs, key=lambda j: (-j.spec.priority, j.index))
        with self._cond:
            while True:
                running = [j for j in self.jobs if j.result.state == JobState.RUNNING]
                if self._interrupted_at is not None:
                    for job in waiting:
                        self._set_state(job, JobState.CANCELLED)
                    waiting = []
                    if not running or time.monotonic() > self._interrupted_at + self.config.grace_period_s:
                        for job in running:  # past the grace period: abandoned, reported as such
                            self._finish(job, EXIT_INTERRUPTED, "did not stop within the grace period")
                        return
                while waiting and len(running) < limit:
                    job = waiting.pop(0)
                    self._start(job, pump)
                    running.append(job)
                if not running and not waiting:
                    return
                self._cond.wait(0.25)

    def _start(self, job: _Job, pump: Pump) -> None:
        spec = job.spec
        job.output = JobOutput(spec.name, self.run_dir / spec.name)
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
        )
        job.result.started = time.time()
        self._set_state(job, JobState.RUNNING)
        # Daemon: a job stuck past the grace period must not keep the process alive.
        job.thread = threading.Thread(target=self._job_main, args=(job,), name=f"wwrun:{spec.name}", daemon=True)
        job.thread.start()

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
        ctx = job.context
        code, error = 0, None
        try:
            isolation.enter(ctx)
            rng.enter_job()
            self._prepare_device(job)
            if self.engine is not None:  # may wait until the job fits beside the others
                self.engine.job_started(job.spec.name, job.spec.priority)
            _run_code(job.spec, ctx)
        except BaseException as exc:  # noqa: BLE001 - every way a script can end
            code, error = _outcome(exc, ctx)
            if isinstance(exc, KeyboardInterrupt):
                job.interrupted = True
        if self.engine is not None:  # hands back every byte it reserved, wakes the others
            self.engine.job_finished(job.spec.name)
        try:
            isolation.run_atexit_handlers(ctx)
            _join_job_threads(ctx)
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
            isolation.leave()
        self._release_device(job)
        with self._cond:
            if not job.result.state.is_final:
                self._finish(job, code, error)
            self._cond.notify_all()

    def _install_allocator(self) -> str | None:
        """On CUDA, the memory-flow allocator (built at first use), before any CUDA
        work; PyTorch's own when it cannot be had, said once."""
        if self.device != "cuda":
            return None
        from wwrun import allocator

        try:
            allocator.install()
        except Exception as err:  # noqa: BLE001 - no compiler, CUDA already in use, ...
            self.display.note(f"memory-flow allocator unavailable, using PyTorch's: {err}")
            return "native"
        return "waterwave"

    def _capacity(self) -> int | None:
        """Bytes the run may use: --memory-limit (a fraction of the device's memory, or
        bytes); on CUDA the whole device without one, on the CPU no budget."""
        if self.device == "cuda":
            import torch

            total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
            return resolve_size(self.config.memory_limit, total) or total
        if self.config.memory_limit is None:
            return None
        import psutil

        return resolve_size(self.config.memory_limit, psutil.virtual_memory().total)

    def _make_engine(self):
        """The NodeGroup scheduler (wwrun.engine) under the waterwave policy; the
        baselines (concurrent, sequential) run plain."""
        if self.policy != "waterwave":
            return None
        from wwrun.engine import Engine

        probe = None
        if self.allocator == "waterwave":
            probe = lambda name: (self._allocator_figures(name) or {}).get("current", 0)  # noqa: E731
        engine = Engine(
            self.capacity,
            policy=self.policy,
            nodegroups=self.config.nodegroups,
            queue=self.config.queue,
            device=self.device,
            trace=bool(self.config.trace or self.config.memory_plot),
            current_job=lambda: getattr(isolation.current_job(), "name", None),
            memory_probe=probe,
        )
        if self.allocator == "waterwave":
            engine.release_listeners.append(self._expect_releases)
        return engine

    def _expect_releases(self, job: str, held: int) -> None:
        """Backward progress, from the engine: jobs still holding activations are
        about to free memory; the allocator's rule f waits for them before failing."""
        from wwrun import allocator

        if held > 0:
            self._expected_releases[job] = held
        else:
            self._expected_releases.pop(job, None)
        allocator.set_expected_releases(dict(self._expected_releases))

    def _prepare_device(self, job: _Job) -> None:
        if self.device != "cuda":
            return
        import torch

        # Each job on its own stream: the legacy default stream would serialize them,
        # and the allocator tells jobs apart by stream.
        stream = torch.cuda.Stream()
        if self.allocator == "waterwave":
            from wwrun import allocator

            capacity = torch.cuda.get_device_properties(stream.device).total_memory
            allocator.register_stream(stream, job.spec.name, resolve_size(job.spec.memory_limit, capacity))
        torch.cuda.set_stream(stream)

    def _release_device(self, job: _Job) -> None:
        if self.allocator == "waterwave":
            from wwrun import allocator

            allocator.unregister_job(job.spec.name)

    # -- bookkeeping ----------------------------------------------------------------

    def _finish(self, job: _Job, code: int, error: str | None) -> None:
        result = job.result
        result.ended = time.time()
        result.exit_code = code
        result.error = error
        if code == 0:
            state = JobState.SUCCEEDED
        elif job.interrupted or code == EXIT_INTERRUPTED and self._interrupted_at is not None:
            state = JobState.INTERRUPTED
        else:
            state = JobState.FAILED
        if code != 0:
            _write_error_json(job, code, error)
        self._set_state(job, state)

    def _set_state(self, job: _Job, state: JobState) -> None:
        job.result.state = state
        self._events.emit(job, state)
        self.display.state(job.result)

    def _result(self) -> RunResult:
        results = [job.result for job in self.jobs]
        for result in results:
            figures = self._allocator_figures(result.name)
            if figures:
                result.extra["peak_memory_bytes"] = figures["peak"]
            if self.engine is not None and result.started is not None:
                result.extra.update(self.engine.job_report(result.name))
        failures = [r for r in results if r.exit_code not in (0, None)]
        failures.sort(key=lambda r: r.ended or float("inf"))
        cancelled = any(r.state == JobState.CANCELLED for r in results)
        root = failures[0] if failures else None
        exit_code = root.exit_code if root else (EXIT_INTERRUPTED if cancelled else 0)
        return RunResult(
            run_id=self.config.run_id, device=self.device, policy=self.policy, jobs=results,
            started=self.started, ended=time.time(), log_dir=str(self.run_dir),
            exit_code=exit_code, root_cause=root.name if root else None,
            extra=self._run_extra(),
        )

    def _run_extra(self) -> dict:
        extra = {"memory_limit_bytes": self.capacity}
        if self.allocator:
            extra["allocator"] = self.allocator
        if self.engine is not None:
            extra.update(self.engine.run_report())
        return extra

    @property
    def concurrency(self) -> int:
        """How many jobs may run at once."""
        if self.policy == "sequential":
            return 1
        return min(self.config.max_concurrent or len(self.jobs), len(self.jobs))

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
        if self.engine is not None:
            return self.engine.memory_of(name)
        figures = self._allocator_figures(name)
        return figures["current"] if figures else None

    def _allocator_figures(self, name: str) -> dict | None:
        if self.allocator != "waterwave":
            return None
        from wwrun import allocator

        try:
            return allocator.job_stats(name)["allocated_bytes"]
        except ValueError:  # not registered yet
            return None

    # -- signals and children -------------------------------------------------------

    def _install_signal_handlers(self) -> Callable[[], None]:
        if threading.current_thread() is not threading.main_thread():
            return lambda: None
        previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
        for sig in previous:
            signal.signal(sig, self._on_signal)

        def restore():
            for sig, handler in previous.items():
                signal.signal(sig, handler)

        return restore

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
            if job.result.state == JobState.RUNNING and job.context and job.context.thread_id:
                job.interrupted = True
                isolation.deliver_signal(job.context, signum)

    def _end_children(self) -> None:
        """End the processes the jobs started (DataLoader workers, spawned children)."""
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


def _child_pids() -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


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
        print(code, file=ctx.stderr)
        return 1, str(code)
    if isinstance(exc, isolation.JobExit):
        return exc.code, None if exc.code == 0 else f"os._exit({exc.code})"
    if isinstance(exc, KeyboardInterrupt):
        ctx.stderr.write("KeyboardInterrupt\n")
        return EXIT_INTERRUPTED, "interrupted"
    ctx.traceback = _script_traceback(exc)
    ctx.stderr.write(ctx.traceback)
    return 1, f"{type(exc).__name__}: {exc}"


def _script_traceback(exc: BaseException) -> str:
    """The traceback Python would print, without wwrun's own frames."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_WWRUN_DIR):
        tb = tb.tb_next
    return "".join(traceback.format_exception(type(exc), exc, tb))


def _join_job_threads(ctx: isolation.JobContext) -> None:
    """As at interpreter exit: wait for the non-daemon threads the job started."""
    for thread in list(ctx.threads):
        if not thread.daemon and thread is not threading.current_thread():
            thread.join()


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
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")


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
