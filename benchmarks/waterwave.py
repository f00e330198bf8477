"""Waterwave's experiments, reproduced on one machine (IEEE TC 72(10), 2023, §Evaluation).

    PYTHONPATH=. python benchmarks/waterwave.py               # CPU, --memory-limit budgets (~3 min on 2 cores)
    PYTHONPATH=. python benchmarks/waterwave.py --quick       # fewer steps and repeats
    PYTHONPATH=. python benchmarks/waterwave.py --device cuda # the same on a GPU
    PYTHONPATH=. python benchmarks/waterwave.py --out FILE    # the JSON there (what `wwrun doctor` passes)
    PYTHONPATH=. python benchmarks/waterwave.py --parts de    # only (d) and (e): the engine's and threads' costs

The jobs of (b), (c) and (d) are one real training script, benchmarks/train_job.py
(an MLP on synthetic data, its own torch.Generator), run through wwrun's launcher
(`wwrun.launch`, what `wwrun --policy P --memory-limit M train_job.py ... : ...`
does) and as plain `python train_job.py` processes. Every variant gives each job one
intra-op thread (OMP_NUM_THREADS=1, as a small job leaves most of a GPU idle), and
times the jobs' training loops from the script's own timestamps (first loop start to
last loop end) after two untimed warm-up steps, leaving out interpreter start-up,
imports and first-step costs, which a fresh process pays and a thread of a warm
launcher does not. Jobs run side by side (processes, or threads of one launch) start
their loops together once all have warmed up (train_job.py --start-together), so that
no variant's timed window holds another job's warm-up. Medians over interleaved
repeats.

(a) largest batch per job with 2 and 3 jobs sharing a budget, as a fraction of the
    job's solo maximum: waterwave, and spatial sharing (every job's whole peak must
    fit, as with processes or MPS side by side). A bisection needs dozens of short
    runs, so threads in the memory sessions of a `wwrun.memory.Memory` (what the
    launcher holds: the CPU allocator with the budget, the engine) stand in for it.
    A batch "trains" when every job finishes, all ran at once at some point, and the
    measured peak stays in budget.
(b) oversubscription: 3 jobs whose summed peaks are 1.5x `--memory-limit`, a job's
    peak being what the allocator reserved for it alone, above what it held when the
    run started (on CUDA earlier runs' idle job streams keep cuBLAS workspaces, dropped
    before each run): the device memory a process running it would hold (its
    allocated peak is recorded too); on CUDA the 1.5x is of the jobs' own bytes, and
    each job's stream workspaces (`b_stream_fixed_bytes`) come on top of it, as in
    (a). Part (a) plans, as the launcher does, for the number of jobs at once. The jobs are large
    enough (12 MiB activations, ~75 ms steps) that the allocator's 2 MiB segments and
    the engine's Python hooks weigh as little as on a GPU:
    `--policy waterwave` against `--policy sequential` (temporal sharing; timed as
    its loops back to back, without the gaps between jobs), and
    against 3 separate processes side by side (spatial sharing). On the CPU nothing
    enforces a budget on processes, so their time is shown with the budget they
    would need.
(c) no oversubscription (a budget holding all three peaks): `--policy waterwave`
    against the 3 separate processes.
    On a GPU, (b) and (c) are also measured against PyTorch's own cross-stream reuse:
    the jobs as threads of one wwrun process (`--policy concurrent`) on
    PYTORCH_ALLOC_CONF=backend:cudaMallocAsync, where the CUDA driver reuses memory
    freed on another job's stream and inserts the wait itself; it has no gate, so its
    peak is recorded against the (b) budget.
(d) the cost of one gate (an admission decision on the job's thread, µs) and the
    engine's fixed cost per iteration (µs, on a tiny model, in a memory session as
    the launcher holds it, with the engine and without): micro-measurements; and a
    single job's overhead, `wwrun train_job.py` (one job: a plain thread; and with
    `--policy waterwave`, the engine measuring and gating) against
    `python train_job.py`, least of the repeats; on the CPU also the cost of
    routing a job's memory through wwrun's allocator (benchmarks/allocator.py's
    training loop with torch's CPU allocator and with wwrun's).
(e) steps bound by Python (a tiny MLP; on a GPU a small model's step is kernel
    launches): 3 jobs as threads of one launch, `--policy concurrent` and `waterwave`
    (under a roomy budget), and as 3 processes, against `--policy sequential`.
    Threads take turns at the GIL at every torch call: the figure tracks what the
    turns and the engine's hooks cost where (b)'s compute, which runs without the
    GIL, hides it.

Every figure says which allocator it measured: the JSON's `allocator` is the one
every wwrun run of (a)-(e) got (`wwrun.memory.allocator.in_use`, as the run's report
names it), and `allocators` names each mode's. A wwrun run on any other allocator
than wwrun's stops the benchmark with an error: on CUDA, wwrun's allocator is
installed before the first CUDA tensor of this process, or every later launch would
find CUDA initialised and fall back to PyTorch's.

Prints the figures, then LAST one JSON object on one line; full runs also save it
to benchmarks/results/waterwave-<device>.json (or --out). The CUDA command has run
once, on an H200, and crashed in (a) at the first out-of-memory message (a statically
linked C++ runtime in wwrun's build, since fixed); there the launcher keeps the
budget.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os

# One intra-op thread per job in every variant, read by torch at import in this
# process and in each job process it starts; the launcher leaves an explicit
# OMP_NUM_THREADS alone (otherwise it divides the cores among the running jobs).
os.environ["OMP_NUM_THREADS"] = "1"

import platform  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from torch import nn  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout
import wwrun  # noqa: E402
from wwrun.display import QuietDisplay  # noqa: E402
from wwrun.memory import Memory, allocator  # noqa: E402
from wwrun.memory.engine import Engine, JobTooLarge  # noqa: E402

import allocator as allocator_benchmark  # noqa: E402  benchmarks/allocator.py, beside this script
from measured import WWRUN, measured_on, with_stream_workspaces  # noqa: E402  benchmarks/measured.py

INPUTS, CLASSES = 32, 10
HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")
JOB_SCRIPT = os.path.join(HERE, "train_job.py")
REPO = os.path.dirname(HERE)
TORCH_BACKEND = "cudaMallocAsync"  # GPU mode's other cross-stream reuse


def make_model(width: int, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(INPUTS, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, CLASSES),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


DEVICE = "cpu"  # --device


def train(width: int, batch: int, steps: int, seed: int) -> float:
    """One job's script body; returns the last loss."""
    g = torch.Generator().manual_seed(seed)
    model = make_model(width, seed).to(DEVICE)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss = torch.zeros(())
    for _ in range(steps):
        x, y = torch.randn(batch, INPUTS, generator=g), torch.randint(0, CLASSES, (batch,), generator=g)
        x, y = x.to(DEVICE), y.to(DEVICE)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def run_threads(jobs: list[dict], session=None) -> tuple[float, dict]:
    """Run jobs as threads, each inside `session(name)` (a context manager: a
    Memory's session, as the launcher runs a job); (wall seconds,
    name -> error or None)."""
    errors: dict[str, BaseException | None] = {}

    def body(name, spec):
        errors[name] = None
        try:
            with session(name) if session is not None else contextlib.nullcontext():
                try:
                    train(**spec)
                except Exception as err:
                    # Without its frames: the job's tensors go before its session
                    # ends, as in the launcher (held, they shrank the others' budget).
                    errors[name] = err.with_traceback(None)
        except Exception as err:
            errors[name] = err.with_traceback(None)

    threads = [threading.Thread(target=body, args=(f"job{i}", spec)) for i, spec in enumerate(jobs)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, errors


def trains(jobs: list[dict], capacity: int, policy: str) -> bool:
    """Whether the jobs train together within `capacity`.

    The CPU allocator holds the budget, as the launcher installs it, and measures.
    waterwave: every job finishes and all ran at the same time at some point (none
    just queued behind the others). concurrent (spatial sharing): the jobs' peaks must
    fit side by side, as separate processes each keeping their peak (caching
    allocators) would need."""
    drop_idle_reserve()  # earlier trials' idle job streams hold no budget of this one
    cuda = DEVICE == "cuda"
    # Solo and shared trials give the jobs the same bytes of their own: with each job's
    # CUDA stream workspaces inside `capacity`, 2 jobs in 512 MiB could reach 85% at most.
    limit = with_stream_workspaces(capacity, len(jobs), DEVICE)
    # What the launcher holds (allocator, budget, engine), planning as it would for
    # every job at once: on CUDA each one's stream workspaces and thread headroom.
    memory = Memory(DEVICE, limit, policy, jobs_at_once=len(jobs))
    try:
        measured_on(memory.allocator, WWRUN, f"(a) {policy}")
        _, errors = run_threads(jobs, memory.session)
        peaks = [(allocator.job_stats if cuda else allocator.cpu_job_stats)(name)["allocated_bytes"]["peak"]
                 for name in errors]
        assert (allocator.stats if cuda else allocator.cpu_stats)()["device"]["reserved_bytes"]["peak"] <= limit
    finally:
        memory.close()
    engine = memory.engine
    if any(e is not None and not isinstance(e, (JobTooLarge, torch.OutOfMemoryError)) for e in errors.values()):
        raise next(e for e in errors.values() if e is not None)
    if any(e is not None for e in errors.values()):
        return False
    if policy != "waterwave":
        return sum(peaks) <= capacity
    runs = [engine._jobs[name] for name in errors]
    return max(j.admitted for j in runs) < min(j.ended for j in runs)


def largest_batch(count: int, width: int, capacity: int, policy: str, high: int) -> int:
    low = 0  # largest batch known to train
    while low < high:
        mid = (low + high + 1) // 2
        if trains([dict(width=width, batch=mid, steps=6, seed=i) for i in range(count)], capacity, policy):
            low = mid
        else:
            high = mid - 1
    return low


def job_args(width: int, batch: int, steps: int, seed: int) -> list[str]:
    return ["--width", str(width), "--batch", str(batch), "--steps", str(steps),
            "--seed", str(seed), "--device", DEVICE]


def loop_span(stdout: str) -> tuple[float, float]:
    """(start, end) of a job's training loop, from train_job.py's last line."""
    figures = json.loads(stdout.strip().splitlines()[-1])
    assert figures["threads"] == 1, f"a job used {figures['threads']} intra-op threads"
    return figures["start"], figures["end"]


def started_together(jobs: list[list[str]], folder: str) -> list[list[str]]:
    """The jobs' arguments, with a common start of their timed loops once every one
    has taken its warm-up steps (a barrier of files in a new folder under `folder`)."""
    barrier = tempfile.mkdtemp(prefix="start-", dir=folder)
    return [[*args, "--start-together", f"{barrier}:{len(jobs)}"] for args in jobs]


def makespan(spans: list[tuple[float, float]]) -> float:
    """Seconds from the first job's loop start to the last job's loop end."""
    return max(end for _, end in spans) - min(start for start, _ in spans)


def drop_idle_reserve() -> int:
    """What the allocator still holds before a run for none of its jobs; the run's
    reserved peak starts from it (the launcher resets the peak to what is reserved
    when it starts). On CUDA those are the cuBLAS workspaces of earlier runs' idle job
    streams (torch keeps them in a process-wide map; ~66 MiB a stream on sm_90): they
    are dropped first, so that a run's peak above what is left is its own, its jobs'
    bytes and its own streams' workspaces, as a process running the jobs would hold.
    On the CPU the allocator is installed afresh for each run: nothing."""
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()
    torch.cuda.empty_cache()
    return allocator.stats()["device"]["reserved_bytes"]["current"]


def launched(jobs: list[list[str]], policy: str, memory_limit: int | None = None):
    """Run the jobs through wwrun's launcher, as `wwrun --policy P --memory-limit M
    train_job.py ARGS : ...` would; (the jobs' loop spans, RunResult, the run's
    reserved peak above what the allocator held at its start). Jobs side by side start
    their loops together; one after another (`sequential`), each when it is its turn."""
    baseline = drop_idle_reserve()
    log_dir = tempfile.mkdtemp(prefix="wwrun-bench-")
    if policy != "sequential":
        jobs = started_together(jobs, log_dir)
    try:
        result = wwrun.launch(wwrun.LaunchConfig(
            jobs=[wwrun.JobSpec(name=f"job{i}", script=JOB_SCRIPT, args=args) for i, args in enumerate(jobs)],
            policy=policy, memory_limit=memory_limit, device=DEVICE, quiet=True, log_dir=log_dir,
        ), display=QuietDisplay(io.StringIO()))  # not even --quiet's summary table
        if result.exit_code != 0:
            raise RuntimeError(f"wwrun --policy {policy} failed: {[j.error for j in result.jobs]}")
        measured_on(result.extra["allocator"], WWRUN, f"wwrun --policy {policy}")
        spans = [loop_span((Path(job.log_dir) / "stdout.log").read_text()) for job in result.jobs]
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)
    return spans, result, result.extra["peak_reserved_bytes"] - baseline


def torch_allocator_threads(jobs: list[list[str]]) -> tuple[float, int]:
    """The jobs as threads of one `wwrun --policy concurrent` process on PyTorch's
    own cross-stream reuse, PYTORCH_ALLOC_CONF=backend:cudaMallocAsync (wwrun keeps
    a backend the user asked for): the CUDA driver's pool hands memory freed on one
    job's stream to another's and inserts the wait itself, with no gating. (The
    makespan of the loops, the peak bytes the pool reserved.)"""
    log_dir = tempfile.mkdtemp(prefix="wwrun-bench-")
    try:
        report = os.path.join(log_dir, "report.json")
        argv = [sys.executable, "-m", "wwrun", "--policy", "concurrent", "--device", DEVICE, "--quiet",
                "--log-dir", log_dir, "--report", report]
        for i, args in enumerate(started_together(jobs, log_dir)):
            argv += [":"] * (i > 0) + [JOB_SCRIPT, *args]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTORCH_ALLOC_CONF=f"backend:{TORCH_BACKEND}",
                   PYTHONPATH=os.pathsep.join(filter(None, (REPO, os.environ.get("PYTHONPATH")))))
        done = subprocess.run(argv, env=env, capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"wwrun under {TORCH_BACKEND} failed: {done.stderr[-2000:]}")
        run = json.loads(Path(report).read_text())
        measured_on(run["run"]["allocator"], TORCH_BACKEND, f"wwrun under {TORCH_BACKEND}")
        spans = [loop_span((Path(run["run"]["log_dir"]) / job["name"] / "stdout.log").read_text())
                 for job in run["jobs"]]
        return makespan(spans), run["run"]["peak_reserved_bytes"]
    finally:
        shutil.rmtree(log_dir, ignore_errors=True)


def back_to_back(spans: list[tuple[float, float]]) -> float:
    """The jobs' loop times summed: --policy sequential without the gaps between jobs
    (where the next job builds its model and takes its warm-up steps)."""
    return sum(end - start for start, end in spans)


def processes(jobs: list[list[str]]) -> float:
    """The jobs as separate `python train_job.py` processes side by side (spatial
    sharing); the makespan of their training loops, which start together once every
    process has imported torch and taken its warm-up steps."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    folder = tempfile.mkdtemp(prefix="wwrun-bench-")
    try:
        procs = [subprocess.Popen([sys.executable, JOB_SCRIPT, *args], env=env, stdout=subprocess.PIPE, text=True)
                 for args in started_together(jobs, folder)]
        outputs = [p.communicate()[0] for p in procs]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if any(p.returncode != 0 for p in procs):
        raise RuntimeError("a job process failed")
    return makespan([loop_span(out) for out in outputs])


def part_a(result: dict, width: int) -> None:
    # (a) largest batch, solo and shared: engine-level (threads between job_started and
    # job_finished, as the launcher calls them), as a bisection needs many short runs.
    # Both budgets are 256 of the allocator's pages (512 KiB on the host, the driver's
    # 2 MiB on CUDA), so that each job's partly used last pages weigh the same; on CUDA
    # each job stream's cuBLAS workspaces (kept for good) come on top (`trains`).
    capacity_a, high_a = (128 * 2**20, 1 << 18) if DEVICE == "cpu" else (512 * 2**20, 1 << 19)
    solo = largest_batch(1, width, capacity_a, "waterwave", high=high_a)
    if solo == 0:
        raise RuntimeError(f"(a) not even a batch of 1 trains alone in {capacity_a >> 20} MiB")
    fractions = {}
    for count in (2, 3):
        for policy, label in (("waterwave", "waterwave"), ("concurrent", "spatial")):
            shared = largest_batch(count, width, capacity_a, policy, high=solo)
            fractions[f"{label}_{count}jobs"] = round(shared / solo, 4)
    print(f"(a) budget {capacity_a >> 20} MiB, solo max batch {solo}; shared / solo: {fractions}")
    result["a_budget_bytes"] = capacity_a
    result["a_solo_max_batch"] = solo
    result["a_batch_fraction"] = fractions


def part_bc(result: dict, width: int, repeats: int, steps: int) -> None:
    # (b) oversubscription: 3 jobs whose summed peaks are ~1.5x the budget.
    batch, steps_b = 24576, max(10, steps // 3)
    _, alone, peak = launched([job_args(width, batch, 3, 0)], "waterwave")
    allocated_peak = alone.jobs[0].extra["peak_memory_bytes"]
    # On CUDA a job's peak holds its stream's workspaces (65 MiB on an H200), which each
    # job at once holds again, inside the limit: the jobs' own bytes are what the 1.5x
    # oversubscribes, the workspaces come on top (as each process has its own).
    fixed = with_stream_workspaces(0, 1, DEVICE)
    own = peak - fixed
    capacity_b = int(3 * own / 1.5) + 3 * fixed
    jobs = [job_args(width, batch, steps_b, seed) for seed in range(3)]
    waterwave_peaks = []

    def waterwave_run():
        spans, run, _ = launched(jobs, "waterwave", capacity_b)
        assert run.extra["peak_reserved_bytes"] <= capacity_b, run.extra  # the allocator's, all it holds
        waterwave_peaks.append(run.extra["peak_reserved_bytes"])
        return makespan(spans)

    # Interleaved repeats, so that the load of a shared machine drifts over all alike.
    modes = {
        "waterwave": waterwave_run,
        "sequential": lambda: back_to_back(launched(jobs, "sequential")[0]),
        "processes": lambda: processes(jobs),
        # (c): no oversubscription, the budget holds all three peaks at once.
        "waterwave_roomy": lambda: makespan(launched(jobs, "waterwave", 4 * peak)[0]),
    }
    async_peaks = []
    if DEVICE == "cuda":
        def async_run():
            seconds, reserved = torch_allocator_threads(jobs)
            async_peaks.append(reserved)
            return seconds

        modes["cuda_malloc_async"] = async_run
        result["allocators"]["cuda_malloc_async"] = TORCH_BACKEND
    times = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, run in modes.items():
            times[mode].append(run())
    ww, seq, side, roomy = (statistics.median(times[m]) for m in list(modes)[:4])
    over = 3 * own / (capacity_b - 3 * fixed)
    result["b_job_peak_bytes"] = peak
    result["b_stream_fixed_bytes"] = fixed
    result["b_job_allocated_peak_bytes"] = allocated_peak
    result["b_budget_bytes"] = capacity_b
    result["b_summed_peaks_over_budget"] = round(over, 3)
    result["b_waterwave_peak_over_budget"] = round(max(waterwave_peaks) / capacity_b, 3)
    result["b_seconds"] = {"waterwave": round(ww, 3), "sequential": round(seq, 3), "processes": round(side, 3)}
    result["b_speedup_vs_sequential"] = round(seq / ww, 3)
    result["b_speedup_vs_processes"] = round(side / ww, 3)
    result["b_processes_would_need_budget_x"] = round(over, 3)
    print(f"(b) 3 jobs x {steps_b} steps, peaks {over:.2f}x the {capacity_b / 2**20:.1f} MiB budget "
          f"(waterwave's measured peak {max(waterwave_peaks) / capacity_b:.2f}x): "
          f"wwrun --policy waterwave {ww:.2f}s | --policy sequential {seq:.2f}s ({seq / ww:.2f}x) | "
          f"3 python processes {side:.2f}s ({side / ww:.2f}x), which need {over:.2f}x the budget")

    result["c_seconds"] = {"waterwave": round(roomy, 3), "processes": round(side, 3)}
    result["c_speedup_vs_processes"] = round(side / roomy, 3)
    print(f"(c) no oversubscription: wwrun --policy waterwave {roomy:.2f}s | 3 python processes "
          f"{side:.2f}s ({side / roomy:.2f}x)")
    if async_peaks:
        # The driver's pool has no gate: the jobs run at once at their summed peaks.
        driver = statistics.median(times["cuda_malloc_async"])
        result["bc_cuda_malloc_async_seconds"] = round(driver, 3)
        result["bc_cuda_malloc_async_peak_over_budget"] = round(max(async_peaks) / capacity_b, 3)
        result["b_speedup_vs_cuda_malloc_async"] = round(driver / ww, 3)
        result["c_speedup_vs_cuda_malloc_async"] = round(driver / roomy, 3)
        print(f"(b, c) 3 threads on {TORCH_BACKEND}: {driver:.2f}s at a peak "
              f"{max(async_peaks) / capacity_b:.2f}x the (b) budget (no gate); waterwave under the "
              f"budget {driver / ww:.2f}x, without oversubscription {driver / roomy:.2f}x its speed")


def part_d(result: dict, repeats: int, steps: int) -> None:
    # (d) one gate, and a single job's overhead: `wwrun train_job.py` (one job: plain
    # thread, and --policy waterwave) against `python train_job.py`, on the training
    # loop's time; a small iteration (a few ms: fixed costs per gate and per saved
    # tensor weigh most) and a larger one.
    result["d_gate_us"] = round(gate_cost_us(), 2)
    for label, batch_d, steps_d in (("small", 512, steps * 2), ("large", 4096, steps)):
        single = [job_args(256, batch_d, steps_d, 0)]
        loops = {"python": [], "wwrun": [], "wwrun_waterwave": []}
        outside = []  # the launch's wall time beyond the timed loop
        for _ in range(repeats):  # interleaved, so drift hits all alike
            loops["python"].append(processes(single))
            spans, run, _ = launched(single, "concurrent")
            loop = makespan(spans)
            loops["wwrun"].append(loop)
            outside.append(run.wall_s - loop)
            loops["wwrun_waterwave"].append(makespan(launched(single, "waterwave")[0]))
        result[f"d_launch_outside_loop_s_{label}"] = round(statistics.median(outside), 3)
        # The least of the runs: on a shared machine the noise only ever adds time.
        best = {k: min(v) for k, v in loops.items()}
        result[f"d_iteration_ms_{label}"] = round(best["python"] / steps_d * 1e3, 2)
        result[f"d_single_job_overhead_{label}"] = round(best["wwrun"] / best["python"] - 1, 4)
        result[f"d_single_job_overhead_waterwave_{label}"] = round(best["wwrun_waterwave"] / best["python"] - 1, 4)
        print(f"(d) one job, {best['python'] / steps_d * 1e3:.1f} ms per iteration under python: "
              f"wwrun {(best['wwrun'] / best['python'] - 1) * 100:+.2f}%, "
              f"wwrun --policy waterwave {(best['wwrun_waterwave'] / best['python'] - 1) * 100:+.2f}% "
              f"(medians {statistics.median(loops['wwrun']) / statistics.median(loops['python']) * 100 - 100:+.2f}%, "
              f"{statistics.median(loops['wwrun_waterwave']) / statistics.median(loops['python']) * 100 - 100:+.2f}%)")
    print(f"(d) a one-job launch's wall time beyond the timed loop (thread, script set-up, "
          f"2 warm-up steps, teardown): {result['d_launch_outside_loop_s_small']:.2f}s, "
          f"{result['d_launch_outside_loop_s_large']:.2f}s")
    print(f"(d) one gate: {result['d_gate_us']} µs")
    if DEVICE == "cpu":
        routing = allocator_benchmark.cpu_routing_cost(steps)["cpu_routing_ratio"] - 1
        result["d_cpu_allocator_routing_overhead"] = round(routing, 4)
        print(f"(d) routing a job's CPU memory through the allocator: {routing * 100:+.2f}% on a "
              f"training loop (benchmarks/allocator.py's, one thread)")
    # The engine's fixed cost per iteration, on a model so small that its compute
    # hardly counts (7 modules, 4 NodeGroups): a job in a memory session of the
    # launcher's (the allocator measuring, a roomy budget), with the engine
    # (waterwave) and without (concurrent). Interleaved, least of three each.
    tiny = [dict(width=16, batch=4, steps=2000, seed=0)]
    costs: dict[str, list[float]] = {"concurrent": [], "waterwave": []}
    for _ in range(3):
        for policy, runs in costs.items():
            drop_idle_reserve()
            memory = Memory(DEVICE, with_stream_workspaces(256 * 2**20, 1, DEVICE), policy)
            try:
                measured_on(memory.allocator, WWRUN, f"(d) {policy}")
                runs.append(run_threads(tiny, memory.session)[0] / 2000 * 1e6)
            finally:
                memory.close()
    result["d_iteration_us_tiny"] = round(min(costs["concurrent"]), 1)
    result["d_engine_us_per_iteration"] = round(min(costs["waterwave"]) - min(costs["concurrent"]), 1)
    print(f"(d) engine's fixed cost per iteration: {result['d_engine_us_per_iteration']:.0f} µs on a "
          f"{result['d_iteration_us_tiny']:.0f} µs iteration (7 modules, 4 NodeGroups: hooks, gates, "
          f"backward's progress)")


def part_e(result: dict, repeats: int, steps: int) -> None:
    # (e) steps bound by Python: a tiny MLP (a few hundred µs a step, nearly all of
    # it the interpreter and torch's dispatch), the regime of a small model on a GPU,
    # whose step is kernel launches. Threads of one process take turns at the GIL at
    # every torch call, so side by side they cannot beat one after another; what the
    # figures show is what the turns and the engine cost (the CPU (b) hides it: its
    # compute runs without the GIL).
    steps_e = steps * 15
    tiny_jobs = [job_args(16, 8, steps_e, seed) for seed in range(3)]
    budget_e = with_stream_workspaces(64 * 2**20, 3, DEVICE)
    modes_e = {
        "sequential": lambda: back_to_back(launched(tiny_jobs, "sequential")[0]),
        "concurrent": lambda: makespan(launched(tiny_jobs, "concurrent")[0]),
        "waterwave": lambda: makespan(launched(tiny_jobs, "waterwave", budget_e)[0]),
        "processes": lambda: processes(tiny_jobs),
    }
    times_e = {mode: [] for mode in modes_e}
    for _ in range(min(repeats, 3)):  # four launches of three jobs a repeat
        for mode, run in modes_e.items():
            times_e[mode].append(run())
    seconds_e = {mode: statistics.median(v) for mode, v in times_e.items()}
    result["e_steps"] = steps_e
    result["e_step_us_sequential"] = round(seconds_e["sequential"] / (3 * steps_e) * 1e6, 1)
    result["e_seconds"] = {mode: round(v, 3) for mode, v in seconds_e.items()}
    for mode in ("concurrent", "waterwave", "processes"):
        result[f"e_{mode}_vs_sequential"] = round(seconds_e["sequential"] / seconds_e[mode], 3)
    print(f"(e) steps bound by Python, 3 jobs x {steps_e} steps of {result['e_step_us_sequential']:.0f} µs: "
          f"vs --policy sequential, --policy concurrent {result['e_concurrent_vs_sequential']:.2f}x, "
          f"waterwave {result['e_waterwave_vs_sequential']:.2f}x (under {budget_e >> 20} MiB), "
          f"3 python processes {result['e_processes_vs_sequential']:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--out", help="write the JSON here (default: full runs of every part to "
                        "benchmarks/results/waterwave-<device>.json, others nowhere)")
    parser.add_argument("--parts", default="abcde", help="which parts to run (default abcde; "
                        "b and c run together): e.g. --parts de")
    args = parser.parse_args()
    parts = set(args.parts)
    if not parts or not parts <= set("abcde"):
        parser.error(f"--parts takes letters of abcde, got {args.parts!r}")
    global DEVICE
    DEVICE = args.device
    if DEVICE == "cuda":
        # Before any CUDA work in this process (the warm-up below is the first):
        # the launches find it installed instead of falling back to PyTorch's.
        allocator.install()
    torch.set_num_threads(1)
    repeats, steps = (2, 20) if args.quick else (5, 60)
    train(width=8, batch=2, steps=2, seed=0)  # one-time imports and warm-up
    width = 128
    cores = os.cpu_count()
    command = " ".join(["python benchmarks/waterwave.py", *(["--device", DEVICE] if DEVICE != "cpu" else []),
                        *(["--quick"] if args.quick else []), *(["--parts", args.parts] if parts != set("abcde") else [])])
    result: dict = {"device": DEVICE, "device_name": device_name(), "cpu_cores": cores, "threads_per_job": 1,
                    "torch": torch.__version__, "command": command, "quick": args.quick,
                    "load_average_at_start": round(os.getloadavg()[0], 2),  # others' work on shared cores
                    # What each mode ran on: wwrun's runs are checked as they end.
                    "allocator": WWRUN, "allocators": {"waterwave": WWRUN, "sequential": WWRUN,
                                                       "processes": "native"}}
    print(f"{DEVICE} ({result['device_name']}), {cores} CPU cores, one intra-op thread per job "
          f"(OMP_NUM_THREADS=1), torch {torch.__version__}, load average {result['load_average_at_start']}")

    if "a" in parts:
        part_a(result, width)
    if parts & {"b", "c"}:
        part_bc(result, width, repeats, steps)
    if "d" in parts:
        part_d(result, repeats, steps)
    if "e" in parts:
        part_e(result, repeats, steps)

    whole = not args.quick and parts == set("abcde")
    out = args.out or (os.path.join(RESULTS, f"waterwave-{DEVICE}.json") if whole else None)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


def device_name() -> str:
    if DEVICE == "cuda":
        return torch.cuda.get_device_name()
    return platform.processor() or platform.machine()


def gate_cost_us(n: int = 20000) -> float:
    """µs per admitted gate: the scheduler's Banker's check under the engine's lock,
    on the job's thread, with two other profiled jobs in the scheduler."""
    engine = Engine(1 << 34, "waterwave")
    for name in ("other0", "other1"):  # stand-ins: only their scheduler state matters
        engine.scheduler.enqueue(name)
        engine.scheduler.try_start(name)
        engine.scheduler.end_profile(name, 1 << 20)
    cost = []

    def measured():
        engine.job_started("gate")
        job = engine._jobs["gate"]
        engine.scheduler.end_profile("gate", 1 << 20)
        start = time.perf_counter()
        for _ in range(n):
            engine._gate(job, 1)
        cost.append((time.perf_counter() - start) / n * 1e6)
        engine.job_finished("gate")

    t = threading.Thread(target=measured)
    t.start()
    t.join()
    return cost[0]


if __name__ == "__main__":
    main()
