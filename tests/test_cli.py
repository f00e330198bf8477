"""The command line: MPMD jobs, -m, recipes, options, and one-line errors (exit 2)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from wwrun import __version__
from wwrun.cli import config_from_args, get_args_parser, main

ROOT = Path(__file__).parent.parent
SCRIPTS = Path(__file__).parent / "scripts"
A = str(SCRIPTS / "sibling_a" / "train.py")
B = str(SCRIPTS / "sibling_b" / "train.py")
NO_GUARD = str(SCRIPTS / "no_guard.py")


def config(*argv):
    return config_from_args(get_args_parser().parse_args(list(argv)))


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
        (["-c", "r.yaml", A], "either a recipe or scripts"),
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
