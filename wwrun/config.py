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
import time
import uuid
from dataclasses import dataclass, field

DEVICES = ("auto", "cpu", "cuda")
POLICIES = ("waterwave", "concurrent", "sequential")
QUEUES = ("fifo", "las")
HALTS = ("never", "soon", "now")

# Job names become folder names under the log directory.
_NAME_OK = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._=+,-]*$")

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2,
    "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z%]*)\s*$")


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


def parse_size(text: str | int | float) -> int | float:
    """A memory size: '2GiB' -> 2147483648 bytes, '512MB' -> 512000000 bytes,
    '80%' -> 0.8 (a fraction of the device's memory), 1024 -> 1024 bytes.

    Returns an int for bytes and a float in (0, 1] for a fraction.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a memory size: {text!r}")
    if isinstance(text, int):
        if text <= 0:
            raise ValueError(f"memory size must be positive, got {text}")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a memory size: {text!r} (try '2GiB', '512MB' or '80%')")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "%":
        if not 0 < number <= 100:
            raise ValueError(f"a percentage must be in (0, 100], got {text!r}")
        return number / 100
    if unit not in _UNITS:
        raise ValueError(f"unknown unit {match.group(2)!r} in {text!r}{closest(unit, _UNITS)}")
    size = int(number * _UNITS[unit])
    if size <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return size


_DURATION_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}
_DURATION = re.compile(r"^\s*(?:([0-9]*\.?[0-9]+)\s*([smhd]?)\s*)+$")
_DURATION_PART = re.compile(r"([0-9]*\.?[0-9]+)\s*([smhd]?)")


def parse_duration(text: str | int | float) -> float:
    """Seconds in a duration: '90' or '90s' -> 90.0, '1h30m' -> 5400.0, '2d' -> 172800.0."""
    if isinstance(text, bool):
        raise ValueError(f"not a duration: {text!r}")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        if not _DURATION.match(str(text)):
            raise ValueError(f"not a duration: {text!r} (try '90s', '30m' or '1h30m')")
        seconds = sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(str(text)))
    if not 0 < seconds < float("inf"):
        raise ValueError(f"a duration must be positive, got {text!r}")
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


def new_run_id() -> str:
    """Sortable and unique: 20261121-052811-3fa2."""
    return f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"


@dataclass(kw_only=True, slots=True)
class JobSpec:
    """One job: a script or a module, run as `python script.py args` would run it."""

    name: str
    """Unique within a run; names the job's log folder and prefixes its output."""
    script: str | None = None
    """Path of the training script (absolute once resolved). Exclusive with `module`."""
    module: str | None = None
    """Module run as `python -m module`. Exclusive with `script`."""
    args: list[str] = field(default_factory=list)
    """The script's command-line arguments (its `sys.argv[1:]`)."""
    env: dict[str, str] = field(default_factory=dict)
    """Environment variables set for this job only, over the launcher's."""
    cwd: str | None = None
    """The job's working directory; None means the launcher's."""
    priority: int = 0
    """Higher starts first when not every job can run at once."""
    memory_limit: int | float | None = None
    """Bytes (int) or a fraction of the device (float); beyond it only this job fails."""
    timeout: float | None = None
    """Seconds this job may run (each attempt); then it is interrupted. None: no limit."""
    retries: int | None = None
    """Times a failed job is queued again; None: the run's `retries`."""
    stdin: bool = False
    """This job reads the launcher's standard input (at most one job; a lone job always does)."""

    def __post_init__(self):
        if not isinstance(self.name, str) or not _NAME_OK.match(self.name):
            raise ConfigError(
                "name", f"{self.name!r} is not a valid job name (letters, digits and ._=+,- only)"
            )
        if (self.script is None) == (self.module is None):
            raise ConfigError("script", "give exactly one of 'script' and 'module'")
        if self.script is not None:  # as python does: relative to where it starts
            self.script = os.path.abspath(self.script)
        if not all(isinstance(a, str) for a in self.args):
            raise ConfigError("args", "every argument must be a string")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in self.env.items()):
            raise ConfigError("env", "names and values must be strings")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ConfigError("priority", f"must be an integer, got {self.priority!r}")
        if isinstance(self.memory_limit, str):
            try:
                self.memory_limit = parse_size(self.memory_limit)
            except ValueError as err:
                raise ConfigError("memory_limit", str(err)) from None
        _check_timeout(self)
        if self.retries is not None:
            _check_count("retries", self.retries, minimum=0)
        if not isinstance(self.stdin, bool):
            raise ConfigError("stdin", f"must be true or false, got {self.stdin!r}")

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
    """A run: the jobs and how to run them. Field names match the CLI's flags."""

    jobs: list[JobSpec]
    """The jobs, in the order given."""
    device: str = "auto"
    """auto (CUDA when present, else CPU), cpu or cuda."""
    memory_limit: int | float | None = None
    """Device memory the run may use: bytes (int) or a fraction (float) of the device."""
    policy: str | None = None
    """waterwave, concurrent (plain threads) or sequential; None: waterwave for
    several jobs, concurrent for one."""
    max_concurrent: int | None = None
    """At most this many jobs run at once; the rest wait in the queue."""
    queue: str = "fifo"
    """Order of waiting jobs: fifo, or las (least attained service first)."""
    nodegroups: int | None = None
    """NodeGroups per model (waterwave policy); None chooses automatically."""
    log_dir: str = "wwrun_logs"
    """Logs go to <log_dir>/<run_id>/<job>/{stdout.log,stderr.log,error.json}."""
    tee: bool = False
    """Echo every line of every job to the terminal, prefixed with [name]."""
    report: str | None = None
    """Write the run's JSON report to this file."""
    events: str | None = None
    """Write one JSON line per job state change to this file ('-' for stdout)."""
    quiet: bool = False
    """No live table and no job output on the terminal; the summary only."""
    explain: bool = False
    """Print each job's NodeGroups (modules and bytes) after the run."""
    trace: str | None = None
    """Write a Chrome/Perfetto trace (JSON): NodeGroup spans, waits, memory counters."""
    memory_plot: str | None = None
    """Write a PNG of memory over time per job against the limit (needs matplotlib)."""
    run_id: str = field(default_factory=new_run_id)
    """Names the run's log folder."""
    grace_period_s: float = 10.0
    """After the first Ctrl-C/SIGTERM, how long jobs have to stop."""
    timeout: float | None = None
    """Seconds the whole run may take; then every job is interrupted. None: no limit."""
    retries: int = 0
    """Times a failed job is queued again (a job's own `retries` wins)."""
    halt: str = "never"
    """After a job fails: never (the others go on), soon (start nothing new), now
    (interrupt the running jobs too), as GNU parallel's --halt."""
    source: str | None = None
    """The recipe this config was read from, if any."""

    def __post_init__(self):
        if not self.jobs:
            raise ConfigError("jobs", "no job to run")
        seen: set[str] = set()
        for i, job in enumerate(self.jobs):
            if not isinstance(job, JobSpec):
                raise ConfigError(f"jobs[{i}]", f"expected a JobSpec, got {type(job).__name__}")
            if job.name in seen:
                raise ConfigError(f"jobs[{i}].name", f"duplicate job name {job.name!r}")
            seen.add(job.name)
        _choice("device", self.device, DEVICES)
        if self.policy is not None:
            _choice("policy", self.policy, POLICIES)
        _choice("queue", self.queue, QUEUES)
        if isinstance(self.memory_limit, str):
            try:
                self.memory_limit = parse_size(self.memory_limit)
            except ValueError as err:
                raise ConfigError("memory_limit", str(err)) from None
        for name in ("max_concurrent", "nodegroups"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.grace_period_s < 0:
            raise ConfigError("grace_period_s", "must not be negative")
        _check_timeout(self)
        _check_count("retries", self.retries, minimum=0)
        _choice("halt", self.halt, HALTS)
        if sum(job.stdin for job in self.jobs) > 1:
            raise ConfigError("jobs", "at most one job may read stdin")

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


def preflight(config: LaunchConfig) -> None:
    """The checks that need this machine, not just the config: run before anything
    starts (the CLI calls it before `launch`, and on `--dry-run`), so that a run is
    never refused after its jobs ran. Raises ConfigError.
    """
    _check_observation(config)


def _check_observation(config: LaunchConfig) -> None:
    """--trace, --memory-plot and --explain observe the waterwave engine: refused up
    front where none would run, rather than writing nothing after the run."""
    policy = config.resolved_policy
    for name in ("trace", "memory_plot", "explain"):
        if getattr(config, name) and policy != "waterwave":
            raise ConfigError(name, f"needs the waterwave policy, not {policy} (drop the policy option)")
    if config.memory_plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigError("memory_plot", "needs matplotlib, which is not installed (pip install matplotlib)")


def _choice(name: str, value, choices) -> None:
    if value not in choices:
        raise ConfigError(
            name, f"{value!r} is not one of {', '.join(choices)}{closest(str(value), choices)}"
        )


def _check_count(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")


def _check_timeout(config) -> None:
    """Durations may be given as text ('1h30m'); stored as seconds."""
    if config.timeout is None:
        return
    try:
        config.timeout = parse_duration(config.timeout)
    except ValueError as err:
        raise ConfigError("timeout", str(err)) from None
