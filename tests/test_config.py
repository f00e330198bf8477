"""The config types: validation of every field, sizes, durations and the preflight checks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from wwrun.config import ConfigError, JobSpec, LaunchConfig, preflight

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
