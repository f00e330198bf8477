"""What per-job random state costs a job (wwrun/rng.py, csrc/rng/).

(1) training steps of a small MLP with dropout (forward, backward, SGD), in a thread
    that is a job's (`rng.enter_job()`) against a plain thread. Target: <= 2%.
(2) per call: a non-random op (`add`, falls through the job key), a random op
    (`rand`, its generator substituted), and `rand` inside a TorchDispatchMode (the
    job's state swapped into torch's generator for the call).

Variants interleaved, medians of --repeats rounds; one intra-op thread (OMP spin-waits
on a shared machine would measure the machine). The last line is one JSON object.

    python benchmarks/rng.py [--repeats 7] [--steps 300] [--calls 20000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from wwrun import rng  # noqa: E402


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def in_thread(fn, as_job: bool) -> float:
    """Seconds `fn` takes in a fresh thread, a job's or a plain one."""
    out = {}

    def main():
        if as_job:
            rng.enter_job()
        torch.manual_seed(0)
        start = time.perf_counter()
        fn()
        out["s"] = time.perf_counter() - start
        if as_job:
            rng.leave_job()

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    return out["s"]


def training(steps: int):
    model = torch.nn.Sequential(
        torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Dropout(0.1),
        torch.nn.Linear(256, 10),
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 128), torch.randint(0, 10, (64,))

    def run():
        for _ in range(steps):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()

    return run


def calls(kind: str, n: int):
    a, b = torch.ones(4), torch.ones(4)

    def add():
        for _ in range(n):
            torch.add(a, b)

    def rand():
        for _ in range(n):
            torch.rand(4)

    def rand_in_mode():
        with _Passthrough():
            for _ in range(n):
                torch.rand(4)

    return {"add": add, "rand": rand, "rand_in_mode": rand_in_mode}[kind]


def compare(fn, repeats: int) -> tuple[float, float]:
    plain, job = [], []
    for _ in range(repeats):
        plain.append(in_thread(fn, as_job=False))
        job.append(in_thread(fn, as_job=True))
    return statistics.median(plain), statistics.median(job)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--calls", type=int, default=20000)
    args = parser.parse_args()
    if args.repeats < 5:
        parser.error("--repeats must be at least 5 (medians of at least 5 rounds)")
    torch.set_num_threads(1)
    rng.install()
    in_thread(training(20), as_job=True)  # warm up

    plain, job = compare(training(args.steps), args.repeats)
    overhead = (job / plain - 1) * 100
    figures = {
        "benchmark": "rng",
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "repeats": args.repeats,
        "train_steps": args.steps,
        "train_step_ms_plain": round(plain / args.steps * 1e3, 4),
        "train_step_ms_job": round(job / args.steps * 1e3, 4),
        "train_overhead_pct": round(overhead, 2),
        "target_pct": 2.0,
    }
    print(f"training step: {figures['train_step_ms_plain']} ms plain, {figures['train_step_ms_job']} ms in a job "
          f"({overhead:+.2f}%)")
    for kind in ("add", "rand", "rand_in_mode"):
        plain, job = compare(calls(kind, args.calls), args.repeats)
        figures[f"{kind}_us_plain"] = round(plain / args.calls * 1e6, 3)
        figures[f"{kind}_us_job"] = round(job / args.calls * 1e6, 3)
        print(f"{kind}: {figures[f'{kind}_us_plain']} us plain, {figures[f'{kind}_us_job']} us in a job")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
