"""Fuzzing the front door: generated command lines and recipes, good and bad.

Each vector goes through `wwrun.cli.main` in-process with `--dry-run` first (and
`launch` replaced by a tripwire), so nothing trains. Every one must end with exit
code 0, or with exit code 2 and exactly one line on stderr, never a traceback, and
never hang (an alarm ends a vector that takes more than HANG_S). A dry run that
succeeds must print a recipe that is itself accepted. A small sample also runs as
`python -m wwrun` in a subprocess. Seeded: a failure names its seed and vector.
"""

from __future__ import annotations

import contextlib
import io
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from wwrun import cli

SCRIPTS = Path(__file__).parent / "scripts"
NO_GUARD = str(SCRIPTS / "no_guard.py")
HANG_S = 10  # a vector that takes this long has hung: most take a few milliseconds

SIZES = ["2GiB", "512MB", "80%", "0.5", "1", "1.5", "-1", "0", "99999999999999999999999GiB", "9" * 400 + "KiB",
         "lots", "2 GiBs", "%", "", "1e3", "100%", "101%", "0.0001%", "1.0"]
DURATIONS = ["90", "90s", "1h30m", "2d", "0", "-5", "soon", "1x", "", "9" * 400, "0.5s"]
COUNTS = ["0", "1", "3", "-1", "x", "99999999999999999999", "2.5", ""]
WORDS = ["", " ", ":", "-", "--", "-m", "é", "\n", "a b", "{lr}", "%", "\t", "x" * 5000, "../", "/", "~", "$HOME"]
FLAGS = {
    "--device": ["auto", "cpu", "cuda", "gpu", ""],
    "--memory-limit": SIZES,
    "--policy": ["waterwave", "concurrent", "sequential", "fast"],
    "--max-concurrent": COUNTS,
    "--queue": ["fifo", "las", "lifo"],
    "--nodegroups": COUNTS,
    "--grace-period": DURATIONS,
    "--timeout": DURATIONS,
    "--retries": COUNTS,
    "--halt": ["never", "soon", "now", "sometimes"],
    "-n": COUNTS,
    "--repeat": COUNTS,
    "--engines": COUNTS,
    "--gpus": ["all", "2", "0,2", "3,", "0", "x", ""],
    "--shard": ["0/2", "1/3", "2/2", "0/0", "x", "-1/2", ""],
}
SWITCHES = ["--tee", "--quiet", "--explain", "--dryrun", "--bogus", "--memory_limit", "-x", "--help", "--version",
            "--rep", "-m", "--module", "--ray"]


class Outputs:
    """Paths for the path-taking flags, good and bad, under one temporary folder."""

    def __init__(self, root: Path):
        self.root = root
        (root / "a_file").write_text("")
        (root / "a.py").write_text("print('a')\n")
        self.paths = [str(root / "out.json"), str(root / "no" / "out.json"), str(root), str(root / "a_file"),
                      str(root / "a_file" / "x"), "/proc/wwrun.json", "x" * 5000, "-", ""]
        self.scripts = [NO_GUARD, str(root / "a.py"), str(root / "missing.py"), str(root / "r.yaml"),
                        "x" * 5000 + ".py", str(root), ""]


def cli_vector(rng: random.Random, out: Outputs) -> list[str]:
    argv: list[str] = []
    for _ in range(rng.randint(0, 5)):
        roll = rng.random()
        if roll < 0.55:
            flag = rng.choice(list(FLAGS))
            argv.append(flag)
            if rng.random() < 0.95:  # now and then the value is missing
                argv.append(rng.choice(FLAGS[flag]))
        elif roll < 0.8:
            argv += [rng.choice(["--log-dir", "--report", "--events", "--trace", "--memory-plot"]),
                     rng.choice(out.paths)]
        else:
            argv.append(rng.choice(SWITCHES))
    for i in range(rng.choice([0, 1, 1, 1, 2, 3])):
        if i:
            argv.append(":")
        if rng.random() < 0.15:
            argv += ["-m", rng.choice(["pkg.train", "json.tool", "-x", "", "a" * 300])]
        else:
            argv.append(rng.choice(out.scripts))
        argv += [rng.choice(WORDS + ["--lr", "0.1", "--dry-run"]) for _ in range(rng.randint(0, 3))]
    if rng.random() < 0.2:  # options after the jobs (a recipe's, or a script's own)
        argv += [rng.choice(list(FLAGS) + SWITCHES) for _ in range(rng.randint(1, 2))]
    return argv


def recipe_text(rng: random.Random, out: Outputs) -> str:
    """A recipe: built from keys good and bad, or a good one cut or garbled."""
    if rng.random() < 0.2:
        text = recipe_text(rng, out) if rng.random() < 0.3 else GOOD_RECIPE.format(script=NO_GUARD)
        cut = rng.randrange(len(text) + 1)
        noise = rng.choice(["", "[", "{", ":", "- ", "\t", "*a", "&a ", "!!python/object:os.system ", "'", "\x00"])
        return text[:cut] + noise + text[cut + rng.randint(0, 5):]
    good = good_values(out)
    defaults = {}
    for _ in range(rng.randint(0, 4)):
        key = rng.choice([*OPTION_VALUES] * 10 + ["devise", "run_id"])
        defaults[key] = pick(rng, good.get(key, []), out)
    jobs = []
    for _ in range(rng.choice([0, 1, 1, 1, 2, 2, 3])):
        job = {"script": rng.choice(out.scripts[:2] * 15 + out.scripts)}
        for _ in range(rng.randint(0, 4)):
            key = rng.choice([*JOB_VALUES] * 6 + ["sweep"] * 4 + ["module", "arg"])
            job[key] = sweep(rng) if key == "sweep" else pick(rng, good.get(key, []), out)
        jobs.append(job)
    document = {"defaults": defaults, "jobs": jobs} if rng.random() < 0.95 else rng.choice([jobs, "jobs", None, 3])
    return yaml.safe_dump(document, allow_unicode=True, width=100_000)


GOOD_RECIPE = """\
defaults: {{policy: concurrent, timeout: 1h, retries: 1, halt: soon}}
jobs:
  - script: {script}
    args: --lr {{lr}} --seed {{repeat}}
    repeat: 2
    sweep: {{grid: {{lr: [0.1, 0.01]}}}}
"""


OPTION_VALUES = {
    "device": ["cpu", "auto"], "memory_limit": ["2GiB", "80%", 0.5, 2e9], "policy": ["concurrent", "waterwave"],
    "max_concurrent": [1, 3], "queue": ["fifo", "las"], "timeout": ["1h", 90], "retries": [0, 2],
    "halt": ["never", "soon", "now"], "grace_period_s": [0, 2.5], "tee": [True], "quiet": [False],
    "engines": [2, 3], "gpus": ["all", 2, [0, 1]], "ray": ["local", "auto"], "shard": ["0/2", "1/2"],
}
JOB_VALUES = {
    "name": ["a", "b-{repeat}"], "args": ["--lr 1", ["--x", 1, True]], "env": [{"A": 1}], "priority": [1, -1],
    "timeout": ["30s"], "retries": [1], "stdin": [True], "repeat": [2, 3], "memory_limit": ["1GiB"],
    "memory": ["1GiB", "50%"],
}


def good_values(out: Outputs) -> dict[str, list]:
    paths = {"log_dir": [str(out.root / "logs")], "report": [str(out.root / "out.json")], "cwd": [str(out.root)]}
    return {**OPTION_VALUES, **JOB_VALUES, **paths}


def pick(rng: random.Random, good: list, out: Outputs):
    """Mostly a value that key takes, sometimes anything."""
    return rng.choice(good) if good and rng.random() < 0.85 else rng.choice(value_pool(rng, out))


def value_pool(rng: random.Random, out: Outputs) -> list:
    return [None, True, False, 0, 1, -1, 2, 1.5, 0.5, 2e9, 10**30, "", "x", "2GiB", "80%", "1h", "soon", "never",
            "cpu", [], [1, "a"], {}, {"A": 1}, {"A": {"b": 1}}, "--lr 1 'x", "a" * 5000, *out.paths[:4]]


def sweep(rng: random.Random):
    if rng.random() < 0.2:
        return rng.choice([None, [], "grid", {"grd": {}}, {"grid": {}}, {"zip": {"a": [1], "b": [1, 2]}}])
    size = rng.choice([1, 2, 10, 1000])
    return {"grid": {key: list(range(size)) for key in rng.sample("abcd", rng.randint(1, 4))}}


# ----------------------------------------------------------------------------- running a vector


@contextlib.contextmanager
def hang_guard(seconds: int):
    def hung(signum, frame):
        raise TimeoutError(f"took more than {seconds}s")

    previous = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with hang_guard(HANG_S), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(argv)
        except SystemExit as exit_info:  # argparse: --help, --version, a usage error
            code = exit_info.code
    return code, out.getvalue(), err.getvalue()


def check(argv: list[str], tmp_path: Path, what: str) -> int:
    """Run one vector; assert the front door's promise. Returns its exit code."""
    code, out, err = run_cli(argv)
    shown = f"{what}: {argv!r:.600}"
    assert "Traceback" not in err, f"{shown}\n{err[-3000:]}"
    assert code in (0, 2), f"{shown} exited {code}: {err[-1000:]}"
    if code == 2:
        assert err.count("\n") == 1 and err.startswith("wwrun: error: "), f"{shown}\n{err!r:.1000}"
        return code
    assert err == "", f"{shown}\n{err!r:.1000}"
    if "--help" in argv or "--version" in argv:
        return code
    # A dry run prints a recipe that reads back as the same jobs.
    dumped = tmp_path / "dumped.yaml"
    dumped.write_text(out)
    again, out_again, err_again = run_cli(["--dry-run", str(dumped)])
    assert again == 0, f"{shown}: its dump was refused: {err_again}"
    assert yaml.safe_load(out_again)["jobs"] == yaml.safe_load(out)["jobs"]
    return code


@pytest.fixture
def no_launch(monkeypatch):
    """A dry run never launches: fail loudly if one tries."""
    import wwrun.launcher

    def tripwire(config, **kwargs):
        raise AssertionError("a dry run launched jobs")

    monkeypatch.setattr(wwrun.launcher, "launch", tripwire)


def tally(codes: list[int], kind: str) -> None:
    print(f"\n{kind}: {len(codes)} tried, {len(codes)} held ({codes.count(0)} accepted, {codes.count(2)} refused)")


@pytest.mark.parametrize("seed", range(3))
def test_generated_command_lines(seed, tmp_path, no_launch, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = Outputs(tmp_path)
    (tmp_path / "r.yaml").write_text(GOOD_RECIPE.format(script=NO_GUARD))
    rng = random.Random(seed)
    codes = [check(["--dry-run", *cli_vector(rng, out)], tmp_path, f"seed {seed}") for _ in range(120)]
    tally(codes, f"command lines, seed {seed}")
    assert codes.count(0) >= 5 and codes.count(2) >= 5  # the generator reaches both sides


@pytest.mark.parametrize("seed", range(3))
def test_generated_recipes(seed, tmp_path, no_launch, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = Outputs(tmp_path)
    rng = random.Random(1000 + seed)
    codes = []
    for i in range(80):
        recipe = tmp_path / rng.choice(["r.yaml", "r.yml", "r.json"])
        recipe.write_text(recipe_text(rng, out), encoding="utf-8", errors="surrogateescape")
        after = cli_vector(rng, out)[:2] if rng.random() < 0.3 else []  # options may follow a recipe
        codes.append(check(["--dry-run", str(recipe), *after], tmp_path, f"seed {seed} recipe {i}"))
    tally(codes, f"recipes, seed {seed}")
    assert codes.count(0) >= 3 and codes.count(2) >= 3


def test_a_sample_through_the_real_entry_point(tmp_path):
    """`python -m wwrun`: exit 0, or 2 with one line, whatever the input (no tripwire here,
    so every vector is a dry run, or refused before anything runs)."""
    out = Outputs(tmp_path)
    rng = random.Random(7)
    samples = [["--dry-run", *cli_vector(rng, out)] for _ in range(6)]
    samples += [["--dry-run", "--memory-limit", "9" * 30 + "GiB", NO_GUARD], ["-n", "0", NO_GUARD],
                ["--dryrun", NO_GUARD], [str(tmp_path / "a_file") + ".yaml", ":", NO_GUARD]]
    for argv in samples:
        argv = [a.replace("\x00", "") for a in argv]  # a real argv cannot hold NUL
        done = subprocess.run([sys.executable, "-m", "wwrun", *argv], capture_output=True, text=True,
                              timeout=60, cwd=tmp_path)
        assert "Traceback" not in done.stderr, f"{argv!r:.600}\n{done.stderr[-3000:]}"
        assert done.returncode in (0, 2), f"{argv!r:.600}\n{done.stderr[-1000:]}"
        if done.returncode == 2:
            assert done.stderr.count("\n") == 1, f"{argv!r:.600}\n{done.stderr!r:.1000}"
