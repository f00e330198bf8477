"""What to run: the config types shared by the CLI, recipes and the library API.

`JobSpec` is the blueprint of one job (a script or module with its arguments, as
`python` would run it); `LaunchConfig` holds the jobs and the launcher's options.
Both validate themselves on construction and raise `ConfigError`, which names the
field at fault; the CLI turns it into one line on stderr and exit code 2.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import os
import re
import tempfile
import time
import uuid
from dataclasses import dataclass, field

DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("waterwave", "concurrent", "sequential")
QUEUES = ("fifo", "las")
OFFLOAD_MODES = ("never", "auto", "always")
OFFLOAD_HOST_SHARE = 0.5
"""Without --offload-limit, offloaded activations and parked pages may take this
share of the host memory available when the run starts."""
HALTS = ("never", "soon", "now")

# Job names become folder names under the log directory: one rule, used by the CLI
# and recipes to derive names and by JobSpec to check them.
_NAME_CHARS = "A-Za-z0-9._=+,-"
_NAME_OK = re.compile(rf"^[A-Za-z0-9][{_NAME_CHARS}]*$")
_NOT_IN_NAMES = re.compile(rf"[^{_NAME_CHARS}]")
MAX_NAME_LENGTH = 100  # a folder name may hold 255 bytes
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")
_DERIVED_NAME_LENGTH = 64  # a name made from a file's name: room for -2, -lr0.1-0, ...

# What one run may hold. Jobs are threads of one process: past a few thousand the
# process runs out of threads and memory for their stacks long before anything useful.
MAX_JOBS = 10_000
# Jobs running at once when `max_concurrent` is not given (the rest wait for a slot):
# each running job is a thread with its own stack and, under torch, its own OpenMP
# team, and holds 6 file descriptors (two pipes, two logs). 256 stays far below
# Linux's default thread limits; `default_max_concurrent` also keeps to `ulimit -n`.
DEFAULT_MAX_CONCURRENT = 256
# Open files a run holds: a running job six (two pipes, two log files), an ended one
# two until the run ends (its write ends, pointed at /dev/null), and the launcher's own.
FDS_PER_RUNNING_JOB = 6
FDS_PER_ENDED_JOB = 2
_FDS_BASE = 128

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SHARD = re.compile(r"^\s*([0-9]{1,9})\s*/\s*([0-9]{1,9})\s*$")
_GPUS = re.compile(r"^(all|[0-9]{1,4}|[0-9]{1,4}(,[0-9]{1,4})*,?)$")
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z%]*)\s*$")
MAX_SIZE = 2**63 - 1  # bytes: what the allocator and the OS can count


class ConfigError(ValueError):
    """Bad input from the user: a flag, a recipe key, a path.

    `where` names what is at fault ("jobs[1].sweep.grid", "--memory-limit"); the
    message reads `<where>: <what is wrong>`.
    """

    def __init__(self, where: str, message: str):
        self.where = where
        self.reason = message
        super().__init__(f"{where}: {message}" if where else message)

    def within(self, outer: str) -> ConfigError:
        """The same error, its location prefixed with `outer` (a file, a parent key)."""
        if not outer:
            return self
        joiner = "" if self.where.startswith("[") else "."
        where = f"{outer}{joiner}{self.where}" if self.where else outer
        return ConfigError(where, self.reason)


def closest(word: str, choices) -> str:
    """' (did you mean 'x'?)' for a typo of one of `choices`, else ''."""
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


def name_part(text: str) -> str:
    """`text` with every character a job name cannot hold replaced by '_'."""
    return _NOT_IN_NAMES.sub("_", text)


def name_from(text: str) -> str:
    """A valid job name from a script's stem or a module's name."""
    return name_part(text).lstrip("._=+,-")[:_DERIVED_NAME_LENGTH] or "job"


def shorten(text: str, limit: int = 200) -> str:
    """`text` cut to `limit` characters for a message (a 5000-character path stays readable)."""
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def parse_size(text: str | int | float) -> int | float:
    """A memory size: '2GiB' -> 2147483648 bytes, '512MB' -> 512000000 bytes,
    '80%' -> 0.8 and 0.8 -> 0.8 (a fraction of the device's memory), 1024 and 2e9 ->
    bytes. The one place sizes are read, for flags, recipes and the dataclasses.

    Returns an int for bytes and a float in (0, 1] for a fraction; raises ValueError
    for anything else (0, negatives, 1.5: neither a fraction nor whole bytes).
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"not a memory size: {text!r} (try '2GiB', '512MB' or '80%')")
    if isinstance(text, str):
        match = _SIZE.match(text)
        if not match:
            raise ValueError(f"not a memory size: {shorten(repr(text))} (try '2GiB', '512MB' or '80%')")
        number, unit = float(match.group(1)), match.group(2).lower()
        if unit == "%":
            if not 0 < number <= 100:
                raise ValueError(f"a percentage must be in (0, 100], got {text!r}")
            return number / 100
        if unit not in _UNITS:
            raise ValueError(f"unknown unit {match.group(2)!r} in {text!r}{closest(unit, _UNITS)}")
        if unit:
            size = number * _UNITS[unit]
            if size > MAX_SIZE:  # also catches inf, from hundreds of digits
                raise ValueError(f"{shorten(text)} is more memory than any machine has")
            if size < 1:
                raise ValueError(f"memory size must be at least one byte, got {text!r}")
            return int(size)
        text = float(number) if "." in match.group(1) else int(match.group(1))
    if isinstance(text, float):
        if 0 < text <= 1:
            return text
        if not (text.is_integer() and 1 < text):
            raise ValueError(
                f"{text!r} is neither a fraction of the device (0 < x <= 1) nor a whole number of bytes"
            )
        if text > MAX_SIZE:
            raise ValueError(f"{text!r} bytes is more memory than any machine has")
        return int(text)
    if text <= 0:
        raise ValueError(f"memory size must be positive, got {text}")
    if text > MAX_SIZE:
        raise ValueError(f"{shorten(str(text))} bytes is more memory than any machine has")
    return text


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(?:([0-9]*\.?[0-9]+)\s*([smhd]?)\s*)+$")
_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)\s*([smhd]?)")


def parse_duration(text: str | int | float, *, zero: bool = False) -> float:
    """Seconds in a duration: '90' or '90s' -> 90.0, '1h30m' -> 5400.0, '2d' -> 172800.0.
    Positive, or also 0 where `zero`."""
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"not a duration: {text!r} (try '90s', '30m' or '1h30m')")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        if len(text) > 100 or not _DURATION.match(text):
            raise ValueError(f"not a duration: {shorten(repr(text))} (try '90s', '30m' or '1h30m')")
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))
    if not (0 <= seconds if zero else 0 < seconds) or seconds == float("inf") or seconds != seconds:
        raise ValueError(f"a duration must be {'0 or more' if zero else 'positive'}, got {text!r}")
    return seconds


def resolve_size(limit: int | float | None, capacity: int | None) -> int | None:
    """Bytes for a `parse_size` result, fractions taken of `capacity` bytes."""
    if limit is None or isinstance(limit, int):
        return limit
    if capacity is None:
        raise ConfigError("memory_limit", "a percentage needs a device whose capacity is known")
    return int(limit * capacity)


def format_size(nbytes: int | float | None) -> str:
    """1536 -> '1.5KiB'; fractions as percentages; None -> '-'."""
    if nbytes is None:
        return "-"
    if isinstance(nbytes, float) and nbytes <= 1:
        return f"{nbytes * 100:g}%"
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.1f}{unit}"
        value /= 1024
    return f"{value:.1f}TiB"


def default_max_concurrent() -> int:
    """Jobs that may run at once when `max_concurrent` is not given: DEFAULT_MAX_CONCURRENT,
    or fewer where this process's limits on threads or open files are lower."""
    import resource

    limit = DEFAULT_MAX_CONCURRENT
    # A running job's descriptors and room for its own files; threads: its own and its OpenMP team.
    for which, per_job in ((resource.RLIMIT_NOFILE, FDS_PER_RUNNING_JOB + 2), (resource.RLIMIT_NPROC, 4)):
        soft, _ = resource.getrlimit(which)
        if soft != resource.RLIM_INFINITY:
            limit = min(limit, (soft - 64) // per_job)
    return max(1, limit)


def new_run_id() -> str:
    """Sortable and unique: 20261121-052811-3fa2."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


def option(default=dataclasses.MISSING, *, kind: str, help: str, flag: str | None = "", metavar=None,
           choices=None, minimum=None, recipe: bool = True, default_factory=dataclasses.MISSING):
    """A config field with what the CLI, recipes and the dry-run dump need to know of it.

    kind: how a value is read and checked (see `_check_field`); flag: the CLI flag
    ('' derives it from the name, None for none); recipe: whether a recipe may set it.
    """
    metadata = {"kind": kind, "help": help, "flag": flag, "metavar": metavar,
                "choices": choices, "minimum": minimum, "recipe": recipe}
    return field(default=default, default_factory=default_factory, metadata=metadata)


JOB_PLACEHOLDER = "{job}"
"""In a job's args and cwd: the job's name (`JobSpec.placed`)."""


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """One job: a script or a module, run as `python script.py args` would run it."""

    name: str = option(kind="name", help="the job's name")
    """Unique within a run; names the job's log folder and prefixes its output."""
    script: str | None = option(None, kind="text", help="the training script")
    """Path of the training script (absolute once resolved). Exclusive with `module`."""
    module: str | None = option(None, kind="module", help="a module run as python -m")
    """Module run as `python -m module`. Exclusive with `script`."""
    args: list[str] = option(kind="args", help="the script's arguments", default_factory=list)
    """The script's command-line arguments (its `sys.argv[1:]`); `{job}` in them is
    the job's name (`--save {job}.pt`), filled in when it starts."""
    env: dict[str, str] = option(kind="env", help="environment variables", default_factory=dict)
    """Environment variables set for this job only, over the launcher's."""
    cwd: str | None = option(None, kind="text", help="the job's working directory")
    """The job's working directory; None means the launcher's. `{job}` in it is the
    job's name (`runs/{job}`): a folder per job, made when the job starts."""
    priority: int = option(0, kind="count", help="higher starts first")
    """Higher starts first when not every job can run at once."""
    memory_limit: int | float | None = option(None, kind="size", help="device memory this job may use")
    """Bytes (int) or a fraction of the device (float); beyond it only this job fails."""
    memory: int | float | None = option(None, kind="size", help="the job's expected peak memory (a hint)")
    """The job's peak memory, as its author expects it: with several engines (`engines`,
    `gpus`, `ray`), the driver places the job where this much is free, before any run
    of the script measured it. Bytes, or a fraction of an engine's memory."""
    timeout: float | None = option(None, kind="duration", help="how long each attempt may run")
    """Seconds this job may run (each attempt); then it is interrupted. None: no limit."""
    retries: int | None = option(None, kind="count", minimum=0, help="times a failed job is queued again")
    """Times a failed job is queued again; None: the run's `retries`."""
    stdin: bool = option(False, kind="flag", help="this job reads wwrun's standard input")
    """This job reads the launcher's standard input (at most one job; a lone job always does)."""

    def __post_init__(self):
        _check_fields(self)
        if (self.script is None) == (self.module is None):
            raise ConfigError("script", "give exactly one of 'script' and 'module'")
        if self.script is not None:  # as python does: relative to where it starts
            self.script = os.path.abspath(self.script)

    def placed(self) -> JobSpec:
        """This job with `{job}` in its args and cwd replaced by its name: a way for
        each job of a sweep to write apart (as GNU parallel's `{}`)."""
        def fill(text: str) -> str:
            return text.replace(JOB_PLACEHOLDER, self.name)

        return dataclasses.replace(
            self, args=[fill(arg) for arg in self.args], cwd=fill(self.cwd) if self.cwd else None)

    @property
    def argv(self) -> list[str]:
        """`sys.argv` as the job sees it: python sets argv[0] to the script's path,
        or to the module's file for `-m` (filled in at start)."""
        return [self.script if self.script is not None else "-m", *self.args]

    @property
    def command(self) -> str:
        """The equivalent shell command, for display."""
        import shlex

        target = ["-m", self.module] if self.module else [self.script]
        return shlex.join(["python", *target, *self.args])


@dataclass(kw_only=True, slots=True)
class LaunchConfig:
    """A run: the jobs and how to run them.

    Each option's metadata (see `option`) makes its CLI flag, its recipe key under
    `defaults:` and its line in the dry-run dump: the field is the one place an
    option is declared.
    """

    jobs: list[JobSpec]
    """The jobs, in the order given."""
    device: str = option("auto", kind="choice", choices=DEVICES,
                         help="where jobs run (default: auto = cuda when present)")
    """auto (CUDA when present, else CPU), cpu or cuda."""
    memory_limit: int | float | list | None = option(
        None, kind="sizes", metavar="SIZE[,SIZE...]",
        help="device memory the run may use: 2GiB, 512MB, 80%%; with several engines, one for each")
    """Device memory the run may use: bytes (int) or a fraction (float) of the device.
    With several engines, one figure for all, or a list with one per engine (given as
    '64MiB,128MiB' on the command line)."""
    policy: str | None = option(None, kind="choice", choices=POLICIES,
                                help="waterwave (default for several jobs), concurrent or sequential")
    """waterwave, concurrent (plain threads) or sequential; None: waterwave for
    several jobs, concurrent for one."""
    max_concurrent: int | None = option(None, kind="count", minimum=1, metavar="N",
                                        help=f"run at most N jobs at once (default: all, up to {DEFAULT_MAX_CONCURRENT})")
    """At most this many jobs run at once; the rest wait in the queue. None: every
    job, up to DEFAULT_MAX_CONCURRENT (see `concurrency`)."""
    queue: str = option("fifo", kind="choice", choices=QUEUES,
                        help="order of waiting jobs: fifo (default) or las (least attained service)")
    """Order of waiting jobs: fifo, or las (least attained service first)."""
    nodegroups: int | None = option(None, kind="count", minimum=1, metavar="N",
                                    help="NodeGroups per model (default: automatic)")
    """NodeGroups per model (waterwave policy); None chooses automatically."""
    offload: str = option("auto", kind="choice", choices=OFFLOAD_MODES,
                          help="move saved activations to host memory: never, auto (default: a job "
                               "too large for the budget) or always")
    """Activation offload (waterwave policy): never; auto, a job whose iteration cannot
    fit what it can ever have stashes what its forward saves for backward in host
    memory instead of failing; always, every job does."""
    offload_limit: int | float | None = option(
        None, kind="size", metavar="SIZE",
        help=f"host memory offloaded activations and parked pages may take (default: "
             f"{OFFLOAD_HOST_SHARE * 100:.0f}%% of available)")
    """Host bytes (int) or a fraction (float) of the host memory available at start
    that offloaded activations and jobs' pages parked at the limit may take; None:
    OFFLOAD_HOST_SHARE of it."""
    log_dir: str = option("wwrun_logs", kind="text", metavar="DIR", help="where logs go (default: wwrun_logs)")
    """Logs go to <log_dir>/<run_id>/<job>/{stdout.log,stderr.log,error.json}."""
    tee: bool = option(False, kind="flag", help="echo every job line to the terminal")
    """Echo every line of every job to the terminal, prefixed with [name]."""
    report: str | None = option(None, kind="text", metavar="FILE.json", help="write the run's JSON report")
    """Write the run's JSON report to this file."""
    events: str | None = option(None, kind="text", metavar="FILE|-", help="write a JSON line per job state change")
    """Write one JSON line per job state change to this file ('-' for stdout)."""
    quiet: bool = option(False, kind="flag", help="print the summary only")
    """No live table and no job output on the terminal; the summary only."""
    explain: bool = option(False, kind="flag", help="print each job's NodeGroups after the run")
    """Print each job's NodeGroups (modules and bytes) after the run."""
    trace: str | None = option(None, kind="text", metavar="FILE.json",
                               help="write a Chrome/Perfetto trace of NodeGroups, waits and memory")
    """Write a Chrome/Perfetto trace (JSON): NodeGroup spans, waits, memory counters."""
    memory_plot: str | None = option(None, kind="text", metavar="FILE.png",
                                     help="plot memory per job over time against the limit")
    """Write a PNG of memory over time per job against the limit (needs matplotlib)."""
    run_id: str = field(default_factory=new_run_id)
    """Names the run's log folder."""
    grace_period_s: float = option(10.0, kind="seconds", flag="--grace-period", metavar="DURATION",
                                   help="after Ctrl-C, how long jobs have to stop (default: 10s)")
    """After the first Ctrl-C/SIGTERM, how long jobs have to stop."""
    timeout: float | None = option(None, kind="duration", metavar="DURATION",
                                   help="how long the run may take: 90s, 30m, 1h30m")
    """Seconds the whole run may take; then every job is interrupted. None: no limit."""
    retries: int = option(0, kind="count", minimum=0, metavar="N", help="times a failed job is queued again")
    """Times a failed job is queued again (a job's own `retries` wins)."""
    halt: str = option("never", kind="choice", choices=HALTS,
                       help="after a failure: never (go on), soon (start nothing new), now (stop all)")
    """After a job fails: never (the others go on), soon (start nothing new), now
    (interrupt the running jobs too), as GNU parallel's --halt."""
    engines: int | None = option(None, kind="count", minimum=1, metavar="N",
                                 help="run N engine processes (one per GPU; with --device cpu, N CPU engines)")
    """Engine processes, each a whole wwrun engine with its own memory budget; a driver
    places each job on one of them by memory (wwrun.scale). None: one per GPU of
    `gpus` on CUDA, one per `memory_limit` figure on the CPU, else 1."""
    gpus: str | None = option(None, kind="gpus", metavar="all|N|0,2,...",
                              help="GPUs to use, one engine each (default: every GPU this process sees)")
    """'all' (the GPUs CUDA_VISIBLE_DEVICES shows), a count N (the first N) or indices
    '0,2' (one index alone: '3,'). None: all of them."""
    ray: str | None = option(None, kind="address", metavar="ADDRESS",
                             help="engines as Ray actors, on the cluster at ADDRESS (default: a local Ray)")
    """Run each engine as a Ray actor (`pip install 'wwrun[ray]'`): 'local' starts a
    Ray on this machine, 'auto' or 'host:port' joins a cluster."""
    shard: str | None = option(None, kind="shard", metavar="i/n",
                               help="run only the i-th of n slices of the jobs (i from 0): one wwrun per GPU of a batch system")
    """'i/n': only jobs i, i+n, i+2n, ... of the expanded list (i counts from 0, as
    SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX and SKYPILOT_NODE_RANK do). Applied by
    `select_shard` before the run; None runs every job."""
    source: str | None = None
    """The recipe this config was read from, if any."""

    def __post_init__(self):
        if not self.jobs:
            raise ConfigError("jobs", "no job to run")
        if len(self.jobs) > MAX_JOBS:
            raise ConfigError("jobs", f"{len(self.jobs)} jobs; one run holds at most {MAX_JOBS}")
        seen: set[str] = set()
        for i, job in enumerate(self.jobs):
            if not isinstance(job, JobSpec):
                raise ConfigError(f"jobs[{i}]", f"expected a JobSpec, got {type(job).__name__}")
            if job.name in seen:
                raise ConfigError(f"jobs[{i}].name", f"duplicate job name {job.name!r}")
            seen.add(job.name)
        _check_fields(self)
        if sum(job.stdin for job in self.jobs) > 1:
            raise ConfigError("jobs", "at most one job may read stdin")

    @property
    def concurrency(self) -> int:
        """How many jobs may run at once: 1 under the sequential policy, else
        `max_concurrent`, or every job up to `default_max_concurrent()`."""
        if self.resolved_policy == "sequential":
            return 1
        return min(self.max_concurrent or default_max_concurrent(), len(self.jobs))

    @property
    def resolved_policy(self) -> str:
        """waterwave for several jobs, under a memory limit or when the engine is to be
        observed (trace, memory_plot, explain), else concurrent."""
        if self.policy is not None:
            return self.policy
        wants_engine = len(self.jobs) > 1 or self.memory_limit is not None or self.observed
        return "waterwave" if wants_engine else "concurrent"

    @property
    def observed(self) -> bool:
        """An option that only the waterwave engine can honour is given."""
        return bool(self.trace or self.memory_plot or self.explain)

    def replace(self, **changes) -> LaunchConfig:
        return dataclasses.replace(self, **changes)


def parse_shard(text: str) -> tuple[int, int]:
    """'1/4' -> (1, 4): the slice's index, from 0, and how many slices. Raises ValueError."""
    match = _SHARD.match(text) if isinstance(text, str) else None
    if not match:
        raise ValueError(f"expected i/n, as 0/4 (the first of four slices), got {describe(text)}")
    index, count = int(match.group(1)), int(match.group(2))
    if count < 1:
        raise ValueError(f"{text!r}: n must be at least 1")
    if index >= count:
        raise ValueError(f"{text!r}: i counts from 0, so it must be below n (0/{count} to {count - 1}/{count})")
    return index, count


def select_shard(config: LaunchConfig) -> LaunchConfig:
    """The config with only its shard's jobs (jobs i, i+n, ... of the expanded list, so
    that each slice of a grid gets some of every axis) and no `shard` left."""
    if config.shard is None:
        return config
    index, count = parse_shard(config.shard)
    jobs = config.jobs[index::count]
    if not jobs:
        raise ConfigError("shard", f"{config.shard} selects no job: there are {len(config.jobs)} jobs")
    return config.replace(jobs=jobs, shard=None)


def repeat_jobs(jobs: list[JobSpec], times: int) -> list[JobSpec]:
    """Each job `times` times, named as a recipe's `repeat` names them: a-0, a-1, ..."""
    if isinstance(times, bool) or not isinstance(times, int) or times < 1:
        raise ConfigError("repeat", f"must be at least 1, got {times!r}")
    if len(jobs) * times > MAX_JOBS:
        raise ConfigError(
            "repeat", f"{len(jobs)} job(s) {times} times is {len(jobs) * times} jobs; one run holds at most {MAX_JOBS}"
        )
    if times == 1:
        return list(jobs)
    return [
        dataclasses.replace(job, name=f"{job.name}-{i}", args=list(job.args), env=dict(job.env))
        for job in jobs
        for i in range(times)
    ]


def preflight(config: LaunchConfig) -> None:
    """The checks that need this machine, not just the config: run before anything
    starts, so that a run is never refused after its jobs ran. Raises ConfigError.
    `wwrun.launcher.preflight` (what `launch` and the CLI run) adds the checks of the
    scale-out options.
    """
    _check_observation(config)
    _check_log_dir(config.log_dir)
    for name in ("report", "events", "trace", "memory_plot"):
        path = getattr(config, name)
        if path is not None and not (name == "events" and path == "-"):
            _check_output_file(name, path)
    _check_descriptors(config)


def _check_descriptors(config: LaunchConfig) -> None:
    """Refuse up front a run too long for this process's open-file limit, rather
    than fail with EMFILE after thousands of jobs."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    running = min(config.concurrency, len(config.jobs))
    needed = FDS_PER_ENDED_JOB * len(config.jobs) + FDS_PER_RUNNING_JOB * running + _FDS_BASE
    if soft != resource.RLIM_INFINITY and needed > soft:
        most = (soft - _FDS_BASE - FDS_PER_RUNNING_JOB * running) // FDS_PER_ENDED_JOB
        raise ConfigError(
            "jobs", f"{len(config.jobs)} jobs need about {needed} open files and this process may open "
            f"{soft} (ulimit -n): split it into runs of at most {most} jobs, or raise the limit",
        )


def refuse_job_memory_limits(config: LaunchConfig, where: str) -> None:
    """A job's own memory_limit is enforced by wwrun's allocator: a config that has
    one is refused `where` it cannot be, rather than run unlimited."""
    for i, job in enumerate(config.jobs):
        if job.memory_limit is not None:
            raise ConfigError(
                f"jobs[{i}].memory_limit",
                f"job {job.name!r}: a job's memory limit cannot be enforced {where}, only by wwrun's "
                "allocator (drop it, or limit the whole run with memory_limit)",
            )


def _device_of(config: LaunchConfig) -> str:
    """'cpu' or 'cuda', as the launcher will resolve the config's device."""
    if config.device != "auto":
        return config.device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _check_log_dir(log_dir: str) -> None:
    """The log folder exists or can be made, and takes files: tried by making (and
    removing) a folder in it or in its nearest existing parent, which leaves nothing."""
    path = os.path.abspath(log_dir)
    existing = path
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    shown = shorten(log_dir)
    if not os.path.isdir(existing):
        what = "is" if existing == path else f"is under {shorten(existing)}, which is"
        raise ConfigError("log_dir", f"{shown} {what} a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".wwrun-check-", dir=existing))
    except OSError as err:
        raise ConfigError("log_dir", f"cannot write logs in {shown}: {err.strerror}") from None


def _check_output_file(name: str, target: str) -> None:
    """An output written after the run can be written now: its folder exists and
    takes the file (tried by opening it, removed again if it was not there)."""
    path = os.path.abspath(target)
    shown = shorten(target)
    if os.path.isdir(path):
        raise ConfigError(name, f"{shown} is a folder; give a file name")
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        raise ConfigError(name, f"the folder of {shown} does not exist; create it first")
    existed = os.path.lexists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as err:
        raise ConfigError(name, f"cannot write {shown}: {err.strerror}") from None
    if not existed:
        os.unlink(path)


def _check_observation(config: LaunchConfig) -> None:
    """--trace, --memory-plot and --explain observe the waterwave engine: refused up
    front where none would run, rather than writing nothing after the run."""
    policy = config.resolved_policy
    for name in ("trace", "memory_plot", "explain"):
        if getattr(config, name) and policy != "waterwave":
            raise ConfigError(name, f"needs the waterwave policy, not {policy} (drop the policy option)")
    if config.memory_plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("memory_plot", "needs matplotlib, which is not installed (pip install matplotlib)")
    if config.offload == "always" and policy != "waterwave":  # auto, the default, just stays off
        raise ConfigError("offload", f"always needs the waterwave policy (several jobs or a memory limit), "
                                     f"not {policy}")


def options(cls=None) -> list[dataclasses.Field]:
    """The fields of `cls` (LaunchConfig by default) a recipe may set, in order."""
    return [f for f in dataclasses.fields(cls or LaunchConfig) if f.metadata.get("recipe")]


def flag_of(f: dataclasses.Field) -> str | None:
    """The CLI flag of an option: --memory-limit for memory_limit."""
    flag = f.metadata.get("flag", None)
    return "--" + f.name.replace("_", "-") if flag == "" else flag


def describe(value) -> str:
    """A value as a message names it: 'the string 'x'', 'a list', 'the number 3'."""
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"the number {shorten(str(value))}"
    if isinstance(value, str):
        return f"the string {shorten(repr(value))}" if value else "an empty string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _parse_sizes(value):
    """One size, or a list of them ('64MiB,128MiB', or a recipe list): one per engine."""
    if isinstance(value, str) and "," in value:
        value = [part for part in value.split(",")]
    if not isinstance(value, list):
        return parse_size(value)
    if len(value) < 2:
        raise ValueError(f"not a memory size: a list of {len(value)} (give one size alone, or one per engine)")
    return [parse_size(v) for v in value]


def _check_fields(config) -> None:
    """Check and normalise every option field of a JobSpec or LaunchConfig by its kind."""
    for f in dataclasses.fields(config):
        if "kind" in f.metadata:
            value = getattr(config, f.name)
            if value is None and f.default is None:
                continue
            checked = _check_field(f.name, f.metadata, value)
            if checked is not value:
                setattr(config, f.name, checked)


def _check_field(name: str, meta, value):
    kind = meta["kind"]
    try:
        if kind == "size":
            return parse_size(value)
        if kind == "sizes":
            return _parse_sizes(value)
        if kind == "shard":
            parse_shard(value)
            return value.replace(" ", "")
        if kind == "duration":
            return parse_duration(value)
        if kind == "seconds":
            return parse_duration(value, zero=True)
    except ValueError as err:
        raise ConfigError(name, str(err)) from None
    if kind == "choice":
        if value not in meta["choices"]:
            choices = meta["choices"]
            shown = shorten(repr(value))
            raise ConfigError(name, f"{shown} is not one of {', '.join(choices)}{closest(str(value), choices)}")
    elif kind == "count":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(name, f"expected an integer, got {describe(value)}")
        if meta["minimum"] is not None and value < meta["minimum"]:
            raise ConfigError(name, f"must be at least {meta['minimum']}, got {value}")
    elif kind == "flag":
        if not isinstance(value, bool):
            raise ConfigError(name, f"expected true or false, got {describe(value)}")
    elif kind == "text":
        if not isinstance(value, str) or not value:
            raise ConfigError(name, f"expected a non-empty string, got {describe(value)}")
        if "\0" in value:
            raise ConfigError(name, "a path cannot hold a NUL character")
    elif kind == "name":
        if not isinstance(value, str) or not _NAME_OK.match(value):
            raise ConfigError(
                name, f"{shorten(repr(value))} is not a valid job name (letters, digits and ._=+,- only)"
            )
        if len(value) > MAX_NAME_LENGTH:
            raise ConfigError(name, f"{shorten(repr(value))} is longer than {MAX_NAME_LENGTH} characters")
    elif kind == "module":
        if not isinstance(value, str) or not _MODULE.match(value):
            raise ConfigError(name, f"{shorten(repr(value))} is not a module name (like 'pkg.train')")
    elif kind == "gpus":
        if isinstance(value, list) and value and all(isinstance(i, int) and not isinstance(i, bool) for i in value):
            value = ",".join(str(i) for i in value) + ("," if len(value) == 1 else "")
        elif isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not _GPUS.match(value.replace(" ", "")):
            raise ConfigError(name, f"expected all, a count N or indices 0,2,..., got {describe(value)}")
        value = value.replace(" ", "")
        if value == "0":
            raise ConfigError(name, "must be at least 1 GPU (to run on the CPU, use --device cpu)")
    elif kind == "address":
        if value is True:
            value = "local"
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ConfigError(name, f"expected local, auto or a cluster address (host:port), got {describe(value)}")
    elif kind == "args":
        if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
            raise ConfigError(name, "expected a list of strings")
    elif kind == "env":
        if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
            raise ConfigError(name, "names and values must be strings")
    return value
