"""Recipes: loading, sweep expansion, the resolved dump, and every one-line error."""

import os
import runpy
import textwrap
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from wwrun.config import ConfigError, JobSpec, LaunchConfig
from wwrun.recipe import dump_recipe, load_recipe

RECIPES = Path(__file__).resolve().parent.parent / "recipes"


@pytest.fixture
def project(tmp_path):
    """A folder with a training script, a sub-folder and a place for the recipe."""
    (tmp_path / "train.py").write_text("print('training')\n")
    (tmp_path / "runs").mkdir()
    return tmp_path


def write(folder: Path, text: str, name: str = "recipe.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def load(folder: Path, text: str) -> LaunchConfig:
    return load_recipe(write(folder, text))


def error_of(folder: Path, text: str) -> str:
    path = write(folder, text)
    with pytest.raises(ConfigError) as caught:
        load_recipe(path)
    message = str(caught.value)
    assert "\n" not in message
    prefix = f"{path}: "
    assert message.startswith(prefix), message
    return message[len(prefix):]


# ----------------------------------------------------------------------------- loading


def test_one_job_with_every_key(project):
    config = load(project, """
        defaults:
          device: cpu
          memory_limit: 2GiB
          policy: sequential
          max_concurrent: 2
          queue: las
          nodegroups: 4
          log_dir: logs
          tee: true
          report: run.json
          events: "-"
          quiet: false
        jobs:
          - name: first
            script: train.py
            args: --lr 0.1 --note 'two words' "{not a placeholder}"
            env: {COUNT: 3, RATE: 0.5, DEBUG: true, NAME: x}
            cwd: runs
            priority: -2
            memory_limit: 25%
    """)
    assert (config.device, config.memory_limit, config.policy) == ("cpu", 2 * 1024**3, "sequential")
    assert (config.max_concurrent, config.queue, config.nodegroups) == (2, "las", 4)
    assert (config.log_dir, config.tee, config.report, config.events, config.quiet) == (
        "logs", True, "run.json", "-", False)
    assert config.source == str(project / "recipe.yaml")
    (job,) = config.jobs
    assert job == JobSpec(
        name="first",
        script=str(project / "train.py"),
        args=["--lr", "0.1", "--note", "two words", "{not a placeholder}"],
        env={"COUNT": "3", "RATE": "0.5", "DEBUG": "true", "NAME": "x"},
        cwd=str(project / "runs"),
        priority=-2,
        memory_limit=0.25,
    )


def test_defaults_are_the_launch_config_defaults(project):
    config = load(project, """
        jobs:
          - script: train.py
            args: [--epochs, 3, --lr, 1.0e-3, --flag, false]
          - module: pkg.train
            cwd: null
            memory_limit: 0.5  # a fraction of the device, as 50%
    """)
    expected = LaunchConfig(jobs=config.jobs)
    for field in ("device", "memory_limit", "policy", "max_concurrent", "queue", "log_dir", "tee"):
        assert getattr(config, field) == getattr(expected, field)
    script_job, module_job = config.jobs
    assert script_job.name == "train"  # the script's stem
    assert script_job.args == ["--epochs", "3", "--lr", "0.001", "--flag", "false"]
    assert (module_job.name, module_job.module, module_job.script, module_job.cwd) == (
        "pkg.train", "pkg.train", None, None)
    assert (script_job.memory_limit, module_job.memory_limit) == (None, 0.5)


def test_paths_are_relative_to_the_recipe_folder_not_the_working_directory(project, monkeypatch):
    nested = project / "recipes"
    nested.mkdir()
    monkeypatch.chdir(nested)
    config = load_recipe(write(nested, "jobs: [{script: ../train.py, cwd: ../runs}]"))
    assert config.jobs[0].script == str(project / "train.py")
    assert config.jobs[0].cwd == str(project / "runs")


# ----------------------------------------------------------------------------- sweeps


def test_grid_is_the_cartesian_product_with_readable_names(project):
    config = load(project, """
        jobs:
          - script: train.py
            args: --lr={lr} --batch-size {bs}
            sweep:
              grid: {lr: [0.1, 0.01], bs: [32, 64, 128]}
    """)
    assert [job.name for job in config.jobs] == [
        f"train-lr{lr}-bs{bs}" for lr in ("0.1", "0.01") for bs in ("32", "64", "128")
    ]
    assert config.jobs[4].args == ["--lr=0.01", "--batch-size", "64"]


def test_zip_pairs_values_in_order(project):
    config = load(project, """
        jobs:
          - script: train.py
            args: [--seed, "{seed}", --width, "{width}"]
            sweep:
              zip: {seed: [1, 2, 3], width: [64, 128, 256]}
    """)
    assert [job.args for job in config.jobs] == [
        ["--seed", "1", "--width", "64"],
        ["--seed", "2", "--width", "128"],
        ["--seed", "3", "--width", "256"],
    ]
    assert [job.name for job in config.jobs] == ["train-seed1-width64", "train-seed2-width128",
                                                 "train-seed3-width256"]


def test_grid_and_zip_cross_each_grid_point_with_each_zip_row(project):
    config = load(project, """
        jobs:
          - script: train.py
            args: --lr {lr} --seed {seed} --data {data}
            sweep:
              grid: {lr: [0.1, 0.01]}
              zip: {seed: [0, 1], data: [a.txt, b.txt]}
    """)
    assert [tuple(job.args[1::2]) for job in config.jobs] == [
        ("0.1", "0", "a.txt"), ("0.1", "1", "b.txt"), ("0.01", "0", "a.txt"), ("0.01", "1", "b.txt"),
    ]


def test_repeat_names_and_the_repeat_placeholder(project):
    config = load(project, """
        jobs:
          - script: train.py
            args: --seed {repeat}
            repeat: 3
          - script: train.py
            name: swept
            args: --lr {lr}
            repeat: 2
            sweep: {grid: {lr: [0.5]}}
    """)
    assert [job.name for job in config.jobs] == [
        "train-0", "train-1", "train-2", "swept-lr0.5-0", "swept-lr0.5-1"]
    assert [job.args for job in config.jobs[:3]] == [["--seed", "0"], ["--seed", "1"], ["--seed", "2"]]


def test_name_templates_are_filled_and_values_made_safe_for_folder_names(project):
    config = load(project, """
        jobs:
          - script: train.py
            name: run{repeat}-{data}
            args: [--data, "{data}"]
            repeat: 2
            sweep: {grid: {data: [sets/a b.txt]}}
    """)
    assert [job.name for job in config.jobs] == ["run0-sets_a_b.txt", "run1-sets_a_b.txt"]
    assert config.jobs[0].args == ["--data", "sets/a b.txt"]  # the argument itself is untouched


def test_a_name_template_missing_a_sweep_key_names_both_clashing_jobs(project):
    message = error_of(project, """
        jobs:
          - script: train.py
            name: mlp-{lr}
            args: --lr {lr} --bs {bs}
            sweep: {grid: {lr: [0.1], bs: [32, 64]}}
    """)
    assert message == (
        "jobs[0].name: jobs[0] (lr=0.1, bs=64) and jobs[0] (lr=0.1, bs=32) are both named "
        "'mlp-0.1'; put every sweep key (and {repeat}) in the name template"
    )


def test_two_entries_with_the_same_name(project):
    message = error_of(project, """
        jobs:
          - {script: train.py}
          - {script: train.py, args: --fast}
    """)
    assert message == "jobs[1].name: jobs[1] and jobs[0] are both named 'train'; give one of them another 'name'"


# ----------------------------------------------------------------------------- the resolved recipe


def test_dump_round_trip_gives_an_equal_config(project, tmp_path_factory):
    config = load(project, """
        defaults: {device: cpu, memory_limit: 37%, max_concurrent: 3, tee: true, grace_period_s: 2.5,
                   timeout: 1h30m, retries: 2, halt: soon}
        jobs:
          - script: train.py
            args: --lr {lr} --seed {seed} --note "it's {lr}"
            env: {MODE: fast, N: 2}
            cwd: runs
            memory_limit: 512MB
            priority: 5
            timeout: 90s
            retries: 1
            repeat: 2
            sweep: {grid: {lr: [0.1, 0.01]}, zip: {seed: [7]}}
          - {module: pkg.train, args: ["0.5", "true", "null", "{}"], stdin: true, memory_limit: 0.5}
    """)
    assert (config.grace_period_s, config.timeout, config.retries, config.halt) == (2.5, 5400.0, 2, "soon")
    assert (config.jobs[0].timeout, config.jobs[0].retries, config.jobs[4].stdin) == (90.0, 1, True)
    text = dump_recipe(config)
    assert "sweep" not in text and "repeat:" not in text
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "recipe.yaml"
    elsewhere.write_text(text)
    again = load_recipe(elsewhere)
    assert len(again.jobs) == 5
    assert again.replace(run_id=config.run_id, source=config.source) == config


@settings(max_examples=100, deadline=None)
@given(st.lists(st.text(alphabet="{}ab_ -1", max_size=12), max_size=4))
def test_dump_keeps_arguments_that_look_like_placeholders(tmp_path_factory, args):
    script = str(Path(__file__).resolve())
    config = LaunchConfig(jobs=[JobSpec(name="a", script=script, args=args)])
    path = tmp_path_factory.getbasetemp() / "literal.yaml"
    path.write_text(dump_recipe(config))
    assert load_recipe(path).jobs[0].args == args


def test_double_braces_are_literal(project):
    config = load(project, """
        jobs:
          - script: train.py
            args: --lr {lr} --note {{lr}}
            sweep: {grid: {lr: [1]}}
    """)
    assert config.jobs[0].args == ["--lr", "1", "--note", "{lr}"]


def test_dump_makes_paths_absolute(project, monkeypatch):
    monkeypatch.chdir(project)
    config = LaunchConfig(jobs=[JobSpec(name="a", script="train.py", cwd="runs")])
    out = project / "runs" / "resolved.yaml"
    out.write_text(dump_recipe(config))
    job = load_recipe(out).jobs[0]
    assert (job.script, job.cwd) == (str(project / "train.py"), str(project / "runs"))


@settings(max_examples=50, deadline=None)
@given(st.floats(min_value=1e-6, max_value=1.0))
def test_dump_keeps_every_memory_fraction_exactly(tmp_path_factory, fraction):
    script = str(Path(__file__).resolve())  # any file that exists
    config = LaunchConfig(jobs=[JobSpec(name="a", script=script, memory_limit=fraction)],
                          memory_limit=fraction)
    path = tmp_path_factory.getbasetemp() / "fraction.yaml"
    path.write_text(dump_recipe(config))
    again = load_recipe(path)
    assert again.memory_limit == fraction and again.jobs[0].memory_limit == fraction


# ----------------------------------------------------------------------------- errors


ERRORS = {
    "unknown top-level key": (
        "job: [{script: train.py}]",
        "job: unknown key (did you mean 'jobs'?)"),
    "unknown option": (
        "defaults: {devise: cpu}\njobs: [{script: train.py}]",
        "defaults.devise: unknown key (did you mean 'device'?)"),
    "unknown job key": (
        "jobs: [{script: train.py, arg: --x}]",
        "jobs[0].arg: unknown key (did you mean 'args'?)"),
    "unknown sweep key": (
        "jobs:\n- {script: train.py}\n- {script: train.py, name: b, args: '{lr}', sweep: {grd: {lr: [1]}}}",
        "jobs[1].sweep.grd: unknown key (did you mean 'grid'?)"),
    "bad option value": (
        "defaults: {policy: waterwav}\njobs: [{script: train.py}]",
        "defaults.policy: 'waterwav' is not one of waterwave, concurrent, sequential "
        "(did you mean 'waterwave'?)"),
    "option type": (
        "defaults: {tee: 3}\njobs: [{script: train.py}]",
        "defaults.tee: expected true or false, got the number 3"),
    "defaults type": (
        "defaults: [cpu]\njobs: [{script: train.py}]",
        "defaults: expected a mapping of launcher options, got a list"),
    "jobs type": (
        "jobs: {script: train.py}",
        "jobs: expected a list of jobs, got a mapping"),
    "job type": (
        "jobs: [train.py]",
        "jobs[0]: expected a mapping (script:, args:, ...), got the string 'train.py'"),
    "priority type": (
        "jobs: [{script: train.py, priority: high}]",
        "jobs[0].priority: expected an integer, got the string 'high'"),
    "args type": (
        "jobs: [{script: train.py, args: {lr: 1}}]",
        "jobs[0].args: expected a list or a string, got a mapping"),
    "argument type": (
        "jobs: [{script: train.py, args: [--lr, [1, 2]]}]",
        "jobs[0].args[1]: expected a string or a number, got a list"),
    "env value type": (
        "jobs: [{script: train.py, env: {A: {b: 1}}}]",
        "jobs[0].env.A: expected a string or a number, got a mapping"),
    "repeat below one": (
        "jobs: [{script: train.py, repeat: 0}]",
        "jobs[0].repeat: must be at least 1, got 0"),
    "bad size": (
        "jobs: [{script: train.py, memory_limit: 2 GiBs}]",
        "jobs[0].memory_limit: unknown unit 'GiBs' in '2 GiBs' (did you mean 'gib'?)"),
    "size type": (
        "jobs: [{script: train.py, memory_limit: 1.5}]",
        "jobs[0].memory_limit: 1.5 is neither a fraction of the device (0 < x <= 1) nor a whole number of bytes"),
    "missing script": (
        "jobs: [{script: nope.py}]",
        "jobs[0].script: no such file: {folder}/nope.py"),
    "missing cwd": (
        "jobs: [{script: train.py, cwd: nowhere}]",
        "jobs[0].cwd: no such folder: {folder}/nowhere"),
    "job as a sweep key": (
        "jobs: [{script: train.py, args: '{job}', sweep: {grid: {job: [1, 2]}}}]",
        "jobs[0].sweep.grid.job: 'job' is reserved for the job's name"),
    "job in the name": (
        "jobs: [{script: train.py, name: 'x-{job}'}]",
        "jobs[0].name: placeholder {job} has no sweep value (this job has no sweep)"),
    "script and module": (
        "jobs: [{script: train.py, module: train}]",
        "jobs[0]: give exactly one of 'script' and 'module'"),
    "neither script nor module": (
        "jobs: [{name: lonely}]",
        "jobs[0]: give exactly one of 'script' and 'module'"),
    "bad module": (
        "jobs: [{module: my-train}]",
        "jobs[0].module: 'my-train' is not a module name (like 'pkg.train')"),
    "bad name": (
        "jobs: [{script: train.py, name: my job}]",
        "jobs[0].name: 'my job' is not a valid job name (letters, digits and ._=+,- only)"),
    "unsplittable args": (
        "jobs: [{script: train.py, args: \"--note 'open\"}]",
        "jobs[0].args: cannot split like a shell: No closing quotation"),
    "placeholder typo": (
        "jobs: [{script: train.py, args: '--lr {lrr}', sweep: {grid: {lr: [1]}}}]",
        "jobs[0].args[1]: placeholder {lrr} has no sweep value (did you mean 'lr'?)"),
    "placeholder without sweep": (
        "jobs: [{script: train.py, args: '--lr {lr}'}]",
        "jobs[0].args[1]: placeholder {lr} has no sweep value (this job has no sweep)"),
    "placeholder in name": (
        "jobs: [{script: train.py, name: 'x-{width}', args: '{lr}', sweep: {grid: {lr: [1], bs: [2]}}}]",
        "jobs[0].name: placeholder {width} has no sweep value (the sweep gives lr, bs)"),
    "sweep value used nowhere": (
        "jobs: [{script: train.py, args: '{lr}', sweep: {grid: {lr: [1]}, zip: {seed: [1, 2]}}}]",
        "jobs[0].sweep.zip.seed: no {seed} in args uses this value, so every job would run the same"),
    "unequal zip": (
        "jobs: [{script: train.py, args: '{a} {b}', sweep: {zip: {a: [1, 2], b: [1, 2, 3]}}}]",
        "jobs[0].sweep.zip: lists of unequal lengths (a has 2, b has 3); zip pairs them up"),
    "key in grid and zip": (
        "jobs: [{script: train.py, args: '{a}', sweep: {grid: {a: [1]}, zip: {a: [2]}}}]",
        "jobs[0].sweep.zip.a: also a grid key; give each key once"),
    "empty jobs": (
        "jobs: []",
        "jobs: empty list: a recipe needs at least one job"),
    "missing jobs": (
        "defaults: {device: cpu}",
        "jobs: missing: a recipe needs a list of jobs"),
    "empty value list": (
        "jobs: [{script: train.py, args: '{lr}', sweep: {grid: {lr: []}}}]",
        "jobs[0].sweep.grid.lr: empty list: give at least one value"),
    "empty grid": (
        "jobs: [{script: train.py, sweep: {grid: {}}}]",
        "jobs[0].sweep.grid: empty mapping: give at least one key and its list of values"),
    "empty sweep": (
        "jobs: [{script: train.py, sweep: {}}]",
        "jobs[0].sweep: empty: give 'grid:' and/or 'zip:'"),
    "sweep values not a list": (
        "jobs: [{script: train.py, args: '{lr}', sweep: {grid: {lr: 0.1}}}]",
        "jobs[0].sweep.grid.lr: expected a list of values, got the number 0.1"),
    "reserved sweep key": (
        "jobs: [{script: train.py, args: '{repeat}', sweep: {grid: {repeat: [1]}}}]",
        "jobs[0].sweep.grid.repeat: 'repeat' is reserved for the repeat index"),
    "job timeout": (
        "jobs: [{script: train.py, timeout: soon}]",
        "jobs[0].timeout: not a duration: 'soon' (try '90s', '30m' or '1h30m')"),
    "job retries": (
        "jobs: [{script: train.py, retries: -1}]",
        "jobs[0].retries: must be at least 0, got -1"),
    "job stdin": (
        "jobs: [{script: train.py, stdin: 1}]",
        "jobs[0].stdin: expected true or false, got the number 1"),
    "two jobs read stdin": (
        "jobs: [{script: train.py, stdin: true}, {script: train.py, name: b, stdin: true}]",
        "jobs: at most one job may read stdin"),
    "run timeout": (
        "defaults: {timeout: 0}\njobs: [{script: train.py}]",
        "defaults.timeout: a duration must be positive, got 0"),
    "halt typo": (
        "defaults: {halt: sooon}\njobs: [{script: train.py}]",
        "defaults.halt: 'sooon' is not one of never, soon, now (did you mean 'soon'?)"),
    "grace period": (
        "defaults: {grace_period_s: -1}\njobs: [{script: train.py}]",
        "defaults.grace_period_s: a duration must be 0 or more, got -1"),
    "not a mapping": (
        "- script: train.py",
        "expected a mapping with 'jobs:' and optionally 'defaults:', got a list"),
}


@pytest.mark.parametrize("case", ERRORS, ids=list(ERRORS))
def test_each_problem_is_one_line_naming_file_key_path_and_fix(project, case):
    text, expected = ERRORS[case]
    assert error_of(project, text) == expected.replace("{folder}", str(project))


def test_bad_yaml_names_the_line(project):
    message = error_of(project, "jobs:\n  - script: train.py\n    args: [--lr, 0.1\n")
    assert message.startswith("line 4, column 1: bad YAML: expected ',' or ']'"), message


def test_a_key_given_twice_is_an_error_with_its_line(project):
    message = error_of(project, "jobs:\n  - script: train.py\n    args: --a\n    args: --b\n")
    assert message == "line 4, column 5: bad YAML: duplicate key 'args'"


def test_missing_and_empty_files(project):
    for path, problem in [(project / "absent.yaml", "no such recipe file"),
                          (project, "is a folder, not a recipe file"),
                          (write(project, ""), "empty recipe (expected 'jobs:' and optionally 'defaults:')")]:
        with pytest.raises(ConfigError) as caught:
            load_recipe(path)
        assert str(caught.value) == f"{path}: {problem}"


# ----------------------------------------------------------------------------- bundled recipes


def example_parser(script: str):
    """The example's own argparse, without running it (its main is behind the guard)."""
    return runpy.run_path(script, run_name="wwrun_test_example")["parse_args"]


def test_quickstart_runs_the_three_examples_with_arguments_they_accept():
    config = load_recipe(RECIPES / "quickstart.yaml")
    assert [os.path.basename(job.script) for job in config.jobs] == [
        "mlp.py", "char_transformer.py", "cnn.py"]
    for job in config.jobs:
        assert os.path.isabs(job.script)
        example_parser(job.script)(job.args)  # argparse exits on an argument it does not know


def test_sweep_expands_into_jobs_that_differ_only_in_learning_rate():
    config = load_recipe(RECIPES / "sweep.yaml")
    assert len(config.jobs) >= 2
    parse = example_parser(config.jobs[0].script)
    parsed = [vars(parse(job.args)) for job in config.jobs]
    rates = [settings.pop("lr") for settings in parsed]
    assert len(set(rates)) == len(rates)
    assert all(settings == parsed[0] for settings in parsed)
    assert all(f"lr{job.args[job.args.index('--lr') + 1]}" in job.name for job in config.jobs)


def test_job_placeholder_stays_until_the_job_starts_and_reads_back_the_same(project):
    config = load(project, """
        jobs:
          - script: train.py
            name: t-lr{lr}
            args: --lr {lr} --save {job}.pt
            cwd: runs/{job}/out
            sweep: {grid: {lr: [0.1, 0.2]}}
        """)
    # Not made by loading (a dry run leaves nothing): the job makes it when it starts.
    assert [job.cwd for job in config.jobs] == [str(project / "runs" / "{job}" / "out")] * 2
    assert not (project / "runs" / "{job}").exists()
    placed = [job.placed() for job in config.jobs]
    assert [job.args for job in placed] == [["--lr", "0.1", "--save", "t-lr0.1.pt"],
                                            ["--lr", "0.2", "--save", "t-lr0.2.pt"]]
    assert placed[1].cwd == str(project / "runs" / "t-lr0.2" / "out")
    again = load_recipe(write(project, dump_recipe(config), "again.yaml"))
    assert again.jobs == config.jobs


def test_sweep_points_save_apart():
    config = load_recipe(RECIPES / "sweep.yaml")
    parse = example_parser(config.jobs[0].script)
    saves = [parse(job.placed().args).save for job in config.jobs]
    assert None not in saves and len(set(saves)) == len(saves)
