"""`wwrun` on the command line: parse, translate into a `LaunchConfig`, call `launch`.

    wwrun [options] script.py [args...] [: script.py [args...]]...
    wwrun [options] -m module [args...] [: -m module [args...]]...
    wwrun [options] recipe.yaml [options]    (or -c recipe.yaml)
    wwrun doctor [--full]                    what wwrun will use here, and whether it works
    wwrun show [RUN] [--log-dir DIR]         a past run's summary (default: the latest)
    wwrun build                              build the C++ parts ahead of a run (an image, a CI cache)

Jobs are separated by ':' (MPI's MPMD convention). Everything after a script's name
belongs to that script, so wwrun's own options come first; after a recipe (a .yaml,
.yml or .json file, never run as Python) only wwrun's options may follow. Options
given here override a recipe's `defaults:`.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
import threading
from pathlib import Path

from wwrun import __version__
from wwrun.config import (
    ConfigError, JobSpec, LaunchConfig, flag_of, name_from, options, repeat_jobs, select_shard, shorten,
)

_SEPARATOR = ":"
RECIPE_SUFFIXES = (".yaml", ".yml", ".json")


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and exit code 2, as for every bad input
        self.exit(2, f"wwrun: error: {one_line(message)}{self._did_you_mean(message)} (see wwrun --help)\n")

    def _did_you_mean(self, message: str) -> str:
        """' (did you mean --x?)' for a misspelled flag or choice."""
        if unknown := re.match(r"unrecognized arguments: (-\S+)", message):
            word = unknown.group(1).split("=", 1)[0]
            candidates = [option for option in self._option_string_actions if option.startswith("--")]
        elif choice := re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message):
            word, candidates = choice.group(1), re.findall(r"'([^']*)'", choice.group(2))
        else:
            return ""
        match = difflib.get_close_matches(word, candidates, n=1, cutoff=0.6)
        return f" (did you mean {match[0]}?)" if match else ""


def one_line(message: str) -> str:
    """A message as one line, whatever the user's values hold."""
    return message.replace("\r", "\\r").replace("\n", "\\n")


def _is_address(text: str) -> bool:
    """A Ray address (local, auto, host:port, ray://host:port), not a script or recipe."""
    return text in ("local", "auto") or "://" in text or bool(re.match(r"^[^/\s]+:[0-9]+$", text))


def _bare_ray(argv: list[str] | None) -> list[str] | None:
    """`--ray` not followed by an address is `--ray=local`, so that argparse does not
    take the script after it (`wwrun --ray a.py`) for the optional address. Only
    wwrun's own options are looked at: up to the first job."""
    if argv is None:
        return None
    argv = list(argv)
    for i, token in enumerate(argv):
        if token in (_SEPARATOR, "-m", "--module") or os.path.isfile(token):
            break
        if token == "--ray" and (i + 1 == len(argv) or not _is_address(argv[i + 1])):
            argv[i] = "--ray=local"
    return argv


def is_recipe(path: str) -> bool:
    return path.lower().endswith(RECIPE_SUFFIXES)


COMMANDS = """commands:
  wwrun doctor [--full]             what wwrun will use here, and whether it works
  wwrun show [RUN] [--log-dir DIR]  a past run's summary (default: the latest run)
  wwrun build                       build the C++ parts ahead of a run (an image, a CI cache)"""


def get_args_parser() -> argparse.ArgumentParser:
    """wwrun's parser: LaunchConfig's options (from its field metadata), then the
    command line's own (recipe, module, repeat, dry run)."""
    parser = _Parser(
        prog="wwrun",
        description="Train several unmodified PyTorch scripts at once, as threads of one process.",
        usage="wwrun [options] (script.py | -m module) [args...] [: ...] | wwrun recipe.yaml [options]",
        epilog=COMMANDS,
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the epilog's columns as written
    )
    add = parser.add_argument
    for f in options():
        flag, meta = flag_of(f), f.metadata
        if flag is None:
            continue
        if meta["kind"] == "flag":  # default None: only what was given overrides a recipe
            add(flag, dest=f.name, action="store_const", const=True, help=meta["help"])
        elif meta["kind"] == "address":  # --ray [ADDRESS]: the address is optional
            add(flag, dest=f.name, nargs="?", const="local", metavar=meta["metavar"], help=meta["help"])
        else:
            add(flag, dest=f.name, choices=meta["choices"], metavar=meta["metavar"], help=meta["help"],
                type=int if meta["kind"] == "count" else str)
    add("-n", "--repeat", type=int, metavar="N", help="run each job N times (named job-0, job-1, ...), as a recipe's repeat")
    add("--dry-run", action="store_true", help="print the resolved jobs as a recipe and run nothing")
    add("--version", action="version", version=f"wwrun {__version__}")
    add("-c", "--recipe", metavar="FILE", help="read jobs and defaults from a YAML recipe")
    add("-m", "--module", action="store_true", help="the first job is a module, as with python -m")
    add("command", nargs=argparse.REMAINDER, help="jobs, separated by ':'")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; wwrun's options may also follow a recipe."""
    parser = get_args_parser()
    args = parser.parse_args(_bare_ray(argv))
    if args.recipe is None and not args.module and args.command and is_recipe(args.command[0]):
        recipe, rest = args.command[0], args.command[1:]
        args.command = []
        parser.parse_args(rest, namespace=args)  # what follows the recipe: options only
        if args.recipe is not None:
            parser.error("give one recipe")
        args.recipe = recipe
    return args


def config_from_args(args: argparse.Namespace) -> LaunchConfig:
    """Translate parsed arguments into a LaunchConfig (raises ConfigError)."""
    config = _config_from_args(args)
    if args.repeat is not None:
        config = config.replace(jobs=repeat_jobs(config.jobs, args.repeat))
    return select_shard(config)


def _config_from_args(args: argparse.Namespace) -> LaunchConfig:
    from wwrun.recipe import load_recipe

    command = list(args.command)
    recipe = args.recipe
    if recipe is None and not args.module and command and is_recipe(command[0]):
        recipe, command = command[0], command[1:]
    options = _options(args)
    if recipe is not None:
        if command:
            shown = " ".join(command)
            what = "':'" if _SEPARATOR in command else f"{shown[:60]!r}"
            raise ConfigError(
                "", f"a recipe runs its own jobs: nothing but wwrun's options may follow it (got {what})"
            )
        return load_recipe(recipe).replace(**options)
    if not command:
        raise ConfigError("", "no job given: wwrun script.py [args...] [: script.py ...] or wwrun recipe.yaml")
    return LaunchConfig(jobs=_jobs(command, first_is_module=args.module), **options)


def _options(args: argparse.Namespace) -> dict:
    """The options given on the command line: only they override a recipe's defaults."""
    given = {f.name: getattr(args, f.name, None) for f in options()}
    return {name: value for name, value in given.items() if value is not None}


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
            if is_recipe(target):
                raise ConfigError(where, f"{shorten(target)} is a recipe, not a script: give it alone")
            if not os.path.isfile(target):  # False, not an error, for a path too long to exist
                raise ConfigError(where, f"no such script: {shorten(target)}")
            spec = {"script": os.path.realpath(target)}
            base = Path(target).stem
        name = _unique(base, used)
        try:
            jobs.append(JobSpec(name=name, args=args, **spec))
        except ConfigError as err:
            raise err.within(where) from None
    return jobs


def _unique(base: str, used: set[str]) -> str:
    """A valid job name from a script's stem or a module, unique among `used`."""
    base = name_from(base)
    name, n = base, 1
    while name in used:
        n += 1
        name = f"{base}-{n}"
    used.add(name)
    return name


def _as_flag(err: ConfigError) -> ConfigError:
    """An error about an option, named as the flag the user typed: --memory-limit."""
    flags = {f.name: flag_of(f) for f in options()} | {"repeat": "--repeat"}
    return ConfigError(flags[err.where], err.reason) if flags.get(err.where) else err


def _show(argv: list[str]) -> int:
    """`wwrun show [RUN] [--log-dir DIR]`: a past run's summary (the latest by default)."""
    from wwrun.output import show_run

    parser = _Parser(prog="wwrun show", description="Print a past run's summary.")
    parser.add_argument("run", nargs="?", help="run id or folder (default: the latest run)")
    parser.add_argument("--log-dir", default="wwrun_logs", metavar="DIR", help="where logs go")
    args = parser.parse_args(argv)
    return show_run(args.run, log_root=args.log_dir)


def _build(argv: list[str]) -> int:
    """`wwrun build`: build every C++ part this machine can use, ahead of a run."""
    import torch

    from wwrun.build import BuildError
    from wwrun.parts import build_all

    _Parser(prog="wwrun build", description="Build wwrun's C++ parts against the installed torch, "
            "ahead of a run (for an image or a CI cache).").parse_args(argv)
    try:
        build_all(cuda=torch.version.cuda is not None)
    except BuildError as err:
        print(one_line(str(err)), file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"] and not os.path.isfile("doctor"):
        from wwrun import doctor

        return doctor.main(argv[1:])
    if argv[:1] == ["show"] and not os.path.isfile("show"):
        return _show(argv[1:])
    if argv[:1] == ["build"] and not os.path.isfile("build"):
        return _build(argv[1:])
    from wwrun import host

    host.watch_start_up_interrupts()  # before torch's import, which may drop a Ctrl-C
    from wwrun.build import BuildError
    from wwrun.launcher import EXIT_INTERRUPTED, launch, preflight

    args = parse_args(argv)
    try:
        config = config_from_args(args)
        preflight(config)
        if args.dry_run:
            from wwrun.recipe import dump_recipe

            sys.stdout.write(dump_recipe(config))
            return 0
        result = launch(config)
    except ConfigError as err:
        print(f"wwrun: error: {one_line(str(_as_flag(err)))}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # a Ctrl-C outside the run (start-up, summary)
        host.end_at_a_later_interrupt(EXIT_INTERRUPTED)
        print("wwrun: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except BuildError as err:  # a C++ part the run needs (its message says which and why)
        print(one_line(str(err)), file=sys.stderr)
        return 1
    main_thread = threading.main_thread()
    if any(t.is_alive() and (hasattr(t, "wwrun_job") or not t.daemon and t is not main_thread)
           for t in threading.enumerate()):
        # A job ignored the interrupt past its grace period, or an interrupted job
        # left a thread of its own running (interpreter exit would wait for it):
        # threads cannot be killed, the process can.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(result.exit_code)
    return result.exit_code
