"""Activation offload (issue 23): how much larger a job trains under one budget, and
at what cost.

    PYTHONPATH=. python benchmarks/offload.py                # CPU (~10 s on 2 cores)
    PYTHONPATH=. python benchmarks/offload.py --device cuda  # the same on a GPU

The job is tests/scripts/offload_job.py, the offload tests' own (a residual MLP, here
12 blocks of 256x256, its own torch.Generator), run through wwrun's launcher (`wwrun
--memory-limit M --offload MODE offload_job.py --width 256 --depth 12 --batch B
--time`), one intra-op thread.

(a) the largest batch that trains under --memory-limit with `--offload never` and
    with `--offload auto` (a batch trains when the job succeeds; found by doubling,
    then bisection to 1/16 of the bracket), and their ratio (target >= 2x). Losses of
    the largest offloaded batch are compared bit for bit with the same batch run
    without a limit.
(b) the iteration time at the solo-max batch (the largest without offload) with
    `--offload always` against `--offload never`, same budget: median step time after
    two warm-up steps, median of repeats. On the CPU the copies are synchronous, so
    this is the whole cost of copying; on a GPU they overlap (target: <= 15%).
(c) three jobs whose summed peaks are about 3x the budget (one twice too large
    alone, two small): `--offload auto`, `--offload never` and `--policy sequential`
    (with auto): jobs that succeed, wall time, bytes offloaded, and of them the bytes
    parked (moved while the job waited at a gate so that another job could go).

Every run goes through wwrun's allocator, whose figures these are: the JSON's
`allocator` is what the runs recorded (a run on another allocator stops the
benchmark, benchmarks/measured.py).

Prints the figures, then LAST one JSON object on one line, also saved to
benchmarks/results/offload-<device>.json (or --out). On the CPU (without Triton's interpreter)
the chunks are packed with plain copies. The CUDA command has not
been run (the machine it was written on has no GPU); there the copies run on a side
stream and torch.autograd.graph.save_on_cpu(pin_memory=True) is the baseline to add.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
os.environ.setdefault("OMP_NUM_THREADS", "1")

from measured import WWRUN, measured_on  # noqa: E402  benchmarks/measured.py, beside this script

from wwrun import JobSpec, JobState, LaunchConfig, launch  # noqa: E402

SCRIPT = str(HERE.parent / "tests" / "scripts" / "offload_job.py")
MiB = 2**20


def run(jobs: list[JobSpec], device: str, **options):
    with tempfile.TemporaryDirectory() as logs:
        result = launch(LaunchConfig(jobs=jobs, device=device, log_dir=logs, quiet=True, **options))
        measured_on(result.extra["allocator"], WWRUN, f"wwrun --offload {options.get('offload', 'auto')}")
        outputs = [(Path(job.log_dir) / "stdout.log").read_text() if job.log_dir else "" for job in result.jobs]
    return result, outputs


def job(name: str, batch: int, steps: int) -> JobSpec:
    return JobSpec(name=name, script=SCRIPT, args=["--width", "256", "--depth", "12", "--batch", str(batch),
                                                  "--steps", str(steps), "--time"])


def trains(batch: int, limit: int, mode: str, device: str) -> bool:
    result, _ = run([job("j", batch, 2)], device, memory_limit=limit, offload=mode, policy="waterwave")
    return result.jobs[0].state == JobState.SUCCEEDED


def largest_batch(limit: int, mode: str, device: str, start: int, cap: int) -> int:
    """The largest batch that trains: doubling from `start`, then bisection."""
    if not trains(start, limit, mode, device):
        return 0
    low, high = start, start * 2
    while high <= cap and trains(high, limit, mode, device):
        low, high = high, high * 2
    if high > cap:
        return low
    while high - low > max(1, low // 16):
        middle = (low + high) // 2
        low, high = (middle, high) if trains(middle, limit, mode, device) else (low, middle)
    return low


def step_time(batch: int, limit: int, mode: str, device: str, repeats: int) -> tuple[float, int]:
    """(median step time, bytes offloaded in one run)."""
    times, moved = [], 0
    for _ in range(repeats):
        result, outputs = run([job("j", batch, 8)], device, memory_limit=limit, offload=mode, policy="waterwave")
        assert result.jobs[0].state == JobState.SUCCEEDED, result.jobs[0].error
        times.append(float(outputs[0].rsplit("step_s ", 1)[1]))
        moved = result.jobs[0].extra.get("offloaded_bytes", 0)
    return statistics.median(times), moved


def losses(output: str) -> list[str]:
    return [line for line in output.splitlines() if " loss " in line]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--limit", default="32MiB", help="the budget (default: 32MiB)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, help="write the JSON here (default: "
                        "benchmarks/results/offload-<device>.json)")
    args = parser.parse_args()
    from wwrun.config import parse_size

    limit = parse_size(args.limit)
    figures: dict = {"device": args.device, "limit_bytes": limit}

    # (a)
    solo_max = largest_batch(limit, "never", args.device, start=64, cap=1 << 16)
    offload_max = largest_batch(limit, "auto", args.device, start=max(64, solo_max), cap=64 * max(64, solo_max))
    figures.update(solo_max_batch=solo_max, offload_max_batch=offload_max,
                   batch_ratio=round(offload_max / solo_max, 2) if solo_max else None)
    print(f"(a) largest batch in {args.limit}: {solo_max} without offload, {offload_max} with "
          f"({figures['batch_ratio']}x)")
    with_limit, out_limit = run([job("j", offload_max, 3)], args.device, memory_limit=limit, offload="auto",
                                policy="waterwave")
    _, out_free = run([job("j", offload_max, 3)], args.device, offload="never", policy="waterwave")
    figures["allocator"] = with_limit.extra["allocator"]  # every run's, checked in run()
    figures["same_losses"] = losses(out_limit[0]) == losses(out_free[0]) and bool(losses(out_free[0]))
    figures["offload_max_reserved_bytes"] = with_limit.extra.get("peak_reserved_bytes")
    print(f"    batch {offload_max}: same losses as without a limit: {figures['same_losses']}, "
          f"reserved {figures['offload_max_reserved_bytes'] / MiB:.1f} MiB")

    # (b)
    solo, _ = step_time(solo_max, limit, "never", args.device, args.repeats)
    offloaded, moved = step_time(solo_max, limit, "always", args.device, args.repeats)
    figures.update(solo_step_s=round(solo, 6), offload_step_s=round(offloaded, 6),
                   offload_overhead=round(offloaded / solo - 1, 3), offload_bytes_per_run=moved)
    print(f"(b) batch {solo_max}: {solo * 1e3:.1f} ms/step solo, {offloaded * 1e3:.1f} ms with --offload always "
          f"({figures['offload_overhead']:+.1%}, {moved / MiB:.0f} MiB offloaded in 8 steps)")

    # (c)
    big, small = 2 * solo_max, max(16, solo_max // 3)
    mix = [job("big", big, 4), job("small1", small, 4), job("small2", small, 4)]
    for label, options in (("auto", {"offload": "auto", "policy": "waterwave"}),
                           ("never", {"offload": "never", "policy": "waterwave"}),
                           ("sequential", {"offload": "auto", "policy": "sequential"})):
        began = time.perf_counter()
        result, _ = run(mix, args.device, memory_limit=limit, **options)
        wall = time.perf_counter() - began
        done = [j.name for j in result.jobs if j.state == JobState.SUCCEEDED]
        moved = {j.name: j.extra.get("offloaded_bytes", 0) for j in result.jobs}
        parked = {j.name: j.extra.get("parked_bytes", 0) for j in result.jobs}  # of moved: while waiting at a gate
        figures[f"mix_{label}"] = {"succeeded": len(done), "wall_s": round(wall, 3), "offloaded_bytes": moved,
                                   "parked_bytes": parked}
        print(f"(c) {label}: {len(done)}/3 succeeded ({', '.join(done)}) in {wall:.2f} s, offloaded {moved}, "
              f"of which parked {parked}")

    figures["loadavg"] = os.getloadavg()[0]
    out = args.out or HERE / "results" / f"offload-{args.device}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(figures, indent=1) + "\n")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
