"""wwrun.scale: several engines, each its own process (or Ray actor), and the driver
that places jobs on them by memory. Engines are CPU engines with their own
--memory-limit, so the whole placement runs without a GPU."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from wwrun import ConfigError, JobSpec, JobState, LaunchConfig, launch
from wwrun.cli import main as cli_main
from wwrun.config import parse_shard, select_shard
from wwrun.scale import needs_driver, plan
from wwrun.scale.placement import EngineView, Estimates, choose

SCRIPTS = Path(__file__).parent / "scripts"
ENDING = str(SCRIPTS / "ending.py")
MLP = str(SCRIPTS / "train_mlp.py")
VICTIM = str(SCRIPTS / "engine_victim.py")
CRASH = str(SCRIPTS / "crash.py")
MIB = 1 << 20
# train_mlp.py --width 1024 --batch 64 measures about 33 MiB (parameters, gradients,
# activations): it fits an engine of 128 MiB, and not one of 24 MiB.
BIG = ["--width", "1024", "--batch", "64", "--steps", "3"]
LIMITS = "24MiB,128MiB"


def ending(name, how="ok", delay=0.0, **fields):
    return JobSpec(name=name, script=ENDING, args=[how, str(delay)], **fields)


def big(name, **fields):
    return JobSpec(name=name, script=MLP, args=list(BIG), **fields)


def run(tmp_path, *jobs, **options):
    options.setdefault("quiet", True)
    options.setdefault("device", "cpu")
    return launch(LaunchConfig(jobs=list(jobs), log_dir=str(tmp_path / "logs"), **options))


def report_of(result) -> dict:
    return json.loads((Path(result.log_dir) / "report.json").read_text())


def overlaps(a, b) -> bool:
    return a.started < b.ended and b.started < a.ended


# ----------------------------------------------------------------------------- placement (pure)


def view(index, capacity, **fields):
    return EngineView(index=index, capacity=capacity, slots=fields.pop("slots", 4), **fields)


def test_a_job_that_fits_only_the_larger_engine_goes_there():
    engines = [view(0, 64 * MIB), view(1, 256 * MIB)]
    assert choose(100 * MIB, engines) == 1
    assert choose(10 * MIB, engines) == 0  # both fit, both idle: the tighter fit keeps the large one free


def test_known_jobs_go_to_the_engine_running_fewest_then_wait_for_room():
    engines = [view(0, 256 * MIB, running=1, committed=10 * MIB), view(1, 256 * MIB)]
    assert choose(10 * MIB, engines) == 1
    full = [view(0, 64 * MIB, running=1, committed=60 * MIB), view(1, 64 * MIB, running=1, live=60 * MIB)]
    assert choose(10 * MIB, full) is None  # fits an engine once a job there ends: it waits
    assert choose(10 * MIB, [view(0, None, slots=1, running=1)]) is None  # no free slot
    assert choose(0.5, [view(0, 100 * MIB, running=1, committed=60 * MIB), view(1, 400 * MIB)]) == 1


def test_a_job_larger_than_every_engine_goes_to_the_largest_once_it_is_idle():
    engines = [view(0, 64 * MIB), view(1, 128 * MIB, running=1)]
    assert choose(1 << 40, engines) is None
    engines[1].running = 0
    assert choose(1 << 40, engines) == 1


def test_unknown_jobs_go_where_the_most_room_is_one_profiled_at_a_time():
    engines = [view(0, 64 * MIB), view(1, 256 * MIB, running=1, committed=100 * MIB)]
    assert choose(None, engines) == 1
    engines[1].profiling = 1
    assert choose(None, engines) == 0
    engines[0].profiling = 1
    assert choose(None, engines) is None
    assert choose(None, [view(0, None, profiling=3), view(1, None, running=1)]) == 0  # no budget: no gate


def test_engines_a_job_failed_on_come_last_and_dead_engines_never():
    engines = [view(0, 256 * MIB), view(1, 256 * MIB)]
    assert choose(MIB, engines, avoid=frozenset({0})) == 1
    assert choose(None, engines, avoid=frozenset({0})) == 1
    engines[1].alive = False
    assert choose(MIB, engines, avoid=frozenset({0})) == 0


def test_estimates_keep_the_largest_sibling_peak_and_a_hint_wins():
    estimates = Estimates()
    estimates.record("a.py", 10)
    estimates.record("a.py", 30)
    estimates.record("a.py", 20)
    assert estimates.of("a.py", None) == 30 and estimates.of("a.py", 5) == 5 and estimates.of("b.py", None) is None


# ----------------------------------------------------------------------------- options


def test_scale_options_are_checked_with_one_line_errors():
    job = ending("a")
    for fields, message in [
        ({"engines": 0}, "engines: must be at least 1, got 0"),
        ({"shard": "3/2"}, "shard: '3/2': i counts from 0"),
        ({"shard": "1/0"}, "shard: '1/0': n must be at least 1"),
        ({"shard": "half"}, "shard: expected i/n"),
        ({"gpus": "x"}, "gpus: expected all, a count N or indices"),
        ({"gpus": "0"}, "gpus: must be at least 1 GPU"),
        ({"ray": ""}, "ray: expected local, auto or a cluster address"),
        ({"memory_limit": "1GiB,lots"}, "memory_limit: not a memory size: 'lots'"),
    ]:
        with pytest.raises(ConfigError) as caught:
            LaunchConfig(jobs=[job], **fields)
        assert str(caught.value).startswith(message), caught.value
    with pytest.raises(ConfigError, match="memory: not a memory size"):
        ending("b", memory="big")
    assert ending("b", memory="2GiB").memory == 2 << 30
    assert LaunchConfig(jobs=[job], gpus=[0, 2]).gpus == "0,2"
    assert LaunchConfig(jobs=[job], memory_limit="1GiB,50%").memory_limit == [1 << 30, 0.5]
    with pytest.raises(ConfigError, match="^memory_limit: not a memory size: a list of 1"):
        LaunchConfig(jobs=[job], memory_limit=["1GiB"])


def test_engine_plans_on_a_machine_without_gpus():
    job = ending("a")
    assert plan(LaunchConfig(jobs=[job], device="cpu", engines=3)).count == 3
    p = plan(LaunchConfig(jobs=[job], device="cpu", memory_limit="24MiB,128MiB"))
    assert (p.count, p.limits) == (2, (24 * MIB, 128 * MIB))
    with pytest.raises(ConfigError, match="^memory_limit: 2 limits for 3 engine"):
        plan(LaunchConfig(jobs=[job], device="cpu", engines=3, memory_limit="1GiB,2GiB"))
    with pytest.raises(ConfigError, match="^gpus: needs CUDA devices"):
        plan(LaunchConfig(jobs=[job], device="cpu", gpus="7"))
    assert not needs_driver(LaunchConfig(jobs=[job], device="cpu"))
    assert not needs_driver(LaunchConfig(jobs=[job], device="cpu", engines=1))
    assert needs_driver(LaunchConfig(jobs=[job], device="cpu", engines=2))


def test_gpu_selection_on_a_machine_with_four(monkeypatch):
    import wwrun.scale as scale
    from wwrun.scale.engines import _physical_gpu

    monkeypatch.setattr(scale, "_device_of", lambda config: "cuda")
    monkeypatch.setattr(scale, "_visible_gpus", lambda: 4)
    job = ending("a")
    assert plan(LaunchConfig(jobs=[job])).gpus == (0, 1, 2, 3)  # default: every GPU it sees
    assert needs_driver(LaunchConfig(jobs=[job]))
    assert plan(LaunchConfig(jobs=[job], gpus="0,2")).gpus == (0, 2)
    assert plan(LaunchConfig(jobs=[job], gpus="2")).gpus == (0, 1)  # a count
    assert plan(LaunchConfig(jobs=[job], gpus="3,")).gpus == (3,)  # one index
    assert needs_driver(LaunchConfig(jobs=[job], gpus="3,")) and not needs_driver(LaunchConfig(jobs=[job], gpus="1"))
    assert plan(LaunchConfig(jobs=[job], engines=2)).gpus == (0, 1)
    p = plan(LaunchConfig(jobs=[job], gpus="1,3", memory_limit="10GiB,50%"))
    assert p.limits == (10 << 30, 0.5)
    for fields, message in [
        ({"gpus": "7,"}, "^gpus: no GPU 7 here: this process sees 4 \\(0 to 3\\)"),
        ({"gpus": "5"}, "^gpus: 5 GPUs asked for and this process sees 4"),
        ({"gpus": "0,0"}, "^gpus: '0,0' names a GPU twice"),
        ({"engines": 6}, "^engines: 6 engines, one per GPU, and this machine shows 4 GPU"),
        ({"engines": 3, "gpus": "0,1"}, "^engines: 3 engines for 2 GPU"),
    ]:
        with pytest.raises(ConfigError, match=message):
            plan(LaunchConfig(jobs=[job], **fields))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6")
    assert _physical_gpu(1) == "5"  # an engine for the 2nd visible GPU sees the physical GPU 5 alone
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert _physical_gpu(1) == "1"


@pytest.mark.parametrize("argv, message", [
    (["--engines", "0"], "wwrun: error: --engines: must be at least 1, got 0"),
    (["--shard", "3/2"], "wwrun: error: --shard: '3/2': i counts from 0, so it must be below n"),
    (["--device", "cpu", "--gpus", "7"], "wwrun: error: --gpus: needs CUDA devices"),
    (["--device", "cpu", "--engines", "2", "--trace", "t.json"], "wwrun: error: --trace: observes one engine"),
    (["--device", "cpu", "--memory-limit", "1GiB,2GiB"], None),
])
def test_cli_refuses_bad_scale_options(tmp_path, capsys, argv, message):
    code = cli_main([*argv, "--log-dir", str(tmp_path), "--dry-run", ENDING])
    err = capsys.readouterr().err
    if message is None:
        assert code == 0, err
        return
    assert code == 2 and err.count("\n") == 1 and err.startswith(message), err


def test_ray_without_ray_installed_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    code = cli_main(["--ray", "--device", "cpu", "--log-dir", str(tmp_path), "--dry-run", ENDING])
    err = capsys.readouterr().err
    assert code == 2 and err == "wwrun: error: --ray: needs Ray, which is not installed (pip install 'wwrun[ray]')\n"


def test_ray_address_is_optional_on_the_command_line():
    from wwrun.cli import config_from_args, parse_args

    assert config_from_args(parse_args(["--ray", ENDING, "ok"])).ray == "local"
    config = config_from_args(parse_args(["--ray", "10.0.0.1:6379", ENDING, "ok"]))
    assert config.ray == "10.0.0.1:6379" and config.jobs[0].args == ["ok"]
    assert config_from_args(parse_args(["--ray=auto", ENDING])).ray == "auto"


# ----------------------------------------------------------------------------- shards


def test_shard_i_of_n_takes_every_nth_job_from_i_counting_from_0():
    jobs = [ending(f"j{i}") for i in range(7)]
    config = LaunchConfig(jobs=jobs, shard="1/3")
    assert [j.name for j in select_shard(config).jobs] == ["j1", "j4"]
    assert select_shard(config).shard is None
    slices = [select_shard(config.replace(shard=f"{i}/3")).jobs for i in range(3)]
    assert sorted(j.name for s in slices for j in s) == sorted(j.name for j in jobs)  # each job once
    assert parse_shard("0/1") == (0, 1)
    with pytest.raises(ConfigError, match="^shard: 5/8 selects no job: there are 3 jobs"):
        select_shard(LaunchConfig(jobs=jobs[:3], shard="5/8"))


def test_shard_of_a_recipe_sweep_on_the_command_line(tmp_path, capsys):
    recipe = tmp_path / "sweep.yaml"
    recipe.write_text(
        "defaults: {engines: 2, memory_limit: [24MiB, 128MiB]}\n"
        f"jobs:\n  - script: {ENDING}\n    args: ok {{d}}\n    memory: 10MiB\n"
        "    sweep: {grid: {d: [0.1, 0.2, 0.3, 0.4, 0.5]}}\n"
    )
    code = cli_main([str(recipe), "--shard", "1/2", "--dry-run", "--device", "cpu"])
    out = capsys.readouterr().out
    import yaml

    dumped = yaml.safe_load(out)
    assert code == 0
    assert [j["name"] for j in dumped["jobs"]] == ["ending-d0.2", "ending-d0.4"]
    assert dumped["jobs"][0]["memory"] == 10 * MIB
    assert dumped["defaults"]["engines"] == 2 and dumped["defaults"]["memory_limit"] == [24 * MIB, 128 * MIB]


def test_recipe_scale_keys_are_checked(tmp_path):
    from wwrun import load_recipe

    for text, message in [
        ("defaults: {engines: 0}\n", "defaults.engines: must be at least 1, got 0"),
        ("defaults: {gpus: lots}\n", "defaults.gpus: expected all, a count N or indices"),
        ("defaults: {shard: 2/2}\n", "defaults.shard: '2/2': i counts from 0"),
        ("defaults: {enignes: 2}\n", "defaults.enignes: unknown key (did you mean 'engines'?)"),
    ]:
        recipe = tmp_path / "r.yaml"
        recipe.write_text(text + f"jobs: [{{script: {ENDING}}}]\n")
        with pytest.raises(ConfigError) as caught:
            load_recipe(recipe)
        assert str(caught.value) == f"{recipe}: {message}" or str(caught.value).startswith(f"{recipe}: {message}")
    recipe.write_text(f"jobs: [{{script: {ENDING}, memory: 1GB, memroy: 2}}]\n")
    with pytest.raises(ConfigError, match=r"jobs\[0\]\.memroy: unknown key \(did you mean 'memory'\?\)"):
        load_recipe(recipe)


# ----------------------------------------------------------------------------- engine processes


def test_placement_by_measured_memory_across_two_engines(tmp_path):
    events = tmp_path / "events.jsonl"
    report = tmp_path / "report.json"
    result = run(tmp_path, big("big-0"), big("big-1"), big("big-2"), ending("small-0"), ending("small-1"),
                 memory_limit=LIMITS, events=str(events), report=str(report))
    jobs = {j.name: j for j in result.jobs}
    assert result.exit_code == 0, [(j.name, j.state, j.error) for j in result.jobs]
    # The first big job goes where the most room is and is profiled there; its figure
    # keeps its siblings off the 24 MiB engine, where they would fail (JobTooLarge).
    assert [jobs[f"big-{i}"].extra["engine"] for i in range(3)] == [1, 1, 1]
    assert all(jobs[f"big-{i}"].extra["peak_memory_bytes"] > 24 * MIB for i in range(3))
    data = json.loads(report.read_text())
    assert data == report_of(result)  # the merged report, in the run's folder and --report
    assert data["run"]["scale"] == "process" and [e["memory_limit_bytes"] for e in data["run"]["engines"]] == [
        24 * MIB, 128 * MIB]
    assert {e["state"] for e in data["run"]["engines"]} == {"ended"}
    assert {e["allocator"] for e in data["run"]["engines"]} == {"waterwave"}  # each engine's own record
    assert all("engine" in j for j in data["jobs"])
    # Logs where they always were: <run>/<job>/, each engine's own files apart.
    run_dir = Path(result.log_dir)
    assert "final loss" in (run_dir / "big-2" / "stdout.log").read_text()
    assert (run_dir / "engine-0" / result.run_id / "report.json").exists()
    states = [json.loads(line) for line in events.read_text().splitlines()]
    assert [e["state"] for e in states if e["job"] == "small-1"][-1] == "succeeded"
    assert {e["run_id"] for e in states} == {result.run_id}
    from wwrun.display import summary_lines

    header, *rows = summary_lines(result)[1:6]
    assert header.split()[:5] == ["job", "state", "exit", "time", "engine"]
    assert rows[0].split()[:2] == ["big-0", "succeeded"] and rows[0].split()[4] == "1"


def test_a_memory_hint_places_a_job_before_anything_measured_it(tmp_path):
    # Hinted as 100 MiB: only the 128 MiB engine can take it, even while it is busy.
    result = run(tmp_path, ending("busy", delay=1.0, memory="64MiB"), ending("hinted", memory="100MiB"),
                 memory_limit=LIMITS)
    busy, hinted = result.jobs
    assert (busy.extra["engine"], hinted.extra["engine"]) == (1, 1)
    assert hinted.started >= busy.ended - 0.05  # it waited for room there, not for the small engine
    assert result.exit_code == 0


def test_a_job_out_of_memory_on_one_engine_is_retried_on_another(tmp_path):
    # Hinted far too small, it goes to the tighter fit (24 MiB), fails there (the
    # allocator refuses it, or the engine's JobTooLarge), and its retry goes to the
    # engine it did not fail on.
    result = run(tmp_path, big("underestimated", memory="1MiB"), memory_limit=LIMITS, retries=1)
    job = result.jobs[0]
    assert job.state == JobState.SUCCEEDED and job.extra["attempts"] == 2 and job.extra["engine"] == 1
    first = json.loads((Path(result.log_dir) / "underestimated" / "attempt_0" / "error.json").read_text())
    assert "JobTooLarge" in first["error"] or "OutOfMemoryError" in first["error"]


def test_the_queue_runs_across_three_engines(tmp_path):
    jobs = [ending(f"j{i}", delay=0.6) for i in range(6)]
    result = run(tmp_path, *jobs, engines=3, memory_limit="32MiB,64MiB,128MiB", max_concurrent=1)
    assert result.exit_code == 0
    on = {}
    for job in result.jobs:
        on.setdefault(job.extra["engine"], []).append(job)
    assert set(on) == {0, 1, 2}  # every engine took jobs from the one queue
    for ran in on.values():  # max_concurrent holds per engine
        assert not any(overlaps(a, b) for a in ran for b in ran if a is not b)
    span = max(j.ended for j in result.jobs) - min(j.started for j in result.jobs)
    assert span < sum(j.wall_s for j in result.jobs)  # engines ran jobs at the same time


def _kill_engine_when_marked(mark: Path, killed: list):
    def watch():
        deadline = time.monotonic() + 120
        while not mark.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        if mark.exists():
            pid = int(mark.read_text())
            assert pid != os.getpid()
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    return thread


def test_an_engine_killed_mid_run_loses_only_its_jobs_which_are_retried(tmp_path):
    mark, killed = tmp_path / "victim.pid", []
    watcher = _kill_engine_when_marked(mark, killed)
    jobs = [JobSpec(name="victim", script=VICTIM, args=[str(mark)]),
            *(ending(f"other{i}", delay=0.3) for i in range(3))]
    result = run(tmp_path, *jobs, engines=2, retries=1, max_concurrent=1)
    watcher.join(5)
    assert killed
    victim, *others = result.jobs
    assert all(j.state == JobState.SUCCEEDED for j in others)
    assert victim.state == JobState.SUCCEEDED and victim.extra["attempts"] == 2
    first = json.loads((Path(result.log_dir) / "victim" / "attempt_0" / "error.json").read_text())
    assert first["exit_code"] == 137 and "SIGKILL" in first["error"]
    engines = report_of(result)["run"]["engines"]
    dead = victim.extra["engine"] ^ 1
    assert engines[dead]["state"] == "died" and engines[dead]["pid"] == killed[0]
    assert "again, elsewhere" in (Path(result.log_dir) / "victim" / "attempt_1" / "stdout.log").read_text()


def test_a_segfault_ends_its_engine_alone_and_is_reported(tmp_path):
    result = run(tmp_path, JobSpec(name="crash", script=CRASH, args=["0.5"]),
                 *(ending(f"fine{i}", delay=0.5) for i in range(2)), engines=2, max_concurrent=1)
    crash, *fine = result.jobs
    assert (crash.state, crash.exit_code) == (JobState.FAILED, 139)
    assert "SIGSEGV" in crash.error and "died" in crash.error
    assert all(j.state == JobState.SUCCEEDED for j in fine)
    assert all(j.extra["engine"] != crash.extra["engine"] for j in fine if j.started > crash.ended)
    assert result.exit_code == 139 and result.root_cause == "crash"


def test_ctrl_c_stops_every_engine(tmp_path):
    report, events, logs = tmp_path / "r.json", tmp_path / "events.jsonl", tmp_path / "logs"
    command = [sys.executable, "-m", "wwrun", "--device", "cpu", "--engines", "2", "--report", str(report),
               "--events", str(events), "--log-dir", str(logs), "--grace-period", "5s",
               ENDING, "loop", ":", ENDING, "loop", ":", ENDING, "ok"]
    with open(tmp_path / "err.txt", "w") as err_file:
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err_file)

    def settled() -> bool:  # both loops ready, the third job ended well
        if not events.exists():
            return False
        lines = [json.loads(line) for line in events.read_text().splitlines() if line.endswith("}")]
        if not any(e["job"] == "ending-3" and e["state"] == "succeeded" for e in lines):
            return False
        run_dir = logs / lines[0]["run_id"]
        return all("ready" in _read(run_dir / name / "stdout.log") for name in ("ending", "ending-2"))

    deadline = time.monotonic() + 120
    try:
        while not settled() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert settled()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    err = (tmp_path / "err.txt").read_text()
    assert proc.returncode == 130, err
    data = json.loads(report.read_text())
    states = {j["name"]: j["state"] for j in data["jobs"]}
    assert states["ending"] == states["ending-2"] == "interrupted" and states["ending-3"] == "succeeded"
    assert {j["engine"] for j in data["jobs"] if j["name"] != "ending-3"} == {0, 1}
    log = Path(data["run"]["log_dir"]) / "ending" / "stdout.log"
    assert "got KeyboardInterrupt" in log.read_text()
    assert "interrupted: stopping every job on every engine" in err


def test_engines_stop_their_jobs_when_the_driver_is_killed(tmp_path):
    import psutil

    logs = tmp_path / "logs"
    command = [sys.executable, "-m", "wwrun", "--quiet", "--device", "cpu", "--engines", "2", "--log-dir", str(logs),
               "--grace-period", "2s", ENDING, "loop", ":", ENDING, "loop"]
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, pids = time.monotonic() + 120, []
    try:
        while time.monotonic() < deadline and proc.poll() is None and len(pids) < 2:
            reports = list(logs.glob("*/report.json"))
            data = json.loads(_read(reports[0]) or "{}") if reports else {}
            running = [j for j in data.get("jobs", []) if j["state"] == "running"]
            if len(running) == 2:
                pids = [e["pid"] for e in data["run"]["engines"]]
            time.sleep(0.05)
        assert len(pids) == 2 and all(psutil.pid_exists(pid) for pid in pids)
    finally:
        proc.kill()  # SIGKILL: the driver cannot tell anyone
        proc.wait(10)
    deadline = time.monotonic() + 60
    alive = pids
    while alive and time.monotonic() < deadline:
        alive = [pid for pid in alive if psutil.pid_exists(pid) and psutil.Process(pid).status() != "zombie"]
        time.sleep(0.1)
    assert not alive  # each engine saw its pipe close, interrupted its jobs and ended


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def test_with_one_engine_nothing_changes(tmp_path):
    result = run(tmp_path, ending("a"), engines=1)
    assert result.exit_code == 0 and "engine" not in result.jobs[0].extra
    assert "engines" not in report_of(result)["run"]


# ----------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray", reason="Ray is not installed (pip install 'wwrun[ray]')")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def test_ray_places_by_memory_and_merges_the_report(tmp_path, local_ray):
    result = run(tmp_path, big("big-0"), big("big-1"), ending("small"), ray="local", memory_limit=LIMITS)
    assert result.exit_code == 0, [(j.name, j.state, j.error) for j in result.jobs]
    jobs = {j.name: j for j in result.jobs}
    assert jobs["big-0"].extra["engine"] == jobs["big-1"].extra["engine"] == 1
    data = report_of(result)
    assert data["run"]["scale"] == "ray" and len(data["run"]["engines"]) == 2
    assert "final loss" in (Path(result.log_dir) / "big-1" / "stdout.log").read_text()


def test_ray_a_lost_actor_loses_only_its_jobs(tmp_path, local_ray):
    mark, killed = tmp_path / "victim.pid", []
    watcher = _kill_engine_when_marked(mark, killed)
    jobs = [JobSpec(name="victim", script=VICTIM, args=[str(mark)]), ending("other", delay=0.3)]
    result = run(tmp_path, *jobs, ray="local", engines=2, retries=1, max_concurrent=1)
    watcher.join(5)
    victim, other = result.jobs
    assert killed and other.state == JobState.SUCCEEDED
    assert victim.state == JobState.SUCCEEDED and victim.extra["attempts"] == 2
    assert [e["state"] for e in report_of(result)["run"]["engines"]].count("died") == 1


def test_ray_ctrl_c_stops_every_engine(tmp_path, local_ray):
    run_id = "ray-ctrl-c"
    logs = [tmp_path / "logs" / run_id / name / "stdout.log" for name in ("a", "b")]

    def interrupt_once_ready():
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if all(log.exists() and "ready" in log.read_text() for log in logs):
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.05)

    threading.Thread(target=interrupt_once_ready, daemon=True).start()
    result = run(tmp_path, ending("a", "loop"), ending("b", "loop"), ray="local", engines=2, run_id=run_id,
                 grace_period_s=5)
    assert [j.state for j in result.jobs] == [JobState.INTERRUPTED, JobState.INTERRUPTED]
    assert {j.extra["engine"] for j in result.jobs} == {0, 1} and result.exit_code == 130
    assert all("got KeyboardInterrupt" in log.read_text() for log in logs)


def test_engines_of_one_machine_share_its_cpus_said_once(tmp_path, monkeypatch):
    """Two engines of one job each: the two jobs share this machine's CPUs, so each
    engine's torch gets half, and the driver says so once (issue 21: each engine said
    it of its own jobs alone)."""
    import io

    from wwrun.display import PlainDisplay

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # the user's choice would win
    script = str(SCRIPTS / "torch_threads.py")
    jobs = [JobSpec(name=name, script=script) for name in ("a", "b")]
    out, err = io.StringIO(), io.StringIO()
    result = launch(LaunchConfig(jobs=jobs, log_dir=str(tmp_path / "logs"), device="cpu", engines=2,
                                 max_concurrent=1), display=PlainDisplay(out, err))
    assert result.exit_code == 0 and {j.extra["engine"] for j in result.jobs} == {0, 1}
    threads = max(1, (os.cpu_count() or 1) // 2)
    for name in ("a", "b"):
        assert (Path(result.log_dir) / name / "stdout.log").read_text() == f"torch threads {threads}\n"
    said = [line for line in err.getvalue().splitlines() if "CPUs" in line]
    assert said == [f"[wwrun] 2 jobs share {os.cpu_count()} CPUs: torch uses {threads} thread(s) per op "
                    "(set OMP_NUM_THREADS to choose)"]


def test_ray_says_nothing_of_its_own_but_errors(tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed (pip install 'wwrun[ray]')")
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--ray", "--device", "cpu", "--engines", "1", "--log-dir",
         str(tmp_path / "logs"), ENDING, "ok"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    # Ray's log lines read "2026-01-01 00:00:00,000\tWARNING file.py:85 -- Token authentication ..."
    assert not re.search(r"^\d{4}-\d\d-\d\d .*\b(INFO|WARNING)\b \S+\.py:\d+ --", done.stderr, re.M), done.stderr
