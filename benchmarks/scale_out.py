"""Scale out on one machine: a 12-job sweep on 2 CPU engines (each its own process)
against 1 engine and against `--policy sequential`, and the same 2 engines as Ray
actors against the local driver.

(1) wall time of the sweep (the whole `wwrun` process, start-up included, and the
    jobs' span from the first start to the last end, from the report):
    2 engines vs 1 engine, 2 engines vs sequential, Ray vs local processes.
(2) placement overhead per job: 12 jobs that do nothing, one at a time per engine
    (--max-concurrent 1), so each job's cycle is placement, the round trip to its
    engine and the engine starting it; against the same 12 on one engine in-process.
    Also the time of one placement decision (`placement.choose`) alone.

Every job uses one intra-op thread (OMP_NUM_THREADS=1), as the other benchmarks: on
2 cores, more would measure OpenMP's spinning, not wwrun. Medians of --repeats runs,
variants interleaved. The last line is one JSON object; --save also writes it to a
file (benchmarks/results/scale_out-cpu.json). Its `allocator` is the one every run
recorded (a one-engine run in its report, each engine of a scale-out run in the
report's `engines`); a run on another than wwrun's stops the benchmark
(benchmarks/measured.py).

    python benchmarks/scale_out.py [--repeats 1] [--steps 400] [--no-ray] [--save FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from measured import WWRUN, measured_on  # noqa: E402  benchmarks/measured.py, beside this script

SCRIPT = ROOT / "recipes" / "examples" / "mlp.py"
NOOP = ROOT / "tests" / "scripts" / "ending.py"
JOBS = 12


def sweep_recipe(folder: Path, steps: int) -> Path:
    recipe = folder / "sweep.yaml"
    lrs = [round(0.01 * (i + 1), 2) for i in range(JOBS)]
    recipe.write_text(
        f"jobs:\n  - script: {SCRIPT}\n    args: --steps {steps} --lr {{lr}} --device cpu\n"
        f"    sweep: {{grid: {{lr: {lrs}}}}}\n"
    )
    return recipe


def noop_recipe(folder: Path) -> Path:
    recipe = folder / "noop.yaml"
    recipe.write_text(f"jobs:\n  - script: {NOOP}\n    args: ok 0 {{i}}\n    sweep: {{grid: {{i: {list(range(JOBS))}}}}}\n")
    return recipe


def timed_run(argv: list[str], env: dict, report: Path) -> tuple[float, float, dict]:
    """(process wall time, the jobs' span, the report) of one wwrun run."""
    start = time.perf_counter()
    done = subprocess.run(argv + ["--report", str(report)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          env=env, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(argv)}\n{done.stderr[-3000:]}")
    data = json.loads(report.read_text())
    from datetime import datetime

    starts = [datetime.fromisoformat(j["started"]).timestamp() for j in data["jobs"]]
    ends = [s + j["wall_s"] for s, j in zip(starts, data["jobs"])]
    return wall, max(ends) - min(starts), data


def run_allocators(data: dict) -> list[str]:
    """The allocators a run's report records: its own, or each engine's."""
    run = data["run"]
    return [e["allocator"] for e in run["engines"]] if "engines" in run else [run["allocator"]]


def choose_cost_s(engines: int = 8, repeats: int = 20000) -> float:
    from wwrun.scale.placement import EngineView, choose

    views = [EngineView(index=i, capacity=(i + 1) << 30, slots=8, running=i % 3, committed=i << 28)
             for i in range(engines)]
    start = time.perf_counter()
    for i in range(repeats):
        choose((i % 7) << 27, views)
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--steps", type=int, default=400, help="training steps of each sweep job")
    parser.add_argument("--no-ray", action="store_true", help="leave out the Ray variant")
    parser.add_argument("--save", help="also write the JSON to this file")
    args = parser.parse_args()
    ray = not args.no_ray
    if ray:
        import importlib.util

        if importlib.util.find_spec("ray") is None:
            print("ray is not installed (pip install 'wwrun[ray]'): leaving out the Ray variant")
            ray = False

    folder = Path(tempfile.mkdtemp(prefix="wwrun-scale-bench-"))
    sweep, noop = sweep_recipe(folder, args.steps), noop_recipe(folder)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    base = [sys.executable, "-m", "wwrun", "--quiet", "--device", "cpu", "--log-dir", str(folder / "logs")]
    variants = {
        "two_engines": [*base, "--engines", "2", str(sweep)],
        "one_engine": [*base, str(sweep)],
        "sequential": [*base, "--policy", "sequential", str(sweep)],
        "noop_two_engines": [*base, "--engines", "2", "--max-concurrent", "1", str(noop)],
        "noop_one_engine": [*base, "--max-concurrent", "1", str(noop)],
    }
    if ray:
        variants["ray_two_engines"] = [*base, "--ray", "--engines", "2", str(sweep)]
    load = os.getloadavg()[0]
    wall: dict[str, list[float]] = {k: [] for k in variants}
    span: dict[str, list[float]] = {k: [] for k in variants}
    placed: dict[str, list[int]] = {}
    for r in range(args.repeats):
        for name, argv in variants.items():
            w, s, data = timed_run(argv, env, folder / f"{name}-{r}.json")
            for used in run_allocators(data):
                measured_on(used, WWRUN, f"wwrun ({name})")
            wall[name].append(w)
            span[name].append(s)
            if "engines" in data["run"]:
                placed[name] = [sum(1 for j in data["jobs"] if j["engine"] == e["engine"]) for e in data["run"]["engines"]]
            print(f"  {name:18s} wall {w:6.2f}s   jobs' span {s:6.2f}s", flush=True)
    wall_m = {k: statistics.median(v) for k, v in wall.items()}
    span_m = {k: statistics.median(v) for k, v in span.items()}
    cycle_two = span_m["noop_two_engines"] / (JOBS / 2)
    cycle_one = span_m["noop_one_engine"] / JOBS
    figures = {
        "two_vs_one_engine_speedup": round(wall_m["one_engine"] / wall_m["two_engines"], 3),
        "two_vs_one_engine_span_speedup": round(span_m["one_engine"] / span_m["two_engines"], 3),
        "two_engines_vs_sequential_speedup": round(wall_m["sequential"] / wall_m["two_engines"], 3),
        "placement_cycle_per_job_s": round(cycle_two, 4),
        "in_process_cycle_per_job_s": round(cycle_one, 4),
        "placement_overhead_per_job_s": round(cycle_two - cycle_one, 4),
        "choose_s": round(choose_cost_s(), 9),
    }
    if ray:
        figures["ray_vs_local_driver_wall_ratio"] = round(wall_m["ray_two_engines"] / wall_m["two_engines"], 3)
        figures["ray_vs_local_driver_span_ratio"] = round(span_m["ray_two_engines"] / span_m["two_engines"], 3)
    print(f"{JOBS}-job sweep (mlp.py --steps {args.steps}), {os.cpu_count()} cpus, 1 thread per job, "
          f"medians of {args.repeats}")
    print(f"  2 engines vs 1 engine     {figures['two_vs_one_engine_speedup']:.2f}x (wall)   "
          f"{figures['two_vs_one_engine_span_speedup']:.2f}x (jobs' span)")
    print(f"  2 engines vs sequential   {figures['two_engines_vs_sequential_speedup']:.2f}x")
    print(f"  placement per job         {cycle_two * 1e3:.1f} ms a cycle on 2 engines vs {cycle_one * 1e3:.1f} ms "
          f"in-process; one decision {figures['choose_s'] * 1e6:.1f} us")
    if ray:
        print(f"  Ray vs local processes    {figures['ray_vs_local_driver_wall_ratio']:.2f}x the wall time, "
              f"{figures['ray_vs_local_driver_span_ratio']:.2f}x the jobs' span")
    import torch

    line = json.dumps({
        "benchmark": "scale_out",
        "device": "cpu",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "threads_per_job": 1,
        "command": " ".join(["python", "benchmarks/scale_out.py", *sys.argv[1:]]),
        "jobs": JOBS,
        "steps": args.steps,
        "repeats": args.repeats,
        "load_average_at_start": round(load, 2),
        "allocator": WWRUN,  # every run's and every engine's, checked as it ended
        "median_wall_s": {k: round(v, 3) for k, v in wall_m.items()},
        "median_span_s": {k: round(v, 3) for k, v in span_m.items()},
        "jobs_per_engine": placed,
        **figures,
    })
    if args.save:
        Path(args.save).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
