"""Launcher overhead, measured side by side in one run.

(1) one example job: `wwrun script.py` against `python script.py` (whole-process wall
    time, so wwrun's own start-up counts against it). Target: overhead <= 3%.
(2) four copies of the job: `wwrun --policy concurrent` against the same four run one
    after another with `python` (on a CPU the four share the cores: this shows what
    threads of one process cost or gain against processes in sequence).
(3) start-up: a job that only imports torch, under `wwrun` and `python`, in CPU
    seconds: wwrun's fixed cost per run (its imports and set-up), which (1) divides
    by the job's length; CPU time, as a busy machine's wall time hides 0.1 s.

Medians of --repeats runs (at least 5), runs of the variants interleaved so drifts in
machine load hit them alike. Every process and job uses --threads intra-op threads
(OMP_NUM_THREADS, default 1): with OpenMP's spin-waiting, two processes each asking
for every core turn a 0.3 s loop into 9-20 s on 2 busy cores, which would measure the
machine, not the launcher. The last line is one JSON object; its `allocator` is the
one every wwrun run recorded in its report (a run on another than wwrun's stops the
benchmark, benchmarks/measured.py), and `allocators` names each variant's.

    python benchmarks/launcher_overhead.py [--repeats 5] [--script recipes/examples/mlp.py] [-- script args]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

from measured import WWRUN, measured_on  # noqa: E402  benchmarks/measured.py, beside this script


def timed(argv: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    return time.perf_counter() - start


def report_allocator(report: Path) -> str:
    """The allocator a wwrun run served its jobs with, as its report records it."""
    return json.loads(report.read_text())["run"]["allocator"]


def cpu_timed(argv: list[str], env: dict) -> float:
    """CPU seconds (user + system) the command used: unlike wall time, barely moved
    by other work on a shared machine."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads per process and job")
    parser.add_argument("--script", default=str(ROOT / "recipes" / "examples" / "mlp.py"))
    parser.add_argument("script_args", nargs="*", default=["--steps", "3000"])
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of at least 5 runs)")

    python = [sys.executable, args.script, *args.script_args]
    logs = tempfile.mkdtemp(prefix="wwrun-bench-")
    wwrun = [sys.executable, "-m", "wwrun", "--quiet", "--log-dir", logs]
    many = []
    for i in range(args.jobs):
        many += ([":"] if i else []) + [args.script, *args.script_args]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    env_note = f"{os.cpu_count()} cpus, {args.threads} thread(s) per job"
    load = os.getloadavg()[0]  # the machine may be shared: say how busy it was

    import_only = Path(logs) / "import_torch.py"
    import_only.write_text("import torch\n")

    times: dict[str, list[float]] = {
        k: [] for k in ("python", "wwrun", "sequential", "concurrent", "python_start_cpu", "wwrun_start_cpu")
    }
    # What each variant ran on: plain python on torch's own allocator; each wwrun run
    # as its report says.
    allocators: dict[str, set[str]] = {"python": {"native"}, "wwrun": set(), "concurrent": set(), "wwrun_start": set()}
    report = Path(logs) / "report.json"

    def wwrun_run(variant: str, timer, argv: list[str]) -> float:
        seconds = timer([*wwrun, "--report", str(report), *argv], env)
        allocators[variant].add(report_allocator(report))
        return seconds

    timed(python, env)  # warm the file cache
    for _ in range(args.repeats):
        times["python"].append(timed(python, env))
        times["wwrun"].append(wwrun_run("wwrun", timed, [args.script, *args.script_args]))
        times["sequential"].append(sum(timed(python, env) for _ in range(args.jobs)))
        times["concurrent"].append(wwrun_run("concurrent", timed, ["--policy", "concurrent", *many]))
        times["python_start_cpu"].append(cpu_timed([sys.executable, str(import_only)], env))
        times["wwrun_start_cpu"].append(wwrun_run("wwrun_start", cpu_timed, [str(import_only)]))
    for variant in ("wwrun", "concurrent", "wwrun_start"):
        measured_on(",".join(sorted(allocators[variant])), WWRUN, f"wwrun ({variant})")

    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["wwrun"] / med["python"] - 1
    speedup = med["sequential"] / med["concurrent"]
    start_cost = med["wwrun_start_cpu"] - med["python_start_cpu"]
    print(f"machine: {env_note}; script: {Path(args.script).name} {' '.join(args.script_args)}; "
          f"medians of {args.repeats}")
    print(f"  one job   python {med['python']:.2f}s   wwrun {med['wwrun']:.2f}s   overhead {overhead:+.1%} (target <= 3%)")
    print(f"  {args.jobs} jobs    one after another {med['sequential']:.2f}s   wwrun concurrent "
          f"{med['concurrent']:.2f}s   speed-up {speedup:.2f}x")
    print(f"  start-up  python {med['python_start_cpu']:.2f}s   wwrun {med['wwrun_start_cpu']:.2f}s   "
          f"wwrun's fixed cost {start_cost:+.3f}s (CPU time; a job that only imports torch)")
    import torch

    print(json.dumps({
        "benchmark": "launcher_overhead",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "threads_per_job": args.threads,
        "command": " ".join(sys.argv),
        "script": Path(args.script).name,
        "script_args": args.script_args,
        "repeats": args.repeats,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "single_job_overhead": round(overhead, 4),
        "concurrent_vs_sequential_speedup": round(speedup, 3),
        "startup_cpu_cost_s": round(start_cost, 4),
        "allocator": WWRUN,  # every wwrun run's, checked above
        "allocators": {variant: ",".join(sorted(names)) for variant, names in allocators.items()},
        "load_average_at_start": round(load, 2),
    }))


if __name__ == "__main__":
    main()
