"""Which allocator a benchmark's figures measured, from what each run recorded.

Every wwrun run names the allocator that served its jobs (its report's and
RunResult's `allocator`, from `wwrun.memory.allocator.in_use`; a scale-out run, each
engine's). A benchmark checks that record against the allocator it claims to
measure and writes it into its JSON: a run that fell back to PyTorch's allocator
stops the benchmark instead of publishing PyTorch's figures as wwrun's (what
`wwrun doctor` checks again for the benchmarks it runs).
"""

from __future__ import annotations

WWRUN = "waterwave"  # wwrun's allocator, as `allocator.in_use` names it


def measured_on(allocator_name: str | None, expected: str, what: str) -> str:
    """The allocator a run recorded; an error when it is not the one it claims to
    measure (a fallback would publish another allocator's figures as ours)."""
    if allocator_name != expected:
        raise RuntimeError(f"{what} ran on the {allocator_name!r} allocator, not {expected!r}: "
                           "its figures would not be the ones it claims")
    return allocator_name


def with_stream_workspaces(limit: int, jobs: int, device: str) -> int:
    """The `--memory-limit` that leaves `jobs` jobs at once `limit` bytes of their own.
    On CUDA each job's stream workspaces (cuBLAS's, 65 MiB a job on an H200) live
    inside wwrun's limit, as in each process's allocator: budgets sized for the jobs'
    bytes add them on top, for wwrun and for processes alike. On the CPU: `limit`."""
    if device != "cuda":
        return limit
    from wwrun.memory import allocator

    return limit + jobs * allocator.measure_headroom().stream_fixed_bytes
