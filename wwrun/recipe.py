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

`{key}` in args or name is a sweep value (or the repeat index); `{{key}}` is the
literal text `{key}`. `{job}` in args or cwd is the job's name, filled in when the job
starts (`JobSpec.placed`): `--save {job}.pt` or `cwd: runs/{job}` lets each job of a
sweep write apart. A sweep and a repeat may make at most MAX_JOBS jobs in all,
counted before any is made.

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
import math
import os
import re
import shlex
from pathlib import Path

import yaml

from wwrun.config import (
    JOB_PLACEHOLDER, MAX_JOBS, ConfigError, JobSpec, LaunchConfig, closest, describe, name_from, name_part, parse_size,
    shorten,
)
from wwrun.config import options as options_of

TOP_KEYS = ("defaults", "jobs")
# The options and job keys are the config dataclasses' fields: declared once, there.
OPTION_KEYS = tuple(f.name for f in options_of(LaunchConfig))
JOB_FIELDS = tuple(f.name for f in options_of(JobSpec))
JOB_KEYS = (*JOB_FIELDS, "repeat", "sweep")
SWEEP_KEYS = ("grid", "zip")

# `{key}` fills in a sweep value; any other brace is left as written.
# `{{key}}` is a literal `{key}` (as in Python's format strings): how the dump writes
# an argument that holds one, so that it reads back as written.
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")
_PLACEHOLDER_OR_ESCAPED = re.compile(r"\{\{([A-Za-z_][A-Za-z0-9_]*)\}\}|\{([A-Za-z_][A-Za-z0-9_]*)\}")
_SWEEP_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_JOB = JOB_PLACEHOLDER[1:-1]  # not a sweep key: the job's name (args and cwd), filled at start


def load_recipe(path: str | os.PathLike) -> LaunchConfig:
    """Read, check and expand the recipe at `path`.

    Raises `ConfigError` with a one-line message, `<file>: <key path>: <problem>`.
    """
    label = shorten(os.fspath(path), 200)
    try:
        data = _read_yaml(Path(path))
        return _config_from(data, Path(os.path.abspath(path)))
    except ConfigError as err:
        raise ConfigError(f"{label}: {err.where}" if err.where else label, err.reason) from None


def resolved_options(config: LaunchConfig) -> dict:
    """Every launcher option of `config`, under its recipe key (from the fields'
    metadata), as a recipe writes it: the dump's `defaults:` and the report's `options`."""
    return {f.name: _dump_value(f, getattr(config, f.name)) for f in options_of(LaunchConfig)}


def dump_recipe(config: LaunchConfig) -> str:
    """`config` as recipe text: every launcher option, every job expanded, paths absolute.

    `load_recipe` of this text gives a config equal to `config` apart from `run_id`
    (a new run gets a new one) and `source`.
    """
    import wwrun  # here, not at the top: the package's __init__ may import this module

    options = resolved_options(config)
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
    except ValueError:  # a NUL in the path
        raise ConfigError("", "not a usable path") from None
    try:
        return yaml.load(text, Loader=_RecipeLoader)
    except RecursionError:
        raise ConfigError("", "bad YAML: nested too deeply") from None
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
        for job, origin in _expand_job(entry, where, recipe.parent, room=MAX_JOBS - len(jobs)):
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
        raise (err.within("defaults") if err.where in OPTION_KEYS else err) from None


def _read_options(defaults, where: str) -> dict:
    """The launcher options of `defaults:`; LaunchConfig checks their values."""
    if not isinstance(defaults, dict):
        raise ConfigError(where, f"expected a mapping of launcher options, got {_kind(defaults)}")
    _check_keys(defaults, OPTION_KEYS, where)
    return {key: value for key, value in defaults.items() if value is not None}


def _expand_job(entry, where: str, folder: Path, room: int) -> list[tuple[JobSpec, str]]:
    """The jobs one `jobs:` entry stands for, each with a description of its origin;
    more than `room` is an error, found before any job is made."""
    if not isinstance(entry, dict):
        raise ConfigError(where, f"expected a mapping (script:, args:, ...), got {_kind(entry)}")
    _check_keys(entry, JOB_KEYS, where)
    given = {key: value for key, value in entry.items() if value is not None}

    script, module, default_name = _read_target(given, where, folder)
    cwd = None
    if "cwd" in given:
        cwd = _absolute(folder, _text(given["cwd"], f"{where}.cwd"))
        if JOB_PLACEHOLDER not in cwd and not os.path.isdir(cwd):  # else made at start
            raise ConfigError(f"{where}.cwd", f"no such folder: {shorten(cwd, 200)}")
    template = _scalar(given["name"], f"{where}.name") if "name" in given else default_name
    args = _read_args(given.get("args", []), f"{where}.args")
    env = _read_env(given.get("env", {}), f"{where}.env")
    # The job's other fields, as given: JobSpec checks them.
    fields = {key: given[key] for key in JOB_FIELDS if key in given} | {"cwd": cwd}
    for key in ("name", "script", "module", "args", "env"):
        fields.pop(key, None)
    repeat = _integer(given.get("repeat", 1), f"{where}.repeat")
    grid, zipped = _read_sweep(given.get("sweep"), f"{where}.sweep")
    count = _sweep_size(grid, zipped) * repeat
    if count > room:
        made_of = [f"{len(values)} {key}" for key, values in grid.items()]
        made_of += [f"{len(next(iter(zipped.values())))} zip rows"] if zipped else []
        made_of += [f"repeat {repeat}"] if repeat > 1 else []
        before = f"; {MAX_JOBS - room} come before it" if room < MAX_JOBS else ""
        raise ConfigError(
            where, f"expands into {count} jobs ({' x '.join(made_of)}){before}: one run holds at most {MAX_JOBS}"
        )
    _check_placeholders(template, args, [*grid, *zipped], given.get("sweep"), where)

    expanded = []
    for point in _sweep_points(grid, zipped):
        for index in range(repeat):
            values = {**point, "repeat": str(index)}
            try:
                job = JobSpec(
                    name=_job_name(template, point, index, repeat),
                    script=script, module=module, env=dict(env),
                    args=[_fill(arg, values) for arg in args], **fields,
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
            raise ConfigError(f"{where}.script", f"no such file: {shorten(script, 200)}")
        return script, None, name_from(Path(script).stem)
    module = _text(given["module"], f"{where}.module")  # JobSpec checks it is a module name
    return None, module, name_from(module)


def _job_name(template: str, point: dict[str, str], index: int, repeat: int) -> str:
    """The template's placeholders filled in, or, with none, the template with a
    suffix per sweep value and repeat: mlp-lr0.1-bs32-0."""
    safe = {key: name_part(value) for key, value in point.items()}
    if _placeholders(template):
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


def _read_sweep(sweep, where: str) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """The sweep's grid and zip lists, checked; no sweep is two empty mappings."""
    if sweep is None:
        return {}, {}
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

    return grid, zipped


def _sweep_size(grid: dict[str, list], zipped: dict[str, list]) -> int:
    """How many points the sweep has, counted without making them."""
    rows = len(next(iter(zipped.values()))) if zipped else 1
    return math.prod(len(values) for values in grid.values()) * rows


def _sweep_points(grid: dict[str, list], zipped: dict[str, list]):
    """Every point of the sweep, `{key: value}`: each grid combination with each zip
    row. No sweep is one point with no keys."""
    zip_rows = [dict(zip(zipped, row)) for row in zip(*zipped.values())] if zipped else [{}]
    for combo in itertools.product(*grid.values()):
        for row in zip_rows:
            yield {**dict(zip(grid, combo)), **row}


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
        if key == _JOB:
            raise ConfigError(f"{where}.{key}", f"'{_JOB}' is reserved for the job's name")
        if not isinstance(values, list):
            raise ConfigError(f"{where}.{key}", f"expected a list of values, got {_kind(values)}")
        if not values:
            raise ConfigError(f"{where}.{key}", "empty list: give at least one value")
        result[key] = [_scalar(value, f"{where}.{key}[{i}]") for i, value in enumerate(values)]
    return result


def _check_placeholders(template: str, args: list[str], point: list[str], sweep, where: str) -> None:
    """Every {key} of the name and args has a value, and every sweep key (`point`) is used in args."""
    keys = [*point, "repeat"]
    texts = [(template, f"{where}.name"), *((arg, f"{where}.args[{i}]") for i, arg in enumerate(args))]
    for text, at in texts:
        for key in _placeholders(text):
            if key == _JOB and at != f"{where}.name":
                continue
            if key not in keys:
                known = closest(key, keys) or (
                    f" (the sweep gives {', '.join(point)})" if point else " (this job has no sweep)"
                )
                raise ConfigError(at, f"placeholder {{{key}}} has no sweep value{known}")
    used = {key for arg in args for key in _placeholders(arg)}
    for key in point:
        if key not in used:
            part = "grid" if key in (sweep.get("grid") or {}) else "zip"
            raise ConfigError(
                f"{where}.sweep.{part}.{key}",
                f"no {{{key}}} in args uses this value, so every job would run the same",
            )


def _placeholders(text: str) -> list[str]:
    """The keys of `text`'s placeholders, escaped ones left out."""
    return [match.group(2) for match in _PLACEHOLDER_OR_ESCAPED.finditer(text) if match.group(2)]


def _fill(text: str, values: dict[str, str]) -> str:
    """`text` with its placeholders filled in and `{{key}}` made `{key}`."""
    def one(match: re.Match) -> str:
        if match.group(1):
            return "{" + match.group(1) + "}"
        return match.group(0) if match.group(2) == _JOB else values[match.group(2)]

    return _PLACEHOLDER_OR_ESCAPED.sub(one, text)


def _escape(text: str) -> str:
    """`text` as a recipe argument that `_fill` gives back unchanged (`{job}` stays:
    it is the job's name, filled in only when the job starts)."""
    return _PLACEHOLDER.sub(lambda m: m.group(0) if m.group(1) == _JOB else "{" + m.group(0) + "}", text)


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


_kind = describe


# ----------------------------------------------------------------------------- writing


class _RecipeDumper(yaml.SafeDumper):
    """`yaml.safe_dump`, with each job's arguments on one line, as a command reads."""


def _represent_list(dumper: yaml.SafeDumper, items: list):
    one_line = all(not isinstance(item, (list, dict)) for item in items)
    return dumper.represent_sequence("tag:yaml.org,2002:seq", items, flow_style=one_line)


_RecipeDumper.add_representer(list, _represent_list)


def _dump_value(f, value):
    """A field's value as a recipe writes it: a fraction of the device as a percentage."""
    if f.metadata["kind"] not in ("size", "sizes"):
        return value
    if isinstance(value, list):  # one per engine
        return [_percent(v) if isinstance(v, float) else v for v in value]
    return _percent(value) if isinstance(value, float) else value


def _dump_job(job: JobSpec) -> dict:
    """Every recipe key of the job; paths absolute, so the dump runs from anywhere."""
    fields = {f.name: _dump_value(f, getattr(job, f.name)) for f in options_of(JobSpec)}
    for key in ("script", "cwd"):
        if fields[key] is not None:
            fields[key] = os.path.abspath(fields[key])
    if job.script is not None:
        del fields["module"]
    else:
        del fields["script"]
    fields["args"], fields["env"] = [_escape(arg) for arg in job.args], dict(job.env)
    return fields


def _percent(fraction: float) -> str | float:
    """0.8 -> '80%' when a percentage reads back as exactly `fraction`; some
    fractions have no such percentage (x / 100 rounds), and stay a float."""
    for digits in range(6, 18):
        text = f"{fraction * 100:.{digits}g}%"
        if parse_size(text) == fraction:
            return text
    return fraction
