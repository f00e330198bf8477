"""Waterwave's experiments, reproduced on one machine (IEEE TC 72(10), 2023, §Evaluation).

    PYTHONPATH=. python benchmarks/waterwave.py            # CPU, --memory-limit style budget
    PYTHONPATH=. python benchmarks/waterwave.py --quick    # fewer steps and repeats

Until the launcher is wired in, plain threads stand in for it: each job is a
training loop (an MLP on synthetic data, explicit torch.Generator) run in its own
thread between `engine.job_started` and `engine.job_finished`, exactly the calls the
launcher makes. Every job uses one intra-op thread (as a small job leaves most of a
GPU idle); the sequential baseline is also timed with all cores.

(a) largest batch per job with 2 and 3 jobs sharing the budget, as a fraction of the
    job's solo maximum: waterwave, and spatial sharing (every job's whole peak must
    fit, as with processes or MPS side by side). Found by bisection on real runs:
    a batch "trains" when every job finishes and the measured peak stays in budget.
(b) oversubscription: 3 jobs whose summed peaks are ~1.5x the budget, waterwave
    against sequential (temporal sharing). Separate processes side by side would
    need 1.5x the budget: on the CPU nothing stops them, so their time is shown
    with the budget they would have exceeded.
(c) no oversubscription: 3 jobs under waterwave against 3 separate processes.
(d) the cost of one gate (an admission decision on the job's thread, µs), the
    engine's fixed cost per iteration (µs, on a tiny model), and a single job's
    overhead under waterwave against the same loop without wwrun.

Prints the figures, then LAST one JSON object on one line; full runs also save it
to benchmarks/results/waterwave-<device>.json. On a GPU the same experiments are one
command, `python benchmarks/waterwave.py --device cuda` (never run: the machine it
was written on has no GPU; the budget is then kept by the engine's device-independent
saved-tensor accounting, not yet by the allocator's stats).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from wwrun.engine import Engine, JobTooLarge  # noqa: E402

INPUTS, CLASSES = 32, 10
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


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


def run_threads(engine: Engine | None, jobs: list[dict]) -> tuple[float, dict]:
    """Run jobs as threads (the launcher's stand-in); (wall seconds, name -> error or None)."""
    errors: dict[str, BaseException | None] = {}

    def body(name, spec):
        if engine is not None:
            engine.job_started(name)
        try:
            train(**spec)
            errors[name] = None
        except Exception as err:
            errors[name] = err
        finally:
            if engine is not None:
                engine.job_finished(name)

    threads = [threading.Thread(target=body, args=(f"job{i}", spec)) for i, spec in enumerate(jobs)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return time.perf_counter() - start, errors


def trains(jobs: list[dict], capacity: int, policy: str) -> bool:
    """Whether the jobs train together within `capacity`.

    waterwave: every job finishes, all ran at the same time at some point (none just
    queued behind the others) and the measured peak stayed in budget. concurrent
    (spatial sharing): the jobs' peaks must fit side by side, as separate processes
    each keeping their peak (caching allocators) would need."""
    engine = Engine(capacity, policy)
    _, errors = run_threads(engine, jobs)
    if any(e is not None and not isinstance(e, JobTooLarge) for e in errors.values()):
        raise next(e for e in errors.values() if e is not None)
    if any(e is not None for e in errors.values()):
        return False
    if policy != "waterwave":
        return sum(engine.job_report(name)["peak_memory_bytes"] for name in errors) <= capacity
    runs = [engine._jobs[name] for name in errors]
    together = max(j.admitted for j in runs) < min(j.ended for j in runs)
    return together and engine.run_report()["peak_memory_bytes"] <= capacity


def largest_batch(count: int, width: int, capacity: int, policy: str, high: int) -> int:
    low = 0  # largest batch known to train
    while low < high:
        mid = (low + high + 1) // 2
        if trains([dict(width=width, batch=mid, steps=6, seed=i) for i in range(count)], capacity, policy):
            low = mid
        else:
            high = mid - 1
    return low


def job_peak(width: int, batch: int) -> int:
    engine = Engine(None, "concurrent")
    run_threads(engine, [dict(width=width, batch=batch, steps=2, seed=0)])
    return engine.job_report("job0")["peak_memory_bytes"]


def processes(jobs: list[dict]) -> float:
    """The jobs as separate processes side by side (spatial sharing): seconds from a
    common start (every worker has imported torch and waits on stdin) to the last
    job's end (its "done"; interpreter start and exit, ~2 s each with torch, excluded)."""
    procs = [
        subprocess.Popen([sys.executable, __file__, "--device", DEVICE, "--worker", json.dumps(spec)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for spec in jobs
    ]
    for p in procs:
        assert p.stdout.readline().strip() == "ready"
    start = time.perf_counter()
    for p in procs:
        p.stdin.write("go\n")
        p.stdin.flush()
    for p in procs:
        if p.stdout.readline().strip() != "done":
            raise RuntimeError("a worker process failed")
    elapsed = time.perf_counter() - start
    for p in procs:
        p.wait()
    return elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    torch.set_num_threads(1)
    if args.worker:
        spec = json.loads(args.worker)
        # One-time imports, and the allocator's warm-up (glibc raises its mmap threshold
        # after the first large frees), as the parent process has had them.
        train(**{**spec, "steps": 2})
        print("ready", flush=True)
        sys.stdin.readline()
        train(**spec)
        print("done", flush=True)
        return
    repeats, steps = (3, 10) if args.quick else (5, 30)
    train(width=8, batch=2, steps=2, seed=0)  # one-time imports and warm-up
    width = 128
    result: dict = {"device": DEVICE, "threads_per_job": 1, "torch": torch.__version__, "quick": args.quick}

    # (a) largest batch, solo and shared.
    capacity_a = 32 * 2**20
    solo = largest_batch(1, width, capacity_a, "waterwave", high=1 << 16)
    fractions = {}
    for count in (2, 3):
        for policy, label in (("waterwave", "waterwave"), ("concurrent", "spatial")):
            shared = largest_batch(count, width, capacity_a, policy, high=solo)
            fractions[f"{label}_{count}jobs"] = round(shared / solo, 4)
    print(f"(a) budget {capacity_a >> 20} MiB, solo max batch {solo}; shared / solo: {fractions}")
    result["a_solo_max_batch"] = solo
    result["a_batch_fraction"] = fractions

    # (b) oversubscription: 3 jobs, summed peaks ~1.5x the budget.
    batch = 2048
    peak = job_peak(width, batch)
    capacity_b = int(3 * peak / 1.5)
    jobs = [dict(width=width, batch=batch, steps=steps, seed=i) for i in range(3)]

    def waterwave_run():
        engine = Engine(capacity_b, "waterwave")
        wall, errors = run_threads(engine, jobs)
        assert all(e is None for e in errors.values()), errors
        assert engine.run_report()["peak_memory_bytes"] <= capacity_b
        return wall

    def sequential_run(threads=1):
        torch.set_num_threads(threads)
        try:
            return sum(run_threads(None, [spec])[0] for spec in jobs)
        finally:
            torch.set_num_threads(1)

    def waterwave_roomy():  # (c): no oversubscription, everything fits at once
        engine = Engine(4 * peak, "waterwave")
        wall, errors = run_threads(engine, jobs)
        assert all(e is None for e in errors.values()), errors
        return wall

    # Interleaved repeats, so that the load of a shared machine drifts over all alike.
    modes = {
        "ww": waterwave_run, "seq": sequential_run,
        "seq_all": lambda: sequential_run(os.cpu_count() or 1),
        "side": lambda: processes(jobs), "roomy": waterwave_roomy,
    }
    times = {mode: [] for mode in modes}
    for _ in range(repeats):
        for mode, run in modes.items():
            times[mode].append(run())
    ww, seq, seq_all, side, roomy = (statistics.median(times[m]) for m in modes)
    result["b_summed_peaks_over_budget"] = round(3 * peak / capacity_b, 3)
    result["b_speedup_vs_sequential"] = round(seq / ww, 3)
    result["b_speedup_vs_sequential_all_cores"] = round(seq_all / ww, 3)
    result["b_processes_side_by_side_s"] = round(side, 3)
    result["b_processes_would_need_budget_x"] = round(3 * peak / capacity_b, 3)
    print(f"(b) 3 jobs, peaks {3 * peak / capacity_b:.2f}x the budget: waterwave {ww:.2f}s, "
          f"sequential {seq:.2f}s ({seq / ww:.2f}x), sequential on all cores {seq_all:.2f}s "
          f"({seq_all / ww:.2f}x); processes side by side {side:.2f}s but need "
          f"{3 * peak / capacity_b:.2f}x the budget")

    result["c_speedup_vs_processes"] = round(side / roomy, 3)
    print(f"(c) no oversubscription: waterwave {roomy:.2f}s, processes {side:.2f}s ({side / roomy:.2f}x)")

    # (d) one gate, and a single job's overhead: a tiny iteration (a few ms, the
    # worst case: the cost per gate and per saved tensor is fixed) and a larger one.
    result["d_gate_us"] = round(gate_cost_us(), 2)
    for label, batch_d in (("small", 512), ("large", 4096)):
        single = [dict(width=256, batch=batch_d, steps=steps * 2, seed=0)]
        plain_s, engine_s = [], []
        for _ in range(repeats):  # interleaved, so drift hits both alike
            plain_s.append(run_threads(None, single)[0])
            engine_s.append(run_threads(Engine(1 << 34, "waterwave"), single)[0])
        # The least of the runs: on a shared machine the noise only ever adds time.
        overhead = min(engine_s) / min(plain_s) - 1
        result[f"d_single_job_overhead_{label}"] = round(overhead, 4)
        result[f"d_iteration_ms_{label}"] = round(min(plain_s) / (steps * 2) * 1e3, 2)
        print(f"(d) a single job under waterwave, {min(plain_s) / (steps * 2) * 1e3:.1f} ms per "
              f"iteration: {overhead * 100:+.2f}% (median {statistics.median(engine_s) / statistics.median(plain_s) * 100 - 100:+.2f}%)")
    print(f"(d) one gate: {result['d_gate_us']} µs")
    # The engine's fixed cost per iteration, on a model so small that its compute
    # hardly counts (7 modules, 4 NodeGroups, 7 saved tensors): robust to noise.
    tiny = [dict(width=16, batch=4, steps=2000, seed=0)]
    costs = {}
    for policy in (None, "concurrent", "waterwave"):
        runs = [run_threads(Engine(1 << 34, policy) if policy else None, tiny)[0] for _ in range(3)]
        costs[policy] = min(runs) / 2000 * 1e6
    result["d_measuring_us_per_iteration"] = round(costs["concurrent"] - costs[None], 1)
    result["d_gating_us_per_iteration"] = round(costs["waterwave"] - costs["concurrent"], 1)
    print(f"(d) fixed cost per iteration: {costs['concurrent'] - costs[None]:.0f} µs measuring memory"
          f" (saved-tensor hooks), {costs['waterwave'] - costs['concurrent']:.0f} µs gating 4 NodeGroups")
    if not args.quick:
        os.makedirs(RESULTS, exist_ok=True)
        with open(os.path.join(RESULTS, f"waterwave-{DEVICE}.json"), "w") as f:
            json.dump(result, f, indent=1)
    print(json.dumps(result))


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
            engine._gate(job, 1, 0)
        cost.append((time.perf_counter() - start) / n * 1e6)
        engine.job_finished("gate")

    t = threading.Thread(target=measured)
    t.start()
    t.join()
    return cost[0]


if __name__ == "__main__":
    main()
