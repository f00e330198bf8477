"""How jobs and runs end, and where a run writes it down.

`JobState` is where a job is in its life, `JobResult` what one job did, `RunResult`
the whole run; the launcher (one engine, `wwrun.runner`) and the scale-out driver
(`wwrun.scale.driver`) both fill them, and write them the same way: `report.json`
(`write_run_report`), `<job>/error.json` (`write_error_json`), one JSON line per
state change (`EventLog`, `--events`) and the run's folder (`start_run_folder`).
"""

from __future__ import annotations

import datetime
import enum
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from wwrun import isolation

EXIT_INTERRUPTED = 130
EXIT_TIMEOUT = 124  # as GNU timeout
REPORT_EVERY_S = 1.0
"""How often report.json is rewritten while a run goes on."""


class JobState(str, enum.Enum):
    """Where a job is in its life.

    pending -> queued -> running -> succeeded | failed | interrupted
    pending -> running            (a slot was free at once)
    running -> queued -> running  (admission beside the running jobs' memory; a retry)
    running <-> waiting           (its next NodeGroup waits for memory)
    pending | queued -> cancelled (interrupt, --halt or the run's timeout before it started)

    `queued`: waiting for a slot (`max_concurrent`, `sequential`), for admission
    beside the running jobs' memory (the engine says so, or its model turned out not
    to fit beside them: it starts again once one ends), or to be retried; its script
    (attempt) has not started. A wait is a state, not an error: `JobResult.reason`
    says what a queued or waiting job waits for.
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
    reason: str | None = None
    """What a queued or waiting job waits for; None in every other state."""
    extra: dict = field(default_factory=dict)

    def set_state(self, state: JobState, reason: str | None = None) -> None:
        self.state = state
        self.reason = reason if state in (JobState.QUEUED, JobState.WAITING) else None

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
            "started": iso(self.started),
            "wall_s": _round(self.wall_s),
            "error": self.error,
            **({"reason": self.reason} if self.reason else {}),
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
                "started": iso(self.started),
                "wall_s": _round(self.wall_s),
                "exit_code": self.exit_code,
                "root_cause": self.root_cause,
                "log_dir": self.log_dir,
                **self.extra,
                "options": self.options,
            },
            "jobs": [job.to_dict() for job in self.jobs],
        }


def run_exit_code(results: list[JobResult]) -> tuple[int, str | None]:
    """(the run's exit code, its root cause): the code of the earliest failure and its
    job; else, when jobs were only interrupted (Ctrl-C, SIGTERM) or cancelled, 130 and
    no job: none of them caused it, whatever code a script chose on its way out
    (Lightning exits 1 on KeyboardInterrupt) or a cancelled job kept from an attempt
    before it was queued again; else 0."""
    failures = sorted((r for r in results if r.exit_code not in (0, None)), key=lambda r: r.ended or float("inf"))
    caused = [r for r in failures if r.state not in (JobState.INTERRUPTED, JobState.CANCELLED)]
    if caused:
        return caused[0].exit_code, caused[0].name
    stopped = any(r.state in (JobState.INTERRUPTED, JobState.CANCELLED) for r in results)
    return (EXIT_INTERRUPTED if stopped else 0), None


def attempt_folder(folder: Path, attempt: int, retries: int) -> Path:
    """Where attempt `attempt` (from 0) of a job logs: `<job>/attempt_N/` when the job
    may be retried (as torchrun's attempts), else `<job>/`."""
    return folder / f"attempt_{attempt}" if retries else folder


def retry_note(attempts: int, retries: int, out_of_memory: bool) -> str:
    """What a failed job's next attempt is, named as its folder: 'retry 1 of 2, in attempt_1/'."""
    after = ", once memory frees up" if out_of_memory else ""
    return f"retry {attempts} of {retries}, in attempt_{attempts}/{after}"


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


def write_error_json(job, code: int, error: str | None) -> None:
    """<job>/error.json for a failed attempt: its code, error and the script's traceback."""
    if job.result.log_dir is None:
        return
    record = {
        "job": job.spec.name,
        "exit_code": code,
        "error": error,
        "traceback": getattr(job.context, "traceback", None),
        "timestamp": iso(job.result.ended),
    }
    path = Path(job.result.log_dir) / "error.json"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(record, indent=2) + "\n")
    except OSError:  # the log folder went away: the report still says it all
        pass


def start_run_folder(config, run_dir: Path, note: Callable[..., None]) -> None:
    """The run's log folder (`<log_dir>/<run_id>`), made only once jobs start (a refused
    run leaves none): its recipe.yaml, `<log_dir>/latest` pointing at it, and a note
    saying where."""
    from wwrun.recipe import dump_recipe

    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "recipe.yaml").write_text(dump_recipe(config))
    _point_latest(run_dir)
    note(f"run {config.run_id}: logs in {run_dir}", important=False)


def _point_latest(run_dir: Path) -> None:
    """<log_dir>/latest -> the run's folder, replaced atomically."""
    link = run_dir.parent / "latest"
    staged = run_dir.parent / f".latest-{os.getpid()}"
    try:
        staged.unlink(missing_ok=True)
        staged.symlink_to(run_dir.name)
        os.replace(staged, link)
    except OSError:  # a file system without links, or 'latest' is a real folder
        staged.unlink(missing_ok=True)


class EventLog:
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

    def emit(self, job, state: JobState) -> None:
        if self._file is None:
            return
        record = {
            "time": iso(time.time()),
            "run_id": self._run_id,
            "job": job.spec.name,
            "index": job.index,
            "state": state.value,
            "exit_code": job.result.exit_code,
            "attempt": max(job.attempts - 1, 0),  # N of its attempt_N/ folder
        }
        if job.result.reason:
            record["reason"] = job.result.reason
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


def seconds(value: float | None) -> str:
    return f"{value:g}s"


def iso(timestamp: float | None) -> str | None:
    if timestamp is None:
        return None
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).isoformat(timespec="milliseconds")


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 3)
