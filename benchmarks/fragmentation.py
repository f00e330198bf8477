"""Random oversubscribed mixes: does any job get lost to memory it could have had?

    PYTHONPATH=. python benchmarks/fragmentation.py            # the full grid (long: 2 GiB runs)
    PYTHONPATH=. python benchmarks/fragmentation.py --quick    # 32 and 128 MiB, one seed
    PYTHONPATH=. python benchmarks/fragmentation.py --loop 20  # the two scenarios of issue 20, 20 runs each
    PYTHONPATH=. python benchmarks/fragmentation.py --device cuda --quick --out FILE  # on a GPU (`wwrun doctor`)

The grid: limits of 32 MiB, 128 MiB, 512 MiB and 2 GiB; in each mix, 2 to 5 seeded
MLP jobs (benchmarks/fragmentation_job.py), each fitting alone with a 20% margin
(its allocated peak at most the limit / 1.2), their summed peaks 1.3 to 3x the limit,
the mix's largest single tensor 2%, 10% or 25% of the limit. Each mix runs through
wwrun's launcher (`wwrun --device D --memory-limit L job : job ...`) under
`--policy waterwave`, then under `--policy sequential` for the wall-time ratio. On a
GPU (`--device cuda`) wwrun's allocator holds the budget in the driver's 2 MiB pages
and the jobs' tensors are on the GPU; the mixes are the same, and each job's stream
workspaces (cuBLAS's, 65 MiB each on an H200) come on top of the limit
(`measured.with_stream_workspaces`).

Reported: jobs lost (target 0), each classified by its error: `admission` when the
jobs the engine let in held more than the limit allows (device allocated + the request
over the limit, as the allocator's message says at its decision, also for rule f's
"gives way"), or the engine refused it; `fragmentation` when the bytes were there but
not in one piece (device allocated + request within the limit: the allocator's).
Also allocated / reserved at the run's peak (target >= 0.95) and the waterwave /
sequential wall time of the runs that lost nothing. Prints the figures, then LAST one
JSON object on one line; its `allocator` (and each run's) is the one the runs
recorded, wwrun's (a run on another stops the benchmark, benchmarks/measured.py).
Exits with 1 when a job was lost.

--processes also runs each mix as separate `python fragmentation_job.py` processes
side by side on PyTorch's own allocator with expandable segments
(PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, c10's answer to fragmentation),
as one would run them without wwrun. On a GPU a filler process holds the device's
free memory but the limit and each job process's CUDA context (measured by a probe
process), so the processes share the limit as wwrun's jobs do; a process has no
one to wait for, so one that finds the memory taken fails (`processes_lost`). On the
CPU nothing holds processes to a shared budget: their figures are start-up and
wall time only (`processes_budget_enforced: false`).

--loop N runs the quickstart (recipes/quickstart.yaml under 1.15x its largest job's
allocated peak in a --policy concurrent run) and three copies of a job whose forward
makes a 120 MiB temporary under 200 MiB (tests/scripts/big_temporary.py), N times
each, and reports the runs that lost a job.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # one intra-op thread per job, as the tests

import argparse  # noqa: E402
import functools  # noqa: E402
import io  # noqa: E402
import json  # noqa: E402
import random  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # the checkout
sys.path.append(HERE)  # benchmarks/measured.py, also when a test loads this file (last: shadows nothing)
import wwrun  # noqa: E402
from measured import WWRUN, measured_on, with_stream_workspaces  # noqa: E402
from wwrun.display import QuietDisplay  # noqa: E402
from wwrun.recipe import load_recipe  # noqa: E402

MiB = 1 << 20
JOB_SCRIPT = os.path.join(HERE, "fragmentation_job.py")
LIMITS = (32 * MiB, 128 * MiB, 512 * MiB, 2048 * MiB)
TENSOR_FRACTIONS = (0.02, 0.10, 0.25)
MARGIN = 1.2  # each job fits alone with this margin
NARROW = 8  # fragmentation_job.py's narrow width
DEVICE = "cpu"  # --device
STEPS = 6
ESTIMATE_SLACK = 1.15  # job_peak's bound over the measured peaks: 0.86 to 0.98 of it


def job_peak(width: int, batch: int, depth: int) -> int:
    """A bound on a job's allocated peak alone, as measured on the CPU allocator:
    each layer's wide activation and narrow input kept for backward, two more wide
    tensors in flight (a layer's input and output in forward, their gradients in
    backward), the parameters with their gradients and momentum; and ESTIMATE_SLACK
    over that for the allocator's blocks (a large request's block keeps a remainder
    of up to 1 MiB unsplit, as in c10: 13% over on wide tensors of 1 to 2.6 MiB)."""
    wide, narrow = width * batch * 4, NARROW * batch * 4
    parameters = 4 * depth * (2 * NARROW * width + width + NARROW)
    return int(ESTIMATE_SLACK * ((depth + 2) * wide + depth * narrow + 3 * parameters))


def mix(limit: int, fraction: float, seed: int) -> list[list[str]]:
    """One random mix: the jobs' argument lists for fragmentation_job.py."""
    rng = random.Random(f"{limit}-{fraction}-{seed}")
    count = rng.randint(2, 5)
    fits = limit / MARGIN
    total = rng.uniform(1.3, min(3.0, 0.95 * count / MARGIN)) * limit  # n jobs of at most `fits` each
    weights = [rng.uniform(0.5, 1.0) for _ in range(count)]
    jobs, peaks = [], []
    for i, weight in enumerate(weights):
        target = min(fits, total * weight / sum(weights))
        # The first job holds the mix's largest tensor; the others' are no larger,
        # nor larger than their share of the total allows.
        tensor = fraction * limit
        if i > 0:
            tensor = min(tensor * rng.uniform(0.4, 1.0), target / 3.2)
        depth = max(1, int(target / tensor - 2.2))
        width = rng.choice((64, 128, 256))
        batch = max(1, int(tensor // (4 * width)))
        while depth > 1 and job_peak(width, batch, depth) > fits:
            depth -= 1
        while job_peak(width, batch, depth) > fits:  # a 25% tensor with depth 1 can be just over
            batch = int(batch * 0.95)
        jobs.append(["--width", str(width), "--batch", str(batch), "--depth", str(depth),
                     "--steps", str(STEPS), "--seed", str(seed * 10 + i)])
        peaks.append(job_peak(width, batch, depth))
    while len(jobs) > 2 and sum(peaks) > 3 * limit:  # the first job's tensor can outgrow its share
        jobs.pop(), peaks.pop()
    return jobs


def grid(limits, fractions, seeds) -> list[tuple[int, float, int]]:
    return [(limit, fraction, seed) for limit in limits for fraction in fractions for seed in seeds]


def launch(jobs: list[tuple[str, list[str]]], policy: str, memory_limit: int | None):
    """Run (script, args) jobs through wwrun's launcher in this process, as
    `wwrun --device D --policy P --memory-limit M script args : ...`; the RunResult."""
    log_dir = tempfile.mkdtemp(prefix="wwrun-frag-")
    try:
        result = wwrun.launch(wwrun.LaunchConfig(
            jobs=[wwrun.JobSpec(name=f"job{i}", script=script, args=args) for i, (script, args) in enumerate(jobs)],
            policy=policy, memory_limit=memory_limit, device=DEVICE, quiet=True, log_dir=log_dir,
        ), display=QuietDisplay(io.StringIO()))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    measured_on(result.extra["allocator"], WWRUN, f"wwrun --policy {policy}")
    return result


_SIZE = r"([\d.]+) (B|KiB|MiB|GiB)"
_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": MiB, "GiB": 1 << 30}


def _bytes(number: str, unit: str) -> int:
    return int(float(number) * _UNITS[unit])


def classify(error: str | None, limit: int) -> str | None:
    """Why a job was lost: None (it was not), 'admission' (the engine let in more than
    fits, or refused a job that fits alone), 'fragmentation' (the bytes were free, not
    in one piece: the allocator's) or 'other'."""
    if error is None:
        return None
    if "does not fit beside" in error or "cannot fit even alone" in error:
        return "admission"  # the engine's own refusal
    request = re.search(r"tried to allocate " + _SIZE, error)
    device = re.search(r"Device: " + _SIZE + r" reserved, " + _SIZE + r" allocated", error)
    if request is None or device is None:
        return "other"
    allocated = _bytes(*device.group(3, 4))
    return "fragmentation" if allocated + _bytes(*request.group(1, 2)) <= limit else "admission"


def run_mix(limit: int, fraction: float, seed: int, sequential: bool = True, processes: bool = False) -> dict:
    jobs = [(JOB_SCRIPT, [*args, "--device", DEVICE]) for args in mix(limit, fraction, seed)]
    total = with_stream_workspaces(limit, len(jobs), DEVICE)
    result = launch(jobs, "waterwave", total)
    lost = [classify(job.error, total) for job in result.jobs if job.state.value != "succeeded"]
    figures = {
        "limit_mib": limit // MiB, "memory_limit_bytes": total, "tensor_fraction": fraction, "seed": seed,
        "jobs": len(jobs),
        "lost": len(lost), "lost_by": {kind: lost.count(kind) for kind in set(lost)},
        "errors": [job.error for job in result.jobs if job.error],
        "allocator": result.extra["allocator"],  # checked by launch()
        "peak_reserved_bytes": result.extra.get("peak_reserved_bytes"),
        "allocated_over_reserved": round(result.extra["peak_memory_bytes"] / result.extra["peak_reserved_bytes"], 4),
        "wall_s": round(result.wall_s, 3),
    }
    if sequential and not lost:
        figures["sequential_wall_s"] = round(launch(jobs, "sequential", total).wall_s, 3)
    if processes:
        figures["processes"] = torch_processes([args for _, args in jobs], total)
    return figures


TORCH_ALLOC_CONF = "expandable_segments:True"
CONTEXT_PROBE = """
import sys, torch
# A context and what a job's training step makes outside the caching allocator: the
# cuBLAS and cuBLASLt handles of its thread and of the autograd thread (with only the
# first, a job process's backward once failed in cublasCreate).
layer = torch.nn.Linear(8, 8).cuda()
layer(torch.ones(4, 8, device="cuda")).sum().backward()
torch.cuda.synchronize()
print(torch.cuda.memory_reserved(), flush=True)  # the caching allocator's part: not the context's
sys.stdin.read()
"""
FILLER = """
import sys, torch
torch.cuda.init()
free, _ = torch.cuda.mem_get_info()
hold = torch.empty(max(0, free - int(sys.argv[1])), dtype=torch.uint8, device="cuda")
print("ready", flush=True)
sys.stdin.read()
"""


def _holding(code: str, *argv: str) -> tuple[subprocess.Popen, str]:
    """A helper process that holds device memory until its stdin closes, once it has
    printed its first line; (the process, that line)."""
    proc = subprocess.Popen([sys.executable, "-c", code, *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    line = proc.stdout.readline().strip()
    if not line:  # it ended before holding anything (its error is on stderr)
        raise RuntimeError(f"a helper process failed (exit {proc.wait(timeout=60)})")
    return proc, line


def _release(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=60)


@functools.cache
def context_bytes() -> int:
    """What one job process holds on the device outside its caching allocator (its
    CUDA context, modules and its two threads' cuBLAS handles): the drop in the device's free memory
    while a probe process lives, less its allocator's reserve. Measured once a run."""
    import torch

    before = torch.cuda.mem_get_info()[0]
    probe, reserved = _holding(CONTEXT_PROBE)
    try:
        return max(0, before - torch.cuda.mem_get_info()[0] - int(reserved))
    finally:
        _release(probe)


def torch_processes(jobs: list[list[str]], limit: int) -> dict:
    """The mix as separate processes on PyTorch's allocator with expandable segments,
    started together; on CUDA sharing `limit` (a filler holds the rest of the device,
    but for each process's context). A job is lost when its process fails."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTORCH_CUDA_ALLOC_CONF=TORCH_ALLOC_CONF)
    env.pop("PYTORCH_ALLOC_CONF", None)  # the newer name would take precedence
    filler = None
    if DEVICE == "cuda":
        filler, _ = _holding(FILLER, str(limit + len(jobs) * context_bytes()))
    try:
        started = time.perf_counter()
        procs = [subprocess.Popen([sys.executable, JOB_SCRIPT, *args], env=env, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for args in jobs]
        errors = [p.communicate()[1] for p in procs]
        wall = time.perf_counter() - started
    finally:
        if filler is not None:
            _release(filler)
    failed = [err.strip().splitlines()[-1] if err.strip() else f"exit {p.returncode}"
              for p, err in zip(procs, errors) if p.returncode != 0]
    return {"allocator": "native", "alloc_conf": TORCH_ALLOC_CONF, "budget_enforced": DEVICE == "cuda",
            "lost": len(failed), "errors": failed, "wall_s": round(wall, 3)}


def quickstart_limit() -> int:
    """1.15x the largest allocated peak of the quickstart's jobs in a --policy concurrent run."""
    config = load_recipe(os.path.join(REPO, "recipes", "quickstart.yaml"))
    return int(1.15 * max(job.extra["peak_memory_bytes"] for job in _launch_recipe(config, "concurrent", None).jobs))


def _launch_recipe(config, policy, limit):
    log_dir = tempfile.mkdtemp(prefix="wwrun-frag-")
    try:
        config.device, config.policy, config.memory_limit = DEVICE, policy, limit
        config.quiet, config.log_dir = True, log_dir
        result = wwrun.launch(config, display=QuietDisplay(io.StringIO()))
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    measured_on(result.extra["allocator"], WWRUN, f"the quickstart under --policy {policy}")
    return result


def scenario_loop(runs: int) -> dict:
    """The two scenarios of issue 20, `runs` times each: runs that lost a job."""
    limit = quickstart_limit()
    temporary = os.path.join(REPO, "tests", "scripts", "big_temporary.py")
    quickstart = os.path.join(REPO, "recipes", "quickstart.yaml")
    jobs = len(load_recipe(quickstart).jobs)
    scenarios = {
        "quickstart": lambda: _launch_recipe(load_recipe(quickstart), "waterwave",
                                             with_stream_workspaces(limit, jobs, DEVICE)),
        "temporary_120mib_x3": lambda: launch([(temporary, ["40", "120"])] * 3, "waterwave",
                                              with_stream_workspaces(200 * MiB, 3, DEVICE)),
    }
    figures = {"quickstart_limit_bytes": limit}
    for name, run in scenarios.items():
        lost_runs, kinds, over = 0, [], 0
        for _ in range(runs):
            result = run()
            figures["allocator"] = result.extra["allocator"]  # every run's (checked as it ends)
            errors = [job.error for job in result.jobs if job.state.value != "succeeded"]
            lost_runs += bool(errors)
            kinds += [classify(e, result.extra["memory_limit_bytes"]) for e in errors]
            over += result.extra["peak_reserved_bytes"] > result.extra["memory_limit_bytes"]
        figures[name] = {"runs": runs, "runs_losing_a_job": lost_runs,
                         "lost_by": {k: kinds.count(k) for k in set(kinds)},
                         "runs_reserving_over_the_limit": over}
        print(f"{name}: {lost_runs} of {runs} runs lost a job {figures[name]['lost_by']}", flush=True)
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="32 and 128 MiB, one seed")
    parser.add_argument("--seeds", type=int, default=None, help="mixes per cell (default 3, --quick 1)")
    parser.add_argument("--limits", default=None, help="MiB, comma-separated (default: 32,128,512,2048)")
    parser.add_argument("--no-sequential", action="store_true", help="skip the --policy sequential runs")
    parser.add_argument("--loop", type=int, default=0, metavar="N", help="the two scenarios of issue 20, N runs each")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--processes", action="store_true",
                        help="also each mix as processes on PyTorch's allocator with expandable segments")
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    import torch

    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        # Before any CUDA work in this process (the device's name below is the first):
        # the launches find wwrun's allocator installed, not PyTorch's in use.
        from wwrun.memory import allocator

        allocator.install()
    torch.set_num_threads(1)
    result: dict = {"device": DEVICE, "device_name": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu",
                    "torch": torch.__version__, "cpu_cores": os.cpu_count(),
                    "command": " ".join(["python", *sys.argv]), "load_average_at_start": round(os.getloadavg()[0], 2)}
    if args.loop:
        result.update(scenario_loop(args.loop))
    else:
        result.update(grid_figures(args))
    result["complete"] = True  # (a run stopped at a time limit leaves {"complete": false, "per_run": ...})
    print(json.dumps(result))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    lost = result.get("jobs_lost", 0) + sum(figures.get("runs_losing_a_job", 0) for figures in result.values()
                                            if isinstance(figures, dict))
    if lost:  # a job lost to memory it could have had is a failure, not a figure (`wwrun doctor`'s step fails)
        sys.exit(f"fragmentation: {lost} lost (jobs in the grid, runs in the loops): see above")


def grid_figures(args) -> dict:
    """The grid's runs, each printed as it ends; their figures."""
    limits = [int(m) * MiB for m in args.limits.split(",")] if args.limits else (LIMITS[:2] if args.quick else LIMITS)
    seeds = range(args.seeds if args.seeds is not None else (1 if args.quick else 3))
    # The process's first launch pays its one-time costs (the job script's imports, the
    # first hooks: 1.1 s with no job computing), which made the first cell 0.27x
    # sequential: one untimed job first.
    launch([(JOB_SCRIPT, [*mix(limits[0], TENSOR_FRACTIONS[0], 0)[0], "--device", DEVICE])], "waterwave",
           with_stream_workspaces(limits[0], 1, DEVICE))
    runs = []
    started = time.perf_counter()
    for limit, fraction, seed in grid(limits, TENSOR_FRACTIONS, seeds):
        figures = run_mix(limit, fraction, seed, sequential=not args.no_sequential, processes=args.processes)
        runs.append(figures)
        ratio = (f", {figures['sequential_wall_s'] / figures['wall_s']:.2f}x sequential"
                 if "sequential_wall_s" in figures else "")
        apart = (f"; as processes: lost {figures['processes']['lost']}, {figures['processes']['wall_s']:.1f} s"
                 if args.processes else "")
        print(f"{limit // MiB:5d} MiB, tensors {fraction:.0%}, seed {seed}: {figures['jobs']} jobs, "
              f"lost {figures['lost']} {figures['lost_by'] or ''}, allocated/reserved "
              f"{figures['allocated_over_reserved']:.3f}, {figures['wall_s']:.1f} s{ratio}{apart}", flush=True)
        for error in figures["errors"] + figures.get("processes", {}).get("errors", []):
            print(f"    {error}")
        if args.out:  # the runs so far, whole: a run stopped at a time limit keeps them
            Path(args.out).write_text(json.dumps({"complete": False, "per_run": runs}, indent=1) + "\n")
    kinds = [kind for run in runs for kind, n in run["lost_by"].items() for _ in range(n)]
    timed = [run for run in runs if "sequential_wall_s" in run]
    apart = [run["processes"] for run in runs if "processes" in run]
    processes = {
        "processes_allocator": apart[0]["allocator"], "processes_alloc_conf": apart[0]["alloc_conf"],
        "processes_budget_enforced": apart[0]["budget_enforced"],
        "processes_jobs_lost": sum(p["lost"] for p in apart),
        "processes_runs_losing_a_job": sum(bool(p["lost"]) for p in apart),
        "processes_wall_s": round(sum(p["wall_s"] for p in apart), 3),
        "wall_s": round(sum(run["wall_s"] for run in runs), 3),
    } if apart else {}
    return {
        **processes,
        "allocator": runs[0]["allocator"],  # every run's (launch() checks each)
        "runs": len(runs), "jobs": sum(run["jobs"] for run in runs),
        "jobs_lost": sum(run["lost"] for run in runs), "runs_losing_a_job": sum(bool(run["lost"]) for run in runs),
        "lost_by": {kind: kinds.count(kind) for kind in sorted(set(kinds))},
        "min_allocated_over_reserved": min(run["allocated_over_reserved"] for run in runs),
        "median_allocated_over_reserved": sorted(run["allocated_over_reserved"] for run in runs)[len(runs) // 2],
        "speedup_vs_sequential": round(sum(r["sequential_wall_s"] for r in timed) / sum(r["wall_s"] for r in timed), 3)
        if timed else None,
        "elapsed_s": round(time.perf_counter() - started, 1),
        "per_run": [{k: ({**v, "errors": v["errors"][:3]} if k == "processes" else v)
                     for k, v in run.items()} for run in runs],  # with each lost job's whole error
    }


if __name__ == "__main__":
    main()
