"""wwrun: train several unmodified PyTorch scripts at once, as threads of one process.

An implementation of Waterwave ("Waterwave: A GPU Memory Flow Engine for Concurrent
DNN Training", IEEE Transactions on Computers 72(10), 2023).

    import wwrun
    result = wwrun.launch(wwrun.LaunchConfig(jobs=[wwrun.JobSpec(name="a", script="a.py")]))
    result.exit_code
"""

__version__ = "0.1.0"

from wwrun.config import ConfigError, JobSpec, LaunchConfig, parse_size  # noqa: E402

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


_LAZY = {
    "Engine": "memory.engine", "JobTooLarge": "memory.engine",
    "JobResult": "result", "JobState": "result", "RunResult": "result", "launch": "launcher",
    "dump_recipe": "recipe", "load_recipe": "recipe",
}


def __getattr__(name):
    # Loaded when asked: the engine imports torch, recipes need yaml, and every run
    # pays for what `import wwrun` loads (benchmarks/launcher_overhead.py).
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"wwrun.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'wwrun' has no attribute {name!r}")
