"""The command line: MPMD jobs, -m, recipes, options, and one-line errors (exit 2)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from wwrun import __version__
from wwrun.cli import config_from_args, main, parse_args

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
A = str(SCRIPTS / "sibling_a" / "train.py")
B = str(SCRIPTS / "sibling_b" / "train.py")
NO_GUARD = str(SCRIPTS / "no_guard.py")


def config(*argv):
    return config_from_args(parse_args(list(argv)))


def run_main(argv, capsys) -> tuple[int, str]:
    """main's exit code (argparse's exits included) and its stderr."""
    try:
        code = main(argv)
    except SystemExit as exit_info:
        code = exit_info.code
    return code, capsys.readouterr().err


@pytest.fixture
def recipe(tmp_path):
    """A recipe whose one job would leave a file behind if it ever ran."""
    marker = tmp_path / "ran"
    script = tmp_path / "train.py"
    script.write_text(f"open({str(marker)!r}, 'w').close()\n")
    path = tmp_path / "r.yaml"
    path.write_text(f"jobs:\n  - script: {script}\n")
    return path


def test_a_ctrl_c_before_the_run_says_so_and_exits_130(tmp_path, capsys, monkeypatch):
    """Pressed while torch imports or the allocator builds: one line, not silence."""
    def interrupted(config):
        raise KeyboardInterrupt

    monkeypatch.setattr("wwrun.launcher.launch", interrupted)
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    assert run_main(["--log-dir", str(tmp_path), str(script)], capsys) == (130, "wwrun: interrupted\n")


def test_mpmd_jobs_split_on_colons():
    cfg = config(A, "--lr", "0.1", ":", B, "--epochs", "3", ":", NO_GUARD)
    assert [j.name for j in cfg.jobs] == ["train", "train-2", "no_guard"]
    assert [j.args for j in cfg.jobs] == [["--lr", "0.1"], ["--epochs", "3"], []]
    assert cfg.jobs[0].script == A
    # Options after a script belong to the script.
    assert config(A, "--quiet").jobs[0].args == ["--quiet"] and config(A, "--quiet").quiet is False


def test_names_derived_from_odd_file_names_are_valid(tmp_path):
    script = tmp_path / "train (copy).py"
    script.write_text("print('hi')\n")
    assert config(str(script)).jobs[0].name == "train__copy_"


def test_module_jobs():
    cfg = config("-m", "pkg.train", "--x", "1", ":", "-m", "other", ":", A)
    assert [(j.module, j.script, j.args) for j in cfg.jobs] == [
        ("pkg.train", None, ["--x", "1"]), ("other", None, []), (None, A, []),
    ]
    assert cfg.jobs[0].name == "pkg.train"


def test_options_become_config_fields():
    cfg = config(
        "--device", "cpu", "--memory-limit", "2GiB", "--policy", "sequential", "--max-concurrent", "2",
        "--log-dir", "/tmp/x", "--tee", "--report", "r.json", "--events", "-", "--quiet", A,
    )
    assert (cfg.device, cfg.memory_limit, cfg.policy, cfg.max_concurrent) == ("cpu", 2 * 1024**3, "sequential", 2)
    assert (cfg.log_dir, cfg.tee, cfg.report, cfg.events, cfg.quiet) == ("/tmp/x", True, "r.json", "-", True)
    assert config("--memory-limit", "80%", A).memory_limit == pytest.approx(0.8)
    cfg = config("--queue", "las", "--nodegroups", "4", "--explain", "--trace", "t.json", "--memory-plot", "m.png", A)
    assert (cfg.queue, cfg.nodegroups, cfg.explain, cfg.trace, cfg.memory_plot) == ("las", 4, True, "t.json", "m.png")
    assert config(A, ":", B).resolved_policy == "waterwave"
    assert config(A).resolved_policy == "concurrent"


def test_timeout_retries_and_halt_on_the_command_line():
    cfg = config("--timeout", "1h30m", "--retries", "2", "--halt", "soon", "--grace-period", "0", A)
    assert (cfg.timeout, cfg.retries, cfg.halt, cfg.grace_period_s) == (5400.0, 2, "soon", 0.0)
    assert (config(A).timeout, config(A).retries, config(A).halt) == (None, 0, "never")


def test_repeat_runs_each_job_n_times_named_as_a_recipe_names_them(recipe):
    cfg = config("-n", "3", A, "--lr", "1", ":", B)
    assert [j.name for j in cfg.jobs] == [f"train-{i}" for i in range(3)] + [f"train-2-{i}" for i in range(3)]
    assert [j.args for j in cfg.jobs[:3]] == [["--lr", "1"]] * 3 and cfg.jobs[0].args is not cfg.jobs[1].args
    assert [j.name for j in config(str(recipe), "--repeat", "2").jobs] == ["train-0", "train-1"]
    assert [j.name for j in config("-n", "1", A).jobs] == ["train"]


def test_recipe_by_suffix_or_flag_with_options_overriding_defaults(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults: {{policy: sequential, quiet: true}}\njobs:\n  - script: {A}\n  - script: {NO_GUARD}\n")
    for argv in ([str(recipe)], ["-c", str(recipe)]):
        cfg = config(*argv)
        assert (cfg.policy, cfg.quiet, len(cfg.jobs)) == ("sequential", True, 2)
    assert config("--policy", "concurrent", str(recipe)).policy == "concurrent"
    assert config("--policy", "concurrent", str(recipe)).quiet is True


@pytest.mark.parametrize(
    "argv, message",
    [
        (["missing.py"], "job 1: no such script: missing.py"),
        ([A, ":", ":", B], "job 2: empty"),
        (["--memory-limit", "lots", A], "--memory-limit: not a memory size"),
        (["--policy", "fast", A], "invalid choice"),
        (["--bogus", A], "unrecognized arguments"),
        ([], "no job given"),
        (["-m", NO_GUARD], "is not a module name (like 'pkg.train')"),  # the path's length is the checkout's
        (["--halt", "sooon", A], "invalid choice: 'sooon' (choose from 'never', 'soon', 'now') (did you mean soon?)"),
        (["--timeout", "soon", A], "--timeout: not a duration: 'soon'"),
        (["--retries", "-1", A], "--retries: must be at least 0, got -1"),
        (["--retries", "x", A], "argument --retries: invalid int value: 'x'"),
        (["-n", "0", A], "--repeat: must be at least 1, got 0"),
        (["-n", "5001", A, ":", B], "--repeat: 2 job(s) 5001 times is 10002 jobs; one run holds at most 10000"),
        (["-c", "r.yaml", A], "nothing but wwrun's options may follow it"),
        (["--dryrun", A], "unrecognized arguments: --dryrun (did you mean --dry-run?)"),
        (["--policy", "concurrent", "--trace", "t.json", A], "trace: needs the waterwave policy, not concurrent"),
        (["--policy", "sequential", "--explain", A, ":", B], "explain: needs the waterwave policy"),
        (["nope.yaml"], "nope.yaml"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        raise SystemExit(main(argv))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("wwrun: error: ")
    assert message in err


@pytest.mark.parametrize(
    "after, message",
    [
        ([":", B], "nothing but wwrun's options may follow it (got ':')"),
        ([B], "nothing but wwrun's options may follow it"),
        (["--reprt", "r.json"], "unrecognized arguments: --reprt (did you mean --report?)"),
        (["-c", "other.yaml"], "give one recipe"),
    ],
)
def test_after_a_recipe_only_options_may_follow(recipe, after, message, capsys):
    code, err = run_main([str(recipe), *after], capsys)
    assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (recipe.parent / "ran").exists()


def test_options_after_a_recipe_are_the_launcher_s(recipe, tmp_path, capsys):
    args = parse_args([str(recipe), "--dry-run", "--report", "r.json", "--policy", "sequential"])
    assert (args.recipe, args.dry_run, args.report, args.policy) == (str(recipe), True, "r.json", "sequential")
    assert main([str(recipe), "--dry-run", "--log-dir", str(tmp_path / "logs")]) == 0
    assert "script:" in capsys.readouterr().out
    assert not (tmp_path / "ran").exists() and not (tmp_path / "logs").exists()


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json", ".JSON"])
def test_a_recipe_file_is_never_run_as_python(tmp_path, suffix, capsys):
    marker = tmp_path / "ran"
    path = tmp_path / f"looks_like{suffix}"
    path.write_text(f"open({str(marker)!r}, 'w').close()\n")
    for argv in ([str(path)], [str(path), "--dry-run"], [NO_GUARD, ":", str(path)]):
        code, err = run_main(argv, capsys)
        assert code == 2 and err.count("\n") == 1, err
    assert not marker.exists()


def test_a_json_recipe_is_read_as_a_recipe(tmp_path, capsys):
    path = tmp_path / "r.json"
    path.write_text('{"jobs": [{"script": "%s", "args": ["--x"]}]}' % NO_GUARD)
    assert main([str(path), "--dry-run"]) == 0
    assert "--x" in capsys.readouterr().out


def test_memory_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    code, err = run_main(["--log-dir", str(tmp_path), "--memory-plot", "m.png", NO_GUARD], capsys)
    assert code == 2 and "needs matplotlib" in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def test_dry_run_prints_the_resolved_jobs_and_runs_nothing(tmp_path, capsys):
    assert main(["--dry-run", "--log-dir", str(tmp_path), NO_GUARD, "--lr", "1", ":", A]) == 0
    out = capsys.readouterr().out
    assert "no_guard" in out and NO_GUARD in out and "--lr" in out
    assert not any(tmp_path.iterdir())


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.strip() == f"wwrun {__version__}"


def test_plain_output_is_prefixed_per_job(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path), NO_GUARD, "x", ":", NO_GUARD, "y"],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "[no_guard] job=no_guard argv=['x']" in done.stdout
    assert "[no_guard-2] job=no_guard-2 argv=['y']" in done.stdout
    assert "\x1b[" not in done.stdout + done.stderr  # not a terminal: nothing redrawn


def test_quickstart_recipe_end_to_end(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--log-dir", str(tmp_path), str(ROOT / "recipes" / "quickstart.yaml")],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert done.stderr.count("succeeded") >= 3


# ----------------------------------------------------------------------------- bad input (issue 12 §8)


def bad_inputs(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Each: argv, and what its one error line says. Every one is refused before a job runs."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    deep = tmp_path / "deep.yaml"
    deep.write_text("[" * 5000)
    repeated = tmp_path / "repeated.yaml"
    repeated.write_text(f"jobs:\n  - script: {NO_GUARD}\n    repeat: 1000000\n")
    grid = tmp_path / "grid.yaml"
    lists = "\n".join(f"        {key}: {list(range(1000))}" for key in "abcd")
    grid.write_text(f"jobs:\n  - script: {NO_GUARD}\n    args: '{{a}} {{b}} {{c}} {{d}}'\n    sweep:\n      grid:\n{lists}\n")
    long_name = tmp_path / "long_name.yaml"
    long_name.write_text(f"jobs:\n  - script: {NO_GUARD}\n    name: {'n' * 5000}\n")
    return {
        "size overflow": (["--memory-limit", "99999999999999999999999GiB", NO_GUARD],
                          "--memory-limit: 99999999999999999999999GiB is more memory than any machine has"),
        "size of 400 digits": (["--memory-limit", "9" * 400 + "GiB", NO_GUARD], "more memory than any machine has"),
        "log dir is a file": (["--log-dir", str(a_file), NO_GUARD], "is a file, not a folder"),
        "log dir under a file": (["--log-dir", str(a_file / "logs"), NO_GUARD], "which is a file, not a folder"),
        "log dir in /proc": (["--log-dir", "/proc/wwrun_logs", NO_GUARD], "--log-dir: cannot write logs in /proc/wwrun_logs"),
        "report in a missing folder": (["--report", str(tmp_path / "no" / "r.json"), NO_GUARD],
                                       "--report: the folder of"),
        "events in a missing folder": (["--events", str(tmp_path / "no" / "e.jsonl"), NO_GUARD], "--events: the folder of"),
        "report onto a folder": (["--report", str(tmp_path), NO_GUARD], "is a folder; give a file name"),
        "trace in /proc": (["--trace", "/proc/t.json", NO_GUARD], "--trace: cannot write /proc/t.json"),
        "long script path": (["a" * 5000 + ".py"], "no such script: aaaa"),
        "long recipe path": (["a" * 5000 + ".yaml"], "cannot read"),
        "long job name": ([str(long_name)], "jobs[0].name: 'nnnn"),
        "5000 nested [": ([str(deep)], "bad YAML: nested too deeply"),
        "repeat 1000000": ([str(repeated)], "jobs[0]: expands into 1000000 jobs (repeat 1000000): one run holds at most 10000"),
        "1000^4 grid": ([str(grid)], "expands into 1000000000000 jobs (1000 a x 1000 b x 1000 c x 1000 d)"),
        "-n 1000000": (["-n", "1000000", NO_GUARD], "--repeat: 1 job(s) 1000000 times is 1000000 jobs"),
    }


BAD_INPUTS = [
    "size overflow", "size of 400 digits", "log dir is a file", "log dir under a file", "log dir in /proc",
    "report in a missing folder", "events in a missing folder", "report onto a folder", "trace in /proc",
    "long script path", "long recipe path", "long job name", "5000 nested [", "repeat 1000000", "1000^4 grid",
    "-n 1000000",
]


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_input_is_refused_before_anything_runs(case, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cases = bad_inputs(tmp_path)
    assert sorted(cases) == sorted(BAD_INPUTS)
    argv, message = cases[case]
    listing = sorted(tmp_path.rglob("*"))
    code, err = run_main(argv + ["--log-dir", str(tmp_path / "logs")] if "--log-dir" not in argv else argv, capsys)
    assert code == 2 and err.count("\n") == 1 and err.startswith("wwrun: error: "), err
    assert message in err, err
    assert "Traceback" not in err and len(err) < 400
    assert sorted(tmp_path.rglob("*")) == listing  # no log folder, no probe left behind


def test_checking_output_paths_leaves_nothing_behind(tmp_path, capsys):
    existing = tmp_path / "old_report.json"
    existing.write_text("kept")
    argv = ["--dry-run", "--log-dir", str(tmp_path / "a" / "b"), "--report", str(existing),
            "--events", str(tmp_path / "e.jsonl"), "--trace", str(tmp_path / "t.json"), NO_GUARD]
    assert main(argv) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old_report.json"]
    assert existing.read_text() == "kept"


def test_many_jobs_run_a_bounded_number_at_once():
    from wwrun.config import DEFAULT_MAX_CONCURRENT

    cfg = config("-n", "5000", NO_GUARD)
    assert len(cfg.jobs) == 5000 and cfg.max_concurrent is None
    assert 1 <= cfg.concurrency <= DEFAULT_MAX_CONCURRENT
    assert config("-n", "5000", "--max-concurrent", "3000", NO_GUARD).concurrency == 3000
    assert config("-n", "4", "--policy", "sequential", NO_GUARD).concurrency == 1


def test_help_lists_the_commands(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert re.search(r"^commands:\n  wwrun doctor \[--full\] +\S.*\n  wwrun show \[RUN\] \[--log-dir DIR\] +\S.*\n"
                     r"  wwrun build +\S", out, re.M)


def test_build_makes_every_part_ahead_of_a_run():
    from wwrun.memory import allocator

    assert main(["build"]) == 0
    for kind in ("host", "cpu"):
        assert any(allocator.build_directory(kind).glob("*.so")), kind


def test_a_ctrl_c_at_start_up_delivered_twice_ends_quietly_and_a_later_one_at_once():
    """`timeout` (or a terminal and a wrapper) delivers one Ctrl-C twice: at start-up,
    before the run's handler, Python raised the second in `threading._shutdown`, a
    traceback after "wwrun: interrupted". The same press is let go; a later one ends
    the process at once."""
    code = ("import os, signal, time\nfrom wwrun import host\nhost.end_at_a_later_interrupt(130)\n"
            "os.kill(os.getpid(), signal.SIGINT)\ntime.sleep(0.05)\nprint('let go', flush=True)\n"
            "time.sleep(host.SAME_PRESS_S + 0.1)\nos.kill(os.getpid(), signal.SIGINT)\n"
            "time.sleep(60)\nprint('not ended')\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stdout, done.stderr) == (130, "let go\n", "")



def test_a_ctrl_c_at_start_up_that_an_import_drops_still_stops_the_run(tmp_path):
    """torch's C start-up drops an exception raised while it imports numpy: a Ctrl-C
    landing there was lost and the whole run went on. Remembered from the CLI's start,
    it ends the run before any job starts."""
    code = ("import os, signal, sys, time\nfrom wwrun import host\nhost.watch_start_up_interrupts()\n"
            "try:\n    os.kill(os.getpid(), signal.SIGINT)\n    time.sleep(60)\n"
            "except KeyboardInterrupt:\n    pass  # as torch's start-up drops it\n"
            "from wwrun.cli import main\nsys.exit(main(sys.argv[1:]))\n")
    script = tmp_path / "job.py"
    script.write_text("print('ran')\n")
    done = subprocess.run([sys.executable, "-c", code, "--device", "cpu", "--log-dir", str(tmp_path / "logs"),
                           str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stderr.strip()) == (130, "wwrun: interrupted"), done.stderr
    assert "ran" not in done.stdout and not (tmp_path / "logs").exists()
