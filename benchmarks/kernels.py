"""Throughput of triton_kernels' fused copy and zeroing against plain torch, side by side.

    python benchmarks/kernels.py                   # on a GPU: also saved to
                                                   # benchmarks/results/kernels_<gpu>.json
    python benchmarks/kernels.py --out FILE.json   # write the JSON there instead

Cases (each measured for every implementation in the same run):
  large            8 tensors of 128 MiB (fp32-like sizes: 16-byte multiples)
  large_unaligned  8 tensors of 128 MiB + 1 byte: each packed tensor after the first
                   starts at an odd offset, so the kernel takes its byte-wide path
  small            1,000 tensors of 4 KiB (host overhead dominates: launches per tensor)
  d2h              (GPU only) the large case, device -> pinned host buffer
Reference: a single `copy_` of one contiguous tensor of the large case's total size:
the device's measured device-to-device copy bandwidth (and, for d2h, the plain pinned
`copy_` bandwidth). GB/s counts the bytes copied (or zeroed) once, for every row.

Timing: wall clock over `iters` back-to-back calls, then a device synchronize, so host
launch overhead counts as it does in a training step. Targets from the issue (GPU):
pack/unpack of large buffers >= 90% of device-to-device copy; >= 3x a per-tensor loop
for 1,000 small tensors; device -> pinned host >= 80% of a plain pinned copy_.

Without CUDA the script still runs, through Triton's interpreter on tiny sizes, so that
it is one command everywhere; those numbers say nothing about speed and are labelled so.
The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is first imported

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import triton  # noqa: E402

from triton_kernels import pack, unpack, zero_  # noqa: E402

MiB = 1 << 20


def sizes_for(device: str) -> dict:
    if device == "cuda":
        return {"large": [128 * MiB] * 8, "large_unaligned": [128 * MiB + 1] * 8,
                "small": [4096] * 1000, "iters": 20, "repeats": 5}
    # Interpreter: every program runs as Python; keep it to seconds.
    return {"large": [128 * 1024] * 4, "large_unaligned": [128 * 1024 + 1] * 4,
            "small": [256] * 100, "iters": 2, "repeats": 3}


def synchronize(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def seconds_per_call(fn, device: str, iters: int, repeats: int) -> float:
    """Median over `repeats` of (wall time of `iters` calls + synchronize) / iters."""
    fn()  # warm-up: compiles the kernel, fills allocator caches
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) / iters)
    return statistics.median(samples)


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.reshape(-1).view(torch.uint8)


def copy_implementations(tensors, buffer):
    """name -> (pack fn, unpack fn) writing into / reading from the same preallocated buffer."""
    views = [byte_view(t) for t in tensors]
    slices = list(buffer.split([v.numel() for v in views]))  # the packed layout
    def copy_loop_pack():
        for dst, src in zip(slices, views):
            dst.copy_(src, non_blocking=True)
    def copy_loop_unpack():
        for dst, src in zip(views, slices):
            dst.copy_(src, non_blocking=True)
    impls = {
        "triton": (lambda: pack(tensors, out=buffer), lambda: unpack(buffer, tensors)),
        "copy_ loop": (copy_loop_pack, copy_loop_unpack),
        "_foreach_copy_": (lambda: torch._foreach_copy_(slices, views, non_blocking=True),
                           lambda: torch._foreach_copy_(views, slices, non_blocking=True)),
    }
    if buffer.device == tensors[0].device:
        impls["torch.cat"] = (lambda: torch.cat(views, out=buffer), None)
    return impls


def zero_implementations(tensors):
    def zero_loop():
        for tensor in tensors:
            tensor.zero_()
    return {"triton": lambda: zero_(tensors), "zero_ loop": zero_loop,
            "_foreach_zero_": lambda: torch._foreach_zero_(tensors)}


def make_tensors(sizes, device):
    return [torch.randint(0, 256, (n,), dtype=torch.uint8, device=device) for n in sizes]


def run(device: str) -> dict:
    config = sizes_for(device)
    timing = dict(device=device, iters=config["iters"], repeats=config["repeats"])
    rows = []

    def measure(case, op, impl, fn, nbytes):
        try:
            seconds = seconds_per_call(fn, **timing)
        except (RuntimeError, ValueError) as error:  # a baseline torch does not support here
            print(f"skipped {case}/{op}/{impl}: {str(error).splitlines()[0]}")
            return
        rows.append(dict(case=case, op=op, impl=impl, bytes=nbytes, seconds=seconds, gbps=nbytes / seconds / 1e9))

    # Reference: one contiguous copy of the large case's total size.
    total = sum(config["large"])
    src, dst = make_tensors([total, total], device)
    measure("reference", "copy", "d2d copy_", lambda: dst.copy_(src), total)
    del src, dst

    for case in ("large", "large_unaligned", "small"):
        tensors = make_tensors(config[case], device)
        nbytes = sum(config[case])
        buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        for impl, (pack_fn, unpack_fn) in copy_implementations(tensors, buffer).items():
            measure(case, "pack", impl, pack_fn, nbytes)
            if unpack_fn is not None:
                measure(case, "unpack", impl, unpack_fn, nbytes)
        for impl, fn in zero_implementations(tensors).items():
            measure(case, "zero", impl, fn, nbytes)
        del tensors, buffer

    if device == "cuda":
        tensors = make_tensors(config["large"], device)
        host = torch.empty(total, dtype=torch.uint8).pin_memory()
        one = torch.cat(tensors)
        measure("reference", "d2h", "pinned copy_", lambda: host.copy_(one, non_blocking=True), total)
        del one
        for impl, (pack_fn, unpack_fn) in copy_implementations(tensors, host).items():
            measure("d2h", "pack", impl, pack_fn, total)
            measure("d2h", "unpack (h2d)", impl, unpack_fn, total)
    return rows


def gbps(rows, case, op, impl):
    return next((r["gbps"] for r in rows if (r["case"], r["op"], r["impl"]) == (case, op, impl)), float("nan"))


def summarize(rows, device: str) -> dict:
    d2d = gbps(rows, "reference", "copy", "d2d copy_")
    ratios = {
        "pack_large_vs_d2d_copy": gbps(rows, "large", "pack", "triton") / d2d,
        "unpack_large_vs_d2d_copy": gbps(rows, "large", "unpack", "triton") / d2d,
        "pack_large_unaligned_vs_d2d_copy": gbps(rows, "large_unaligned", "pack", "triton") / d2d,
        "pack_small_vs_copy_loop": gbps(rows, "small", "pack", "triton") / gbps(rows, "small", "pack", "copy_ loop"),
        "unpack_small_vs_copy_loop": gbps(rows, "small", "unpack", "triton") / gbps(rows, "small", "unpack", "copy_ loop"),
        "zero_large_vs_foreach_zero": gbps(rows, "large", "zero", "triton") / gbps(rows, "large", "zero", "_foreach_zero_"),
        "zero_small_vs_zero_loop": gbps(rows, "small", "zero", "triton") / gbps(rows, "small", "zero", "zero_ loop"),
        "zero_small_vs_foreach_zero": gbps(rows, "small", "zero", "triton") / gbps(rows, "small", "zero", "_foreach_zero_"),
    }
    targets = {"pack_large_vs_d2d_copy": 0.9, "unpack_large_vs_d2d_copy": 0.9,
               "pack_small_vs_copy_loop": 3.0, "unpack_small_vs_copy_loop": 3.0}
    if device == "cuda":
        pinned = gbps(rows, "reference", "d2h", "pinned copy_")
        ratios["pack_d2h_vs_pinned_copy"] = gbps(rows, "d2h", "pack", "triton") / pinned
        ratios["unpack_h2d_vs_pinned_copy"] = gbps(rows, "d2h", "unpack (h2d)", "triton") / pinned
        targets["pack_d2h_vs_pinned_copy"] = 0.8
    return {
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": {k: {"min": v, "ratio": round(ratios[k], 3), "met": bool(ratios[k] >= v)}
                    for k, v in targets.items()},
    }


def print_table(rows) -> None:
    print(f"{'case':<16} {'op':<13} {'impl':<15} {'bytes':>13} {'GB/s':>9} {'triton/this':>12}")
    for row in rows:
        triton_row = next((r for r in rows if (r["case"], r["op"], r["impl"]) == (row["case"], row["op"], "triton")), None)
        ratio = f"{triton_row['gbps'] / row['gbps']:.3g}x" if triton_row and row["impl"] != "triton" else ""
        print(f"{row['case']:<16} {row['op']:<13} {row['impl']:<15} {row['bytes']:>13} {row['gbps']:>9.4g} {ratio:>12}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path,
                        help="write the JSON result here (default on a GPU: benchmarks/results/kernels_<gpu>.json)")
    args = parser.parse_args(argv)
    device = "cuda" if HAS_CUDA else "cpu"
    meaningful = device == "cuda"
    name = torch.cuda.get_device_name() if meaningful else platform.processor() or "cpu"
    if not meaningful:
        print("NOTE: no CUDA device: kernels run in Triton's interpreter on tiny sizes. "
              "These numbers are NOT meaningful for speed; they only show the script runs.")
    print(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}")
    rows = run(device)
    print_table(rows)
    summary = summarize(rows, device)
    for key, value in summary["ratios"].items():
        target = summary["targets"].get(key)
        verdict = "" if target is None or not meaningful else f"  (target >= {target['min']}: {'met' if target['met'] else 'NOT met'})"
        print(f"{key:<36} {value:>8.3f}{verdict}")
    result = {"benchmark": "kernels", "device": name, "meaningful_for_speed": meaningful,
              "torch": torch.__version__, "triton": triton.__version__, **summary,
              "rows": [{**r, "gbps": round(r["gbps"], 3), "seconds": float(f"{r['seconds']:.6g}")} for r in rows]}
    out = args.out
    if out is None and meaningful:
        slug = "".join(c if c.isalnum() else "_" for c in name.lower()).strip("_")
        out = Path(__file__).resolve().parent / "results" / f"kernels_{slug}.json"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"saved {out}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
