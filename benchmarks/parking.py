"""Parking's cost: how fast a job's pages go to host memory and come back.

    python benchmarks/parking.py                       # the host backend (CPU)
    python benchmarks/parking.py --device cuda --out F   # a GPU: wwrun's CUDA allocator

When jobs that outgrew their plans at once each hold what the others need, the one
that gives way parks (Note [Parking] in csrc/allocator/allocator_core.cpp): the pages
under its live tensors are copied to host memory at the same addresses, and back
when there is room. Both copies run under the allocator's lock, so every other
job's allocations wait for them. Here job A holds --mib MiB (64 MiB tensors, no
two of their pages alike), and `park_job` then `unpark_job` run --repeats times
after an untimed round; reported: the median GB/s of each (GB = 1e9 bytes), the
slowest park in seconds, and whether every byte came back. A GPU whose driver makes no pinned host memory
for the virtual memory API reports `can_park: false` and nothing else. Prints the
figures, then LAST one JSON object on one line, with the allocator measured
(`allocator`: wwrun's, a fallback to PyTorch's stops it) and its `backend`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's wwrun
sys.path.append(HERE)  # benchmarks/measured.py
from measured import WWRUN, measured_on  # noqa: E402

MiB = 1 << 20
TENSOR = 64 * MiB


def on_host(nbytes: int, repeats: int) -> dict:
    """The host backend (the CPU run's): HostAllocator, job A on stream 1."""
    from wwrun.memory.allocator import HostAllocator

    alloc = HostAllocator(2 * nbytes + 64 * MiB)
    alloc.register_stream(1, "A")
    ptrs = [alloc.alloc(TENSOR, 1) for _ in range(nbytes // TENSOR)]
    contents = [random.Random(i).randbytes(TENSOR) for i in range(len(ptrs))]  # no two pages alike
    for ptr, content in zip(ptrs, contents):
        alloc.write(ptr, content)

    def intact() -> bool:
        return all(alloc.read(ptr, TENSOR) == content for ptr, content in zip(ptrs, contents))

    figures = _timed(lambda: alloc.park_job("A"), lambda: alloc.unpark_job("A"), repeats)
    return {**figures, "intact": intact(), "allocator": WWRUN, "backend": "host", "can_park": alloc.can_park()}


def on_cuda(nbytes: int, repeats: int) -> dict:
    """wwrun's CUDA allocator, installed before CUDA starts; job A on a stream of its own."""
    from wwrun.memory import allocator

    allocator.install()
    import torch

    used = measured_on(allocator.in_use("cuda"), WWRUN, "job A's tensors")
    if not allocator.can_park("cuda"):
        return {"can_park": False, "allocator": used, "backend": "cuda"}
    stream = torch.cuda.Stream()
    allocator.register_stream(stream, "A")
    n = TENSOR // 4

    def content(i: int):  # no two pages alike
        return torch.arange(i * n, (i + 1) * n, dtype=torch.int32, device="cuda")

    with torch.cuda.stream(stream):
        tensors = [content(i) for i in range(nbytes // TENSOR)]
    torch.cuda.synchronize()

    def intact() -> bool:
        with torch.cuda.stream(stream):
            return all(torch.equal(t, content(i)) for i, t in enumerate(tensors))

    figures = _timed(lambda: allocator.park_job("A", "cuda"), lambda: allocator.unpark_job("A", "cuda"), repeats)
    return {**figures, "intact": intact(), "allocator": used, "backend": "cuda", "can_park": True,
            "device_name": torch.cuda.get_device_name()}


def _timed(park, unpark, repeats: int) -> dict:
    """One untimed round first (a GPU's copy stream and scratch page are made then)."""
    parks, unparks, parked = [], [], set()
    for round_ in range(repeats + 1):
        start = time.perf_counter()
        parked.add(park())
        parked_s = time.perf_counter() - start
        start = time.perf_counter()
        if not unpark():
            raise RuntimeError("unpark_job found no room for the parked pages")
        if round_:
            parks.append(parked_s)
            unparks.append(time.perf_counter() - start)
    if len(parked) != 1 or not min(parked):
        raise RuntimeError(f"park_job parked {sorted(parked)} bytes in its rounds, not one same amount")
    parked = parked.pop()
    return {"parked_bytes": parked, "repeats": repeats,
            "park_gb_per_s": round(parked / statistics.median(parks) / 1e9, 3),
            "unpark_gb_per_s": round(parked / statistics.median(unparks) / 1e9, 3),
            "slowest_park_s": round(max(parks), 4)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mib", type=int, default=None,
                        help="what job A holds (default: 256 on the CPU, 2048 on a GPU)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", help="also write the JSON here")
    args = parser.parse_args()
    mib = args.mib or (2048 if args.device == "cuda" else 256)
    if mib * MiB < TENSOR or mib * MiB % TENSOR or args.repeats < 1:
        parser.error(f"--mib must be a multiple of {TENSOR // MiB} and --repeats at least 1")
    run = on_cuda if args.device == "cuda" else on_host
    figures = {"device": args.device, "command": " ".join(["python", *sys.argv]), "mib": mib,
               **run(mib * MiB, args.repeats)}
    import torch

    figures["torch"] = torch.__version__
    if "park_gb_per_s" in figures:
        print(f"parked {figures['parked_bytes'] / MiB:.0f} MiB: park {figures['park_gb_per_s']} GB/s, unpark "
              f"{figures['unpark_gb_per_s']} GB/s (median of {args.repeats}), slowest park "
              f"{figures['slowest_park_s']} s; bytes back intact: {figures['intact']}", flush=True)
    print(json.dumps(figures))
    if args.out:
        Path(args.out).write_text(json.dumps(figures, indent=1) + "\n")
    if figures.get("intact") is False:
        sys.exit("parking: the bytes that came back are not the ones parked")


if __name__ == "__main__":
    main()
