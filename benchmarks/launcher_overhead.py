"""Launcher overhead, measured side by side in one run.

(1) one example job: `wwrun script.py` against `python script.py` (whole-process wall
    time, so wwrun's own start-up counts against it). Target: overhead <= 3%.
(2) four copies of the job: `wwrun --policy concurrent` against the same four run one
    after another with `python` (on a CPU the four share the cores: this shows what
    threads of one process cost or gain against processes in sequence).

Medians of --repeats runs (at least 5), runs of the variants interleaved so drifts in
machine load hit them alike. The last line is one JSON object.

    python benchmarks/launcher_overhead.py [--repeats 5] [--script recipes/examples/mlp.py] [-- script args]
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


def timed(argv: list[str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--script", default=str(ROOT / "recipes" / "examples" / "mlp.py"))
    parser.add_argument("script_args", nargs="*", default=["--steps", "600"])
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of at least 5 runs)")

    python = [sys.executable, args.script, *args.script_args]
    logs = tempfile.mkdtemp(prefix="wwrun-bench-")
    wwrun = [sys.executable, "-m", "wwrun", "--quiet", "--log-dir", logs]
    many = []
    for i in range(args.jobs):
        many += ([":"] if i else []) + [args.script, *args.script_args]
    env_note = f"{os.cpu_count()} cpus"

    times: dict[str, list[float]] = {k: [] for k in ("python", "wwrun", "sequential", "concurrent")}
    timed(python)  # warm the file cache
    for _ in range(args.repeats):
        times["python"].append(timed(python))
        times["wwrun"].append(timed([*wwrun, args.script, *args.script_args]))
        times["sequential"].append(sum(timed(python) for _ in range(args.jobs)))
        times["concurrent"].append(timed([*wwrun, "--policy", "concurrent", *many]))

    med = {k: statistics.median(v) for k, v in times.items()}
    overhead = med["wwrun"] / med["python"] - 1
    speedup = med["sequential"] / med["concurrent"]
    print(f"machine: {env_note}; script: {Path(args.script).name} {' '.join(args.script_args)}; "
          f"medians of {args.repeats}")
    print(f"  one job   python {med['python']:.2f}s   wwrun {med['wwrun']:.2f}s   overhead {overhead:+.1%} (target <= 3%)")
    print(f"  {args.jobs} jobs    one after another {med['sequential']:.2f}s   wwrun concurrent "
          f"{med['concurrent']:.2f}s   speed-up {speedup:.2f}x")
    import torch

    print(json.dumps({
        "benchmark": "launcher_overhead",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "script": Path(args.script).name,
        "script_args": args.script_args,
        "repeats": args.repeats,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "single_job_overhead": round(overhead, 4),
        "concurrent_vs_sequential_speedup": round(speedup, 3),
    }))


if __name__ == "__main__":
    main()
