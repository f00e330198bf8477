"""wwrun's C++ parts, all at once: `wwrun build` and the doctor build (or load) every
part ahead of a run. Above wwrun.build, which each part uses to build itself."""

from __future__ import annotations

import time


def build_all(cuda: bool) -> dict[str, float]:
    """Builds every C++ part of wwrun, or loads it where built before: the host and
    CPU allocators, the per-job generators and, with `cuda`, the CUDA allocator.
    Seconds each took, by part (about 0 for one built before). Raises BuildError."""
    from wwrun import rng
    from wwrun.memory import allocator

    kinds = ["host", "cpu", "cuda"] if cuda else ["host", "cpu"]
    parts = {kind: (lambda kind=kind: allocator._extension(kind)) for kind in kinds}
    parts["rng"] = rng._build_extension
    seconds = {}
    for part, make in parts.items():
        started = time.monotonic()
        make()
        seconds[part] = round(time.monotonic() - started, 2)
    return seconds
