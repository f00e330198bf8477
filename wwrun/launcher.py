"""`launch(config) -> RunResult`: the library's entry point. It checks the config
against this machine (`preflight`), then runs the jobs on this device as threads of
this process (`wwrun.runner.Runner`), or, when the config asks for several engines,
through the scale-out driver (`wwrun.scale`), each engine a process or Ray actor
that runs its own Runner.

Imports run one way: the CLI -> launcher -> scale -> runner -> config.
"""

from __future__ import annotations

from wwrun import config as _config
from wwrun import isolation, libstate, rng, scale
from wwrun.config import LaunchConfig, select_shard
from wwrun.result import EXIT_INTERRUPTED, EXIT_TIMEOUT, JobResult, JobState, RunResult  # noqa: F401 - their old home
from wwrun.runner import Runner

__all__ = ["EXIT_INTERRUPTED", "EXIT_TIMEOUT", "JobResult", "JobState", "RunResult", "launch", "preflight"]


def preflight(config: LaunchConfig) -> None:
    """Every check that can be made before anything starts: the config's against this
    machine (`wwrun.config.preflight`) and, when it asks for several engines, those
    of the scale-out options (`wwrun.scale.preflight`). Run by `launch` and by the
    CLI (also on --dry-run), so that a run is never refused after its jobs ran.
    Raises ConfigError."""
    _config.preflight(config)
    if scale.asked_for(config):
        scale.preflight(config)


def launch(config: LaunchConfig, *, display=None) -> RunResult:
    """Run the config's jobs concurrently and wait for them.

    `display` receives job lines and state changes; by default one is chosen from the
    config (`quiet`, `tee`) and whether stdout is a terminal.
    """
    from wwrun.display import make_display

    config = select_shard(config)
    preflight(config)
    display = display or make_display(config)
    if scale.needs_driver(config):  # several engines: each its own process (wwrun.scale)
        return scale.launch(config, display=display)
    isolation.install()
    libstate.install()
    rng.install()
    return Runner(config, display).run()
