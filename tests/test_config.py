"""The config types: validation of every field, sizes, durations and the preflight checks."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

from wwrun.config import (
    MAX_NAME_LENGTH, ConfigError, JobSpec, LaunchConfig, flag_of, name_from, options, parse_duration,
    parse_size, preflight,
)

SCRIPT = str(Path(__file__).resolve())  # any file that exists


def job(name="a", **fields) -> JobSpec:
    return JobSpec(name=name, script=SCRIPT, **fields)


# ----------------------------------------------------------------------------- preflight


@pytest.mark.parametrize("option", ["trace", "memory_plot", "explain"])
def test_observing_a_single_job_runs_the_engine(option):
    value = True if option == "explain" else "out.file"
    config = LaunchConfig(jobs=[job()], **{option: value})
    assert config.resolved_policy == "waterwave"
    assert LaunchConfig(jobs=[job()]).resolved_policy == "concurrent"


@pytest.mark.parametrize("policy", ["concurrent", "sequential"])
def test_observing_without_the_engine_is_refused_up_front(policy):
    config = LaunchConfig(jobs=[job(), job("b")], policy=policy, trace="t.json")
    with pytest.raises(ConfigError, match=f"trace: needs the waterwave policy, not {policy}"):
        preflight(config)


def test_memory_plot_needs_matplotlib(monkeypatch):
    config = LaunchConfig(jobs=[job()], memory_plot="m.png")
    preflight(config)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(ConfigError, match="memory_plot: needs matplotlib"):
        preflight(config)


def test_a_job_memory_limit_on_the_cpu_passes_preflight():
    """wwrun's CPU allocator enforces a job's own limit (tests/test_launcher.py runs one)."""
    preflight(LaunchConfig(jobs=[job(), job("b", memory_limit="1GiB")], device="cpu"))


# ----------------------------------------------------------------------------- sizes


@pytest.mark.parametrize(
    "given, expected",
    [
        ("2GiB", 2 * 1024**3), ("512MB", 512_000_000), ("1.5KiB", 1536), ("80%", 0.8), ("0.8", 0.8),
        ("1024", 1024), (1024, 1024), (0.25, 0.25), (1.0, 1.0), (2e9, 2_000_000_000), ("2.0", 2),
    ],
)
def test_sizes_are_bytes_or_fractions(given, expected):
    size = parse_size(given)
    assert size == expected and type(size) is type(expected)


@pytest.mark.parametrize(
    "given, message",
    [
        (-5, "must be positive"), (0, "must be positive"), (0.0, "neither a fraction"),
        (1.5, "neither a fraction of the device (0 < x <= 1) nor a whole number of bytes"),
        ("1.5", "neither a fraction"), (-0.5, "neither a fraction"), (float("inf"), "neither a fraction"),
        (float("nan"), "neither a fraction"), (True, "not a memory size"), ([1], "not a memory size"),
        ("99999999999999999999999GiB", "more memory than any machine has"),
        ("9" * 400 + "GiB", "more memory than any machine has"), (10**30, "more memory than any machine has"),
        (1e30, "more memory than any machine has"), ("0.5B", "at least one byte"), ("150%", "(0, 100]"),
        ("2 GiBs", "unknown unit"), ("lots", "not a memory size"),
    ],
)
def test_bad_sizes_are_refused(given, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_size(given)
    pattern = "^memory_limit: .*" + re.escape(message)
    with pytest.raises(ConfigError, match=pattern):
        LaunchConfig(jobs=[job()], memory_limit=given)
    with pytest.raises(ConfigError, match=pattern):
        job(memory_limit=given)


def test_launch_config_reads_a_float_above_one_as_bytes():
    assert LaunchConfig(jobs=[job()], memory_limit=2e9).memory_limit == 2_000_000_000
    assert job(memory_limit=0.5).memory_limit == 0.5


def test_durations():
    assert parse_duration("1h30m") == 5400.0 and parse_duration(90) == 90.0
    assert LaunchConfig(jobs=[job()], grace_period_s=0).grace_period_s == 0.0
    for bad in ("soon", -1, 0, "1x", float("inf"), True):
        with pytest.raises(ValueError):
            parse_duration(bad)


# ----------------------------------------------------------------------------- one source of truth


def test_every_field_is_checked_by_its_kind():
    for fields, message in [
        ({"tee": 3}, "tee: expected true or false, got the number 3"),
        ({"max_concurrent": 0}, "max_concurrent: must be at least 1, got 0"),
        ({"retries": -1}, "retries: must be at least 0, got -1"),
        ({"halt": "sooon"}, "halt: 'sooon' is not one of never, soon, now (did you mean 'soon'?)"),
        ({"report": ""}, "report: expected a non-empty string, got an empty string"),
        ({"grace_period_s": "later"}, "grace_period_s: not a duration: 'later'"),
    ]:
        with pytest.raises(ConfigError) as caught:
            LaunchConfig(jobs=[job()], **fields)
        assert str(caught.value).startswith(message), caught.value
    with pytest.raises(ConfigError, match="priority: expected an integer"):
        job(priority="high")
    with pytest.raises(ConfigError, match="stdin: expected true or false"):
        job(stdin="yes")


def test_every_option_has_a_flag_a_recipe_key_and_a_kind():
    from wwrun.cli import get_args_parser
    from wwrun.recipe import JOB_KEYS, OPTION_KEYS

    flags = get_args_parser()._option_string_actions
    names = [f.name for f in options()]
    assert names == list(OPTION_KEYS)
    assert {"timeout", "retries", "halt", "grace_period_s"} <= set(names)
    assert all(flag_of(f) in flags for f in options())
    assert {f.name for f in options(JobSpec)} | {"repeat", "sweep"} == set(JOB_KEYS)
    assert {"run_id", "source", "jobs"}.isdisjoint(names)


def test_job_names():
    assert name_from("train (copy)") == "train__copy_"
    assert name_from("..x") == "x" and name_from("") == "job" and len(name_from("a" * 5000)) < MAX_NAME_LENGTH
    with pytest.raises(ConfigError, match="is longer than 100 characters"):
        job("a" * 101)
    with pytest.raises(ConfigError, match="not a valid job name"):
        job("my job")


def test_a_run_longer_than_the_open_file_limit_is_refused_up_front(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda which: (1000, 1000))
    jobs = [job(f"j{i}") for i in range(200)]
    with pytest.raises(ConfigError, match=r"^jobs: 200 jobs need about \d+ open files and this process may open 1000"):
        preflight(LaunchConfig(jobs=jobs))
    preflight(LaunchConfig(jobs=jobs[:100]))
