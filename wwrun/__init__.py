"""wwrun: train several unmodified PyTorch scripts at once, as threads of one process.

An implementation of Waterwave ("Waterwave: A GPU Memory Flow Engine for Concurrent
DNN Training", IEEE Transactions on Computers 72(10), 2023).

    import wwrun
    result = wwrun.launch(wwrun.LaunchConfig(jobs=[wwrun.JobSpec(name="a", script="a.py")]))
    result.exit_code
"""

__version__ = "0.1.0"

from wwrun.config import ConfigError, JobSpec, LaunchConfig, parse_size  # noqa: E402
from wwrun.launcher import JobResult, JobState, RunResult, launch  # noqa: E402
from wwrun.recipe import dump_recipe, load_recipe  # noqa: E402

__all__ = [
    "ConfigError",
    "Engine",
    "JobResult",
    "JobSpec",
    "JobState",
    "JobTooLarge",
    "LaunchConfig",
    "RunResult",
    "__version__",
    "dump_recipe",
    "launch",
    "load_recipe",
    "parse_size",
]


def __getattr__(name):
    # The engine imports torch: load it only when asked, so `wwrun --help` stays instant.
    if name in ("Engine", "JobTooLarge"):
        from wwrun import engine

        return getattr(engine, name)
    raise AttributeError(f"module 'wwrun' has no attribute {name!r}")
