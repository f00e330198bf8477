"""Recipes: a YAML file of jobs and launcher options, read into a `LaunchConfig`.

    defaults:                       # launcher options: LaunchConfig fields, as the CLI flags
      policy: concurrent
    jobs:
      - script: examples/mlp.py     # relative to the recipe's folder
        name: mlp-lr{lr}            # optional; default: the script's stem
        args: --steps 200 --lr {lr} # a list, or one string split as a shell would
        env: {OMP_NUM_THREADS: 1}
        sweep:
          grid: {lr: [0.1, 0.01]}   # every combination of the lists
          zip: {seed: [0, 1]}       # lists of equal length, taken pairwise
        repeat: 2                   # each point twice; {repeat} is 0, then 1

One entry expands into one job per sweep point and repeat. `load_recipe` checks
everything before anything runs; each problem is one `ConfigError` line naming the
file, the key path and, for a typo, the closest valid key:

    recipes/x.yaml: jobs[1].sweep.grd: unknown key (did you mean 'grid'?)

`dump_recipe` writes a config back as a recipe with every job expanded and every
path absolute; the launcher keeps it as `<log_dir>/<run_id>/recipe.yaml`, so a run
can be repeated exactly with `wwrun <log_dir>/<run_id>/recipe.yaml`.

References: Hydra's multirun sweeps and Ray Tune's `grid_search` (a grid is the
cartesian product of its lists); torchtune's YAML recipes (one file, checked before
anything starts).
"""

from __future__ import annotations

import itertools
import os
import re
import shlex
from pathlib import Path

import yaml

from wwrun.config import ConfigError, JobSpec, LaunchConfig, closest, parse_size

TOP_KEYS = ("defaults", "jobs")
OPTION_KEYS = (
    "device", "memory_limit", "policy", "max_concurrent", "queue", "nodegroups",
    "log_dir", "tee", "report", "events", "quiet", "explain", "trace", "memory_plot",
)
JOB_KEYS = (
    "name", "script", "module", "args", "env", "cwd", "priority", "memory_limit",
    "stdin", "repeat", "sweep",
)
SWEEP_KEYS = ("grid", "zip")

# `{key}` fills in a sweep value; any other brace is left as written.
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SWEEP_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# Characters JobSpec refuses in a name (it names a log folder).
_NOT_IN_NAMES = re.compile(r"[^A-Za-z0-9._=+,-]")
_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def load_recipe(path: str | os.PathLike) -> LaunchConfig:
    """Read, check and expand the recipe at `path`.

    Raises `ConfigError` with a one-line message, `<file>: <key path>: <problem>`.
    """
    label = os.fspath(path)
    try:
        data = _read_yaml(Path(path))
        return _config_from(data, Path(os.path.abspath(path)))
    except ConfigError as err:
        raise ConfigError(f"{label}: {err.where}" if err.where else label, err.reason) from None


def dump_recipe(config: LaunchConfig) -> str:
    """`config` as recipe text: every launcher option, every job expanded, paths absolute.

    `load_recipe` of this text gives a config equal to `config` apart from `run_id`
    (a new run gets a new one) and `source`.
    """
    import wwrun  # here, not at the top: the package's __init__ may import this module

    options = {key: _dump_option(getattr(config, key)) for key in OPTION_KEYS}
    jobs = [_dump_job(job) for job in config.jobs]
    origin = f" from {config.source}" if config.source else ""
    header = (
        f"# Resolved by wwrun {wwrun.__version__} for run {config.run_id}{origin}.\n"
        "# Every job is expanded and every path absolute: `wwrun <this file>` runs them again.\n"
    )
    body = yaml.dump(
        {"defaults": options, "jobs": jobs},
        Dumper=_RecipeDumper, sort_keys=False, allow_unicode=True, width=4096,
    )
    return header + body


# ----------------------------------------------------------------------------- reading


class _RecipeLoader(yaml.SafeLoader):
    """`yaml.safe_load`'s loader, except that a key given twice is an error: plain
    YAML keeps the last one silently, hiding e.g. a second `args:`."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key_node.value!r}", key_node.start_mark
                    )
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def _read_yaml(path: Path):
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError("", "no such recipe file") from None
    except IsADirectoryError:
        raise ConfigError("", "is a folder, not a recipe file") from None
    except UnicodeDecodeError:
        raise ConfigError("", "not a text file (expected UTF-8 YAML)") from None
    except OSError as err:
        raise ConfigError("", f"cannot read: {err.strerror}") from None
    try:
        return yaml.load(text, Loader=_RecipeLoader)
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = " ".join(str(err.problem or err.context or "unreadable").split())
        raise ConfigError(where, f"bad YAML: {problem}") from None
    except yaml.YAMLError as err:
        raise ConfigError("", f"bad YAML: {' '.join(str(err).split())}") from None


def _config_from(data, recipe: Path) -> LaunchConfig:
    if data is None:
        raise ConfigError("", "empty recipe (expected 'jobs:' and optionally 'defaults:')")
    if not isinstance(data, dict):
        raise ConfigError(
            "", f"expected a mapping with 'jobs:' and optionally 'defaults:', got {_kind(data)}"
        )
    _check_keys(data, TOP_KEYS, "")
    options = _read_options(_given(data, "defaults", {}), "defaults")

    entries = _given(data, "jobs", None)
    if entries is None:
        raise ConfigError("jobs", "missing: a recipe needs a list of jobs")
    if not isinstance(entries, list):
        raise ConfigError("jobs", f"expected a list of jobs, got {_kind(entries)}")
    if not entries:
        raise ConfigError("jobs", "empty list: a recipe needs at least one job")

    jobs: list[JobSpec] = []
    origin_of: dict[str, str] = {}  # job name -> which entry (and sweep point) made it
    for index, entry in enumerate(entries):
        where = f"jobs[{index}]"
        for job, origin in _expand_job(entry, where, recipe.parent):
            if job.name in origin_of:
                same_entry = origin_of[job.name].startswith(f"{where} ")
                hint = (
                    "put every sweep key (and {repeat}) in the name template"
                    if same_entry else "give one of them another 'name'"
                )
                raise ConfigError(
                    f"{where}.name",
                    f"{origin} and {origin_of[job.name]} are both named {job.name!r}; {hint}",
                )
            origin_of[job.name] = origin
            jobs.append(job)
    try:
        return LaunchConfig(jobs=jobs, source=str(recipe), **options)
    except ConfigError as err:
        raise err.within("defaults") from None


def _read_options(defaults, where: str) -> dict:
    """The launcher options of `defaults:`, type-checked; LaunchConfig checks values."""
    if not isinstance(defaults, dict):
        raise ConfigError(where, f"expected a mapping of launcher options, got {_kind(defaults)}")
    _check_keys(defaults, OPTION_KEYS, where)
    checks = {
        "device": _text, "policy": _text, "queue": _text, "log_dir": _text,
        "report": _text, "events": _text, "trace": _text, "memory_plot": _text, "memory_limit": _size,
        "max_concurrent": _integer, "nodegroups": _integer, "tee": _boolean, "quiet": _boolean,
        "explain": _boolean,
    }
    return {
        key: checks[key](value, f"{where}.{key}")
        for key, value in defaults.items()
        if value is not None
    }


def _expand_job(entry, where: str, folder: Path) -> list[tuple[JobSpec, str]]:
    """The jobs one `jobs:` entry stands for, each with a description of its origin."""
    if not isinstance(entry, dict):
        raise ConfigError(where, f"expected a mapping (script:, args:, ...), got {_kind(entry)}")
    _check_keys(entry, JOB_KEYS, where)
    given = {key: value for key, value in entry.items() if value is not None}

    script, module, default_name = _read_target(given, where, folder)
    cwd = None
    if "cwd" in given:
        cwd = _absolute(folder, _text(given["cwd"], f"{where}.cwd"))
        if not os.path.isdir(cwd):
            raise ConfigError(f"{where}.cwd", f"no such folder: {cwd}")
    template = _scalar(given["name"], f"{where}.name") if "name" in given else default_name
    args = _read_args(given.get("args", []), f"{where}.args")
    env = _read_env(given.get("env", {}), f"{where}.env")
    priority = _integer(given.get("priority", 0), f"{where}.priority", minimum=None)
    memory_limit = (
        _size(given["memory_limit"], f"{where}.memory_limit") if "memory_limit" in given else None
    )
    stdin = _boolean(given.get("stdin", False), f"{where}.stdin")
    repeat = _integer(given.get("repeat", 1), f"{where}.repeat")
    points = _read_sweep(given.get("sweep"), f"{where}.sweep")
    _check_placeholders(template, args, points[0], given.get("sweep"), where)

    expanded = []
    for point in points:
        for index in range(repeat):
            values = {**point, "repeat": str(index)}
            try:
                job = JobSpec(
                    name=_job_name(template, point, index, repeat),
                    script=script, module=module, cwd=cwd, env=dict(env),
                    args=[_fill(arg, values) for arg in args],
                    priority=priority, memory_limit=memory_limit, stdin=stdin,
                )
            except ConfigError as err:
                raise err.within(where) from None
            shown = [f"{key}={value}" for key, value in point.items()]
            shown += [f"repeat={index}"] if repeat > 1 else []
            expanded.append((job, f"{where} ({', '.join(shown)})" if shown else where))
    return expanded


def _read_target(given: dict, where: str, folder: Path) -> tuple[str | None, str | None, str]:
    """(script, module, default name) of a job: the script's absolute path and stem,
    or the module's name."""
    if ("script" in given) == ("module" in given):
        raise ConfigError(where, "give exactly one of 'script' and 'module'")
    if "script" in given:
        script = _absolute(folder, _text(given["script"], f"{where}.script"))
        if not os.path.isfile(script):
            raise ConfigError(f"{where}.script", f"no such file: {script}")
        return script, None, _NOT_IN_NAMES.sub("_", Path(script).stem)
    module = _text(given["module"], f"{where}.module")
    if not _MODULE.match(module):
        raise ConfigError(f"{where}.module", f"{module!r} is not a module name (like 'pkg.train')")
    return None, module, module


def _job_name(template: str, point: dict[str, str], index: int, repeat: int) -> str:
    """The template's placeholders filled in, or, with none, the template with a
    suffix per sweep value and repeat: mlp-lr0.1-bs32-0."""
    safe = {key: _NOT_IN_NAMES.sub("_", value) for key, value in point.items()}
    if _PLACEHOLDER.search(template):
        return _fill(template, {**safe, "repeat": str(index)})
    parts = [f"{key}{value}" for key, value in safe.items()]
    parts += [str(index)] if repeat > 1 else []
    return "-".join([template, *parts])


def _read_args(args, where: str) -> list[str]:
    if isinstance(args, str):
        try:
            return shlex.split(args)
        except ValueError as err:
            raise ConfigError(where, f"cannot split like a shell: {err}") from None
    if not isinstance(args, list):
        raise ConfigError(where, f"expected a list or a string, got {_kind(args)}")
    return [_scalar(arg, f"{where}[{i}]") for i, arg in enumerate(args)]


def _read_env(env, where: str) -> dict[str, str]:
    if not isinstance(env, dict):
        raise ConfigError(where, f"expected a mapping of variable names to values, got {_kind(env)}")
    for name in env:
        if not isinstance(name, str) or not name or "=" in name:
            raise ConfigError(where, f"{name!r} is not a variable name")
    return {name: _scalar(value, f"{where}.{name}") for name, value in env.items()}


def _read_sweep(sweep, where: str) -> list[dict[str, str]]:
    """Every point of the sweep, `{key: value}`: each grid combination with each zip row.

    No sweep is one point with no keys.
    """
    if sweep is None:
        return [{}]
    if not isinstance(sweep, dict):
        raise ConfigError(where, f"expected a mapping with 'grid:' and/or 'zip:', got {_kind(sweep)}")
    _check_keys(sweep, SWEEP_KEYS, where)
    grid = _sweep_lists(sweep.get("grid"), f"{where}.grid")
    zipped = _sweep_lists(sweep.get("zip"), f"{where}.zip")
    if not grid and not zipped:
        raise ConfigError(where, "empty: give 'grid:' and/or 'zip:'")
    for key in zipped:
        if key in grid:
            raise ConfigError(f"{where}.zip.{key}", "also a grid key; give each key once")
    if len({len(values) for values in zipped.values()}) > 1:
        lengths = ", ".join(f"{key} has {len(values)}" for key, values in zipped.items())
        raise ConfigError(f"{where}.zip", f"lists of unequal lengths ({lengths}); zip pairs them up")

    grid_points = [dict(zip(grid, combo)) for combo in itertools.product(*grid.values())]
    zip_rows = [dict(zip(zipped, row)) for row in zip(*zipped.values())] if zipped else [{}]
    return [{**point, **row} for point in grid_points for row in zip_rows]


def _sweep_lists(lists, where: str) -> dict[str, list[str]]:
    if lists is None:
        return {}
    if not isinstance(lists, dict):
        raise ConfigError(where, f"expected a mapping of key -> list of values, got {_kind(lists)}")
    if not lists:
        raise ConfigError(where, "empty mapping: give at least one key and its list of values")
    result = {}
    for key, values in lists.items():
        if not isinstance(key, str) or not _SWEEP_KEY.match(key):
            raise ConfigError(where, f"{key!r} is not a usable key (letters, digits and _, as in {{lr}})")
        if key == "repeat":
            raise ConfigError(f"{where}.{key}", "'repeat' is reserved for the repeat index")
        if not isinstance(values, list):
            raise ConfigError(f"{where}.{key}", f"expected a list of values, got {_kind(values)}")
        if not values:
            raise ConfigError(f"{where}.{key}", "empty list: give at least one value")
        result[key] = [_scalar(value, f"{where}.{key}[{i}]") for i, value in enumerate(values)]
    return result


def _check_placeholders(template: str, args: list[str], point: dict, sweep, where: str) -> None:
    """Every {key} of the name and args has a value, and every sweep key is used in args."""
    keys = [*point, "repeat"]
    texts = [(template, f"{where}.name"), *((arg, f"{where}.args[{i}]") for i, arg in enumerate(args))]
    for text, at in texts:
        for key in _PLACEHOLDER.findall(text):
            if key not in keys:
                known = closest(key, keys) or (
                    f" (the sweep gives {', '.join(point)})" if point else " (this job has no sweep)"
                )
                raise ConfigError(at, f"placeholder {{{key}}} has no sweep value{known}")
    used = {key for arg in args for key in _PLACEHOLDER.findall(arg)}
    for key in point:
        if key not in used:
            part = "grid" if key in (sweep.get("grid") or {}) else "zip"
            raise ConfigError(
                f"{where}.sweep.{part}.{key}",
                f"no {{{key}}} in args uses this value, so every job would run the same",
            )


def _fill(text: str, values: dict[str, str]) -> str:
    return _PLACEHOLDER.sub(lambda match: values[match.group(1)], text)


def _check_keys(mapping: dict, valid: tuple[str, ...], where: str) -> None:
    for key in mapping:
        if key not in valid:
            path = f"{where}.{key}" if where else str(key)
            raise ConfigError(path, f"unknown key{closest(str(key), valid)}")


def _given(mapping: dict, key: str, default):
    value = mapping.get(key)
    return default if value is None else value


def _absolute(folder: Path, path: str) -> str:
    return os.path.normpath(os.path.join(folder, os.path.expanduser(path)))


# Value checks: each returns the value, or raises ConfigError naming `where`.


def _text(value, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(where, f"expected a non-empty string, got {_kind(value)}")
    return value


def _scalar(value, where: str) -> str:
    """A YAML scalar as the text a command line or an environment would hold."""
    if isinstance(value, bool):  # before int: bool is an int
        return "true" if value else "false"
    if isinstance(value, (str, int, float)):
        return str(value)
    raise ConfigError(where, f"expected a string or a number, got {_kind(value)}")


def _integer(value, where: str, minimum: int | None = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(where, f"expected an integer, got {_kind(value)}")
    if minimum is not None and value < minimum:
        raise ConfigError(where, f"must be at least {minimum}, got {value}")
    return value


def _boolean(value, where: str) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(where, f"expected true or false, got {_kind(value)}")
    return value


def _size(value, where: str) -> int | float:
    """A `parse_size` text or byte count, or a fraction of the device like 0.8."""
    if isinstance(value, float) and 0 < value <= 1:
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigError(
            where, f"expected a size like '2GiB', '512MB', '80%' or 0.8, got {_kind(value)}"
        )
    try:
        return parse_size(value)
    except ValueError as err:
        raise ConfigError(where, str(err)) from None


def _kind(value) -> str:
    if value is None:
        return "nothing (null)"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return f"the number {value}"
    if isinstance(value, str):
        return f"the string {value!r}" if value else "an empty string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


# ----------------------------------------------------------------------------- writing


class _RecipeDumper(yaml.SafeDumper):
    """`yaml.safe_dump`, with each job's arguments on one line, as a command reads."""


def _represent_list(dumper: yaml.SafeDumper, items: list):
    one_line = all(not isinstance(item, (list, dict)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=one_line)


_RecipeDumper.add_representer(list, _represent_list)


def _dump_option(value):
    return _percent(value) if isinstance(value, float) else value


def _dump_job(job: JobSpec) -> dict:
    if job.script is not None:
        target = {"script": os.path.abspath(job.script)}
    else:
        target = {"module": job.module}
    return {
        "name": job.name,
        **target,
        "args": list(job.args),
        "env": dict(job.env),
        "cwd": os.path.abspath(job.cwd) if job.cwd is not None else None,
        "priority": job.priority,
        "memory_limit": _dump_option(job.memory_limit),
        **({"stdin": True} if job.stdin else {}),
    }


def _percent(fraction: float) -> str | float:
    """0.8 -> '80%' when a percentage reads back as exactly `fraction`; some
    fractions have no such percentage (x / 100 rounds), and stay a float."""
    for digits in range(6, 18):
        text = f"{fraction * 100:.{digits}g}%"
        if parse_size(text) == fraction:
            return text
    return fraction
