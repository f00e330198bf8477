"""`wwrun` on the command line: parse, translate into a `LaunchConfig`, call `launch`.

    wwrun [options] script.py [args...] [: script.py [args...]]...
    wwrun [options] -m module [args...] [: -m module [args...]]...
    wwrun [options] recipe.yaml          (or -c recipe.yaml)
    wwrun doctor [--full]                what wwrun will use here, and whether it works

Jobs are separated by ':' (MPI's MPMD convention). Everything after a script's name
belongs to that script, so wwrun's own options come first. Options given here
override a recipe's `defaults:`.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import threading
from pathlib import Path

from wwrun import __version__
from wwrun.config import DEVICES, POLICIES, QUEUES, ConfigError, JobSpec, LaunchConfig, parse_size

_SEPARATOR = ":"
_UNSAFE = re.compile(r"[^A-Za-z0-9._=+,-]")  # job names name log folders


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, as for every bad input
        self.exit(2, f"wwrun: error: {message} (see wwrun --help)\n")


def get_args_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="wwrun",
        description="Train several unmodified PyTorch scripts at once, as threads of one process.",
        usage="wwrun [options] (script.py | -m module) [args...] [: ...] | wwrun [options] recipe.yaml",
    )
    add = parser.add_argument
    add("--device", choices=DEVICES, help="where jobs run (default: auto = cuda when present)")
    add("--memory-limit", metavar="SIZE", help="device memory the run may use: 2GiB, 512MB, 80%%")
    add("--policy", choices=POLICIES, help="waterwave (default for several jobs), concurrent or sequential")
    add("--max-concurrent", type=int, metavar="N", help="run at most N jobs at once")
    add("--queue", choices=QUEUES, help="order of waiting jobs: fifo (default) or las (least attained service)")
    add("--nodegroups", type=int, metavar="N", help="NodeGroups per model (default: automatic)")
    add("--log-dir", metavar="DIR", help="where logs go (default: wwrun_logs)")
    add("--tee", action="store_const", const=True, help="echo every job line to the terminal")
    add("--report", metavar="FILE.json", help="write the run's JSON report")
    add("--events", metavar="FILE|-", help="write a JSON line per job state change")
    add("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace of NodeGroups, waits and memory")
    add("--memory-plot", metavar="FILE.png", help="plot memory per job over time against the limit")
    add("--explain", action="store_const", const=True, help="print each job's NodeGroups after the run")
    add("--dry-run", action="store_true", help="print the resolved jobs as a recipe and run nothing")
    add("--quiet", action="store_const", const=True, help="print the summary only")
    add("--version", action="version", version=f"wwrun {__version__}")
    add("-c", "--recipe", metavar="FILE", help="read jobs and defaults from a YAML recipe")
    add("-m", "--module", action="store_true", help="the first job is a module, as with python -m")
    add("command", nargs=argparse.REMAINDER, help="jobs, separated by ':'")
    return parser


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Translate parsed arguments into a LaunchConfig (raises ConfigError)."""
    from wwrun.recipe import load_recipe

    command = list(args.command)
    recipe = args.recipe
    if recipe is None and len(command) == 1 and command[0].endswith((".yaml", ".yml")) and not args.module:
        recipe = command.pop()
    options = _options(args)
    if recipe is not None:
        if command:
            raise ConfigError("", "give either a recipe or scripts, not both")
        return load_recipe(recipe).replace(**options)
    if not command:
        raise ConfigError("", "no job given: wwrun script.py [args...] [: script.py ...] or wwrun recipe.yaml")
    return LaunchConfig(jobs=_jobs(command, first_is_module=args.module), **options)


def _options(args: argparse.Namespace) -> dict:
    options = {
        "device": args.device,
        "memory_limit": args.memory_limit,
        "policy": args.policy,
        "max_concurrent": args.max_concurrent,
        "queue": args.queue,
        "nodegroups": args.nodegroups,
        "log_dir": args.log_dir,
        "tee": args.tee,
        "report": args.report,
        "events": args.events,
        "quiet": args.quiet,
        "explain": args.explain,
        "trace": args.trace,
        "memory_plot": args.memory_plot,
    }
    if args.memory_limit is not None:
        try:
            options["memory_limit"] = parse_size(args.memory_limit)
        except ValueError as err:
            raise ConfigError("--memory-limit", str(err)) from None
    # Only what was given overrides a recipe's defaults.
    return {key: value for key, value in options.items() if value is not None}


def _jobs(command: list[str], first_is_module: bool) -> list[JobSpec]:
    segments: list[list[str]] = [[]]
    for token in command:
        if token == _SEPARATOR:
            segments.append([])
        else:
            segments[-1].append(token)
    jobs, used = [], set()
    for i, segment in enumerate(segments):
        where = f"job {i + 1}"
        is_module = first_is_module if i == 0 else bool(segment) and segment[0] == "-m"
        if i > 0 and is_module:
            segment = segment[1:]
        if not segment:
            raise ConfigError(where, "empty: expected a script or -m module between ':'")
        target, args = segment[0], segment[1:]
        if is_module:
            spec = {"module": target}
            base = target
        else:
            path = Path(target)
            if not path.is_file():
                raise ConfigError(where, f"no such script: {target}")
            spec = {"script": str(path.resolve())}
            base = path.stem
        name = _unique(base, used)
        try:
            jobs.append(JobSpec(name=name, args=args, **spec))
        except ConfigError as err:
            raise err.within(where) from None
    return jobs


def _unique(base: str, used: set[str]) -> str:
    """A valid job name from a script's stem or a module: unsafe characters become '_'."""
    base = _UNSAFE.sub("_", base).lstrip("._=+,-") or "job"
    name, n = base, 1
    while name in used:
        n += 1
        name = f"{base}-{n}"
    used.add(name)
    return name


def _show(argv: list[str]) -> int:
    """`wwrun show [RUN] [--log-dir DIR]`: a past run's summary (the latest by default)."""
    from wwrun.output import show_run

    parser = _Parser(prog="wwrun show", description="Print a past run's summary.")
    parser.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")
    parser.add_argument("--log-dir", default="wwrun_logs", metavar="DIR", help="where logs go")
    args = parser.parse_args(argv)
    return show_run(args.run, log_root=args.log_dir)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        from wwrun import doctor

        return doctor.main(argv[1:])
    from wwrun.launcher import EXIT_INTERRUPTED, launch
    from wwrun.recipe import dump_recipe

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["show"] and not os.path.isfile("show"):
        return _show(argv[1:])
    args = get_args_parser().parse_args(argv)
    try:
        config = config_from_args(args)
        if args.dry_run:
            sys.stdout.write(dump_recipe(config))
            return 0
        result = launch(config)
    except ConfigError as err:
        print(f"wwrun: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C outside the run (start-up, summary)
        return EXIT_INTERRUPTED
    if any(t.name.startswith("wwrun:") and t.is_alive() for t in threading.enumerate()):
        # A job ignored the interrupt past its grace period: threads cannot be killed,
        # the process can.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result.exit_code)
    return result.exit_code
