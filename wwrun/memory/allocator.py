"""The memory-flow allocator's Python face.

The allocator itself is C++ (`csrc/allocator/`, policy a-g at the top of
`waterwave_allocator.h`), built at first use against the installed torch (`wwrun.build`: cached under
torch's extensions folder, keyed by the sources):

- `HostAllocator`: the allocator on host memory with simulated streams and events,
  for tests and the host benchmark; needs no CUDA.
- `install()`: replaces PyTorch's CUDA caching allocator, before any CUDA work.
  Then `new_job_stream` (a dedicated stream per job), `register_stream` /
  `unregister_job` (called by the launcher from each job's thread), `stats`,
  `job_stats`, `set_expected_releases` (rule f, called by the scheduler), and
  `device_capacity` (what the device can really give the jobs).

When a job ends, `unregister_job` scrubs the free blocks still holding its data in
one launch of `triton_kernels.zero_ranges_` on a dedicated scrub stream (Note
[Batched scrub] in the header); without Triton, those blocks are zeroed one by one
when another job takes them, as always.

Reference: Waterwave (IEEE TC 72(10), 2023), the synchronization-state-aware
allocator; PyTorch's `c10/cuda/CUDACachingAllocator.h`.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from wwrun import build, forksafe

__all__ = [
    "AllocationTrace",
    "Headroom",
    "HostAllocator",
    "can_park",
    "capacity_headroom",
    "close_admission",
    "cpu_empty_cache",
    "cpu_job_stats",
    "cpu_reset_peak_stats",
    "cpu_set_expected_releases",
    "cpu_stats",
    "cpu_unregister_job",
    "device_capacity",
    "drop_idle_workspaces",
    "install",
    "in_use",
    "install_cpu_allocator",
    "is_cpu_allocator_installed",
    "is_installed",
    "is_job_thread",
    "job_meter",
    "job_stats",
    "mark_job_thread",
    "measure_headroom",
    "new_job_stream",
    "open_admission",
    "park_job",
    "register_stream",
    "set_admission_callback",
    "set_expected_releases",
    "set_limit_callback",
    "source_dir",
    "stats",
    "stream_fixed_cost",
    "uninstall_cpu_allocator",
    "unmark_job_thread",
    "unpark_job",
    "unregister_job",
    "warm_job_stream",
]

_CORE_SOURCES = ["allocator_core.cpp"]
_HOST_SOURCES = ["host_backend.cpp", "host_bindings.cpp"]
_CPU_SOURCES = ["host_backend.cpp", "cpu_allocator.cpp"]
_CUDA_SOURCES = ["cuda_backend.cpp", "torch_cuda_allocator.cpp", "cuda_bindings.cpp"]
_CXX_FLAGS = ["-O3", "-Wall"]  # the language standard is torch's choice
DEFAULT_RELEASE_WAIT_S = 2.0
# device_capacity keeps back what the device will give outside any allocator
# after its warm-up: CAPACITY_HEADROOM_BYTES for what no warm-up foresees
# (kernels load lazily on first use, CUDA_MODULE_LOADING=LAZY, and a mix of
# models' first passes loads hundreds; the driver's local memory for spilling
# kernels; NCCL), plus, for each job at once, what one more thread's first
# cuBLAS/cuDNN/Triton use was measured to take (its own handles;
# `measure_headroom`). A job that finds the device fuller than the budget says
# fails at a kernel launch with an error from the driver, not one of ours, so
# this errs on the large side.
CAPACITY_HEADROOM_BYTES = 512 << 20
HEADROOM_PROBE_THREADS = 2  # threads measure_headroom warms up besides the caller
_PROBE_WAIT_S = 120.0  # a probe thread's warm-up: first kernel loads, a Triton compile

_build_lock = forksafe.Lock()
_modules: dict[str, object] = {}
_batched_scrub_failed = False  # a launch failed once: zero at hand-out from then on


def source_dir() -> Path:
    """The allocator's C++ sources: `csrc/allocator` of a checkout, or the copy
    installed as package data (`wwrun/csrc/allocator`) by a non-editable install."""
    package = Path(__file__).resolve().parent.parent  # wwrun/
    for candidate in (package / "csrc" / "allocator", package.parent / "csrc" / "allocator"):
        if (candidate / "waterwave_allocator.h").is_file():
            return candidate
    raise RuntimeError(
        f"wwrun allocator: C++ sources not found next to {package} "
        "(expected csrc/allocator in the checkout or in the installed package)"
    )


_WHAT = {"host": "wwrun's host allocator", "cpu": "wwrun's allocator", "cuda": "wwrun's allocator"}


def _build_args(kind: str) -> dict:
    src = source_dir()
    extra = {"host": _HOST_SOURCES, "cpu": _CPU_SOURCES, "cuda": _CUDA_SOURCES}[kind]
    return dict(
        name=f"wwrun_allocator_{kind}",
        sources=[src / name for name in _CORE_SOURCES + extra],
        extra_cflags=_CXX_FLAGS,
        extra_include_paths=[src, src.parent / "common"],
        with_cuda=kind == "cuda",
    )


def build_directory(kind: str) -> Path:
    """Where the `kind` build ("host", "cpu" or "cuda") lives (wwrun.build)."""
    return build.build_directory(**_build_args(kind))


def _extension(kind: str):
    """The compiled module for `kind` ("host", "cpu" or "cuda"), built once per machine
    and source change (wwrun.build); raises wwrun.build.BuildError."""
    with _build_lock:
        if kind not in _modules:
            _modules[kind] = build.load(**_build_args(kind), what=_WHAT[kind])
        return _modules[kind]


def _check_job(job: str) -> str:
    if not isinstance(job, str) or not job:
        raise ValueError(f"job must be a non-empty string, got {job!r}")
    return job


def _check_bytes(value: int | None, name: str = "memory_limit") -> int:
    """A positive byte count; None becomes 0, which means "no limit" to the C++ side."""
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive number of bytes, got {value!r}")
    return value


def _expected_jobs(jobs: Iterable[str] | Mapping[str, int]) -> list[str]:
    """Job names from a list of names or a {job: bytes about to be freed} map."""
    if isinstance(jobs, Mapping):
        return [_check_job(job) for job, nbytes in jobs.items() if nbytes > 0]
    if isinstance(jobs, str):
        raise ValueError("expected releases must be a list of job names or a {job: bytes} map")
    return [_check_job(job) for job in jobs]


def _check_wait(timeout_s: float) -> float:
    if not timeout_s >= 0:
        raise ValueError(f"timeout_s must be >= 0, got {timeout_s!r}")
    return float(timeout_s)


def _job_view(snapshot: dict, job: str) -> dict:
    try:
        return snapshot["jobs"][job]
    except KeyError:
        raise ValueError(f"unknown job {job!r}; known: {sorted(snapshot['jobs'])}") from None


def _batched_zeroing(device_type: str):
    """`triton_kernels.zero_ranges_` when it can reach `device_type` memory, else
    None: without Triton, or with Triton's interpreter on a GPU (it runs on host
    memory only), or after a launch failed, blocks are zeroed at hand-out instead."""
    if _batched_scrub_failed:
        return None
    try:
        from triton_kernels import zero_ranges_
        from triton_kernels.utils import interpreting
    except ImportError:
        return None
    return zero_ranges_ if interpreting() == (device_type == "cpu") else None


def _scrub_in_one_launch(take, finish, device: torch.device, stream=None) -> int:
    """Note [Batched scrub]: `take()` moves a job's dirty free blocks out of the
    pools and returns them as (addresses, byte counts); they are zeroed in one
    launch on the scrub stream (`stream`; None: the host's), then `finish(ptrs,
    zeroed)` returns them clean behind an event recorded there. Returns the bytes
    scrubbed."""
    global _batched_scrub_failed
    zero_ranges_ = _batched_zeroing(device.type)
    if zero_ranges_ is None:
        return 0
    ptrs, sizes = take()
    if not ptrs:
        return 0
    zeroed = False
    try:
        # No allocator lock is held here: the launch allocates its range table.
        zero_ranges_(ptrs, sizes, device, stream=stream)
        zeroed = True
    except torch.OutOfMemoryError:
        pass  # its range table found the limit reached: these blocks are zeroed at hand-out, later ones batched
    except Exception as error:  # noqa: BLE001 - e.g. Triton cannot compile here
        _batched_scrub_failed = True
        warnings.warn(
            f"wwrun allocator: batched scrub failed ({error}); zeroing each block "
            "when another job takes it instead",
            RuntimeWarning,
            stacklevel=3,
        )
    finally:
        finish(ptrs, zeroed)
    return sum(sizes) if zeroed else 0


class AllocationTrace(NamedTuple):
    """What one host allocation did: the rule (a-g) that served it, whether the
    block was zeroed (cross-job) and whether the stream was made to wait on
    another stream's event (rule c)."""

    ptr: int
    size: int
    rule: str
    zeroed: bool
    waited: bool


class HostAllocator:
    """The memory-flow allocator on host memory, with simulated streams.

    Streams are small integers; stream 0 and any unregistered stream belong to
    the job "default". An event recorded on a stream completes at once unless the
    stream is held (`hold`), in which case it stays pending until `complete`.
    `capacity` is the simulated device's memory in bytes (whole 512 KiB pages
    of one memfd); `reserved_limit` optionally caps the bytes of pages the
    allocator may hold.
    Batched scrubs run on the simulated stream `SCRUB_STREAM` (hold it to keep a
    scrub pending), with `zero_ranges_` under Triton's interpreter zeroing the
    host memory itself.
    """

    SCRUB_STREAM = 1 << 62  # far from the small integers tests use for job streams

    def __init__(self, capacity: int, *, reserved_limit: int | None = None):
        self._impl = _extension("host").HostAllocator(
            _check_bytes(capacity, "capacity"), _check_bytes(reserved_limit, "reserved_limit")
        )

    # allocation -------------------------------------------------------------
    def alloc(self, nbytes: int, stream: int = 0) -> int:
        """Address of a new block of at least `nbytes` bytes, used on `stream`.
        Raises torch.OutOfMemoryError (rule g)."""
        return self.alloc_traced(nbytes, stream).ptr

    def alloc_traced(self, nbytes: int, stream: int = 0, *, hold_gil: bool = True) -> AllocationTrace:
        """As alloc, with the rule reached. `hold_gil=False` allocates with the GIL
        released, as torch's ops call their allocator."""
        if nbytes < 0:
            raise ValueError(f"nbytes must be >= 0, got {nbytes}")
        return AllocationTrace(*self._impl.allocate(nbytes, stream, hold_gil))

    def free(self, ptr: int) -> None:
        """Frees a block; raises ValueError for an address this allocator did not give."""
        self._impl.free(ptr)

    def record_stream(self, ptr: int, stream: int) -> None:
        """The block is also used on `stream` (like Tensor.record_stream)."""
        self._impl.record_stream(ptr, stream)

    # jobs -------------------------------------------------------------------
    def register_stream(self, stream: int, job: str, memory_limit: int | None = None) -> None:
        self._impl.register_stream(stream, _check_job(job), _check_bytes(memory_limit))

    def unregister_job(self, job: str) -> None:
        """The job ended: unbinds its streams and scrubs its dirty free blocks
        in one batch (`scrub_job`)."""
        if not self._impl.unregister_job(_check_job(job)):
            raise ValueError(f"unknown job {job!r}")
        self.scrub_job(job)

    # batched scrub (Note [Batched scrub]) -----------------------------------
    def scrub_job(self, job: str) -> int:
        """Zeroes `job`'s dirty free blocks in one `zero_ranges_` launch on
        `SCRUB_STREAM` and returns them clean; the bytes scrubbed (0 without Triton)."""
        job = _check_job(job)
        return _scrub_in_one_launch(
            lambda: self._impl.take_dirty_blocks(job, self.SCRUB_STREAM),
            lambda ptrs, zeroed: self._impl.finish_scrub(ptrs, self.SCRUB_STREAM, zeroed),
            torch.device("cpu"),
        )

    def take_dirty_blocks(self, job: str) -> list[tuple[int, int]]:
        """Step 1 of a batched scrub: `job`'s dirty free blocks as (address, bytes),
        now in scrub (never handed out) until `finish_scrub`."""
        ptrs, sizes = self._impl.take_dirty_blocks(_check_job(job), self.SCRUB_STREAM)
        return list(zip(ptrs, sizes))

    def finish_scrub(self, ranges: list[tuple[int, int]], zeroed: bool = True) -> None:
        """Step 3: the ranges' zeroing is queued on `SCRUB_STREAM`; they return
        to the free pool, clean if `zeroed`, pending behind a new event there."""
        self._impl.finish_scrub([ptr for ptr, _ in ranges], self.SCRUB_STREAM, zeroed)

    def set_expected_releases(
        self, jobs: Iterable[str] | Mapping[str, int], timeout_s: float = DEFAULT_RELEASE_WAIT_S
    ) -> None:
        """Rule f: these jobs are about to free memory; an allocation that would
        fail waits up to `timeout_s` for frees before failing. [] turns it off."""
        self._impl.set_expected_releases(_expected_jobs(jobs), _check_wait(timeout_s))

    # simulated device -------------------------------------------------------
    def hold(self, stream: int) -> None:
        """Events recorded on `stream` from now on stay pending."""
        self._impl.hold(stream)

    def complete(self, stream: int) -> None:
        """Completes every event recorded on `stream` and releases the hold."""
        self._impl.complete(stream)

    def last_event(self, stream: int) -> int:
        """Sequence number of the last event recorded on `stream` (0: none)."""
        return self._impl.last_seq(stream)

    def completed_event(self, stream: int) -> int:
        """Sequence number up to which `stream`'s events have completed."""
        return self._impl.completed_seq(stream)

    def waits(self) -> list[tuple[int, int, int]]:
        """Device-side waits issued: (waiting stream, event's stream, event's sequence)."""
        return self._impl.waits()

    def process_events(self) -> None:
        self._impl.process_events()

    def empty_cache(self, job: str | None = None) -> int:
        """Returns the idle pages of the ranges (mapped, under no live block), and the
        budget's free pages, to the device; returns the bytes released. With `job`,
        only the idle pages of that job's ranges, as a job's torch.cuda.empty_cache()
        does: other jobs keep their cache."""
        return self._impl.empty_cache(None if job is None else self._job_id(job))

    def cache_info(self, stream: int) -> int:
        """What cacheInfo tells cuDNN on `stream`: the largest block it could get,
        capped at its job's headroom (its limit, and the device less what all hold)."""
        return self._impl.cache_info(stream)

    def can_park(self) -> bool:
        return self._impl.can_park()

    def park_job(self, job: str) -> int:
        """The module's park_job, on this allocator."""
        return self._impl.park_job(_check_job(job))

    def unpark_job(self, job: str) -> bool:
        return self._impl.unpark_job(_check_job(job))

    def write(self, ptr: int, data: bytes) -> None:
        self._impl.write(ptr, data)

    def read(self, ptr: int, nbytes: int) -> bytes:
        return self._impl.read(ptr, nbytes)

    # figures ----------------------------------------------------------------
    def stats(self) -> dict:
        """{'device': {...}, 'rules': {'a': n, ... 'g': n}, 'jobs': {name: {...}}};
        byte figures as {current, peak, allocated, freed}. Cross-job zeroing by
        kind: `scrubbed_bytes` (a memset at hand-out; per job: received) and
        `batch_scrubbed_bytes` (batched scrubs; per job: its own data, at its end)."""
        return self._impl.snapshot()

    def job_stats(self, job: str) -> dict:
        return _job_view(self.stats(), _check_job(job))

    def segments(self) -> list[dict]:
        """Each mapped run of the ranges, with the blocks over it in address order
        (free ones cut to it), as torch reports segments."""
        return self._impl.segments()

    def check_invariants(self) -> None:
        """Raises AssertionError naming the first invariant of the allocator's
        ranges, blocks and pages found broken (waterwave_allocator.h; for tests)."""
        broken = self._impl.check_invariants()
        if broken:
            raise AssertionError(f"wwrun allocator: {broken}")

    def reset_peak_stats(self, job: str | None = None) -> None:
        """Peaks back to current figures: one job's, or (None) the device's and every job's."""
        self._impl.reset_peak(None if job is None else self._job_id(job))

    def _job_id(self, job: str) -> int:
        job_id = self._impl.find_job(_check_job(job))
        if job_id is None:
            raise ValueError(f"unknown job {job!r}")
        return job_id

    def benchmark_trace(self, sizes: list[int], window: int, repeats: int, stream: int = 0) -> float:
        """Seconds for `repeats` passes of alloc/free pairs over `sizes`, keeping
        `window` blocks live; the loop runs in C++."""
        if window < 1 or repeats < 1:
            raise ValueError("window and repeats must be >= 1")
        return self._impl.benchmark_trace(sizes, window, repeats, stream)


# --------------------------------------------------------------------------
# Job threads: the only threads rule f lets wait
# --------------------------------------------------------------------------


def _loaded_modules(load_host: bool) -> list:
    modules = [_modules[kind] for kind in ("host", "cpu", "cuda") if _modules.get(kind) is not None]
    if load_host and not modules:  # a thread marked before any allocator is built
        modules.append(_extension("host"))
    return modules


def mark_job_thread(job: str, memory_limit: int | None = None) -> None:
    """Marks the calling thread as `job`'s thread (thread-local), from the moment
    its job starts: only marked threads wait for other jobs' frees (rule f),
    with or without the GIL. The shared autograd thread is never marked. With
    the CPU allocator installed, the thread's CPU tensors count to `job` too,
    under its `memory_limit` bytes."""
    _check_job(job)
    limit = _check_bytes(memory_limit)
    for module in _loaded_modules(load_host=True):
        module.mark_job_thread(job)
    if is_cpu_allocator_installed():
        _modules["cpu"].bind_thread(job, limit)


def unmark_job_thread() -> None:
    """The calling thread's job ended: it no longer waits (rule f), and its CPU
    tensors count to the default job."""
    for module in _loaded_modules(load_host=False):
        module.unmark_job_thread()
    if _modules.get("cpu") is not None:
        _modules["cpu"].unbind_thread()


def _serving(device: str):
    """The extension whose allocator serves `device`'s tensors in this process."""
    return _cuda() if torch.device(device).type == "cuda" else _cpu()


def set_admission_callback(callback: Callable[[str], None] | None, device: str = "cpu") -> None:
    """What a job thread calls at an allocation while its job's admission gate is
    closed (Note [Admission at the first allocation] in csrc/allocator/admission_gate.h):
    `callback(job)` returns once the job is admitted; what it raises, the allocation
    raises."""
    _serving(device).set_admission_callback(callback)


def set_limit_callback(callback: Callable[[str, int, int], bool | str] | None, device: str = "cpu") -> None:
    """What a job thread calls when its request would fail at the limit (Note [Waiting
    at the limit] in csrc/allocator/python_wait_hooks.h): `callback(job, nbytes,
    attempt)` (attempt: how many times this request came before) returns True once
    the job may try again (it waited for other jobs' frees), False to let the request
    fail, or a str to let it fail saying why (the out-of-memory message ends with
    it); what it raises, the allocation raises."""
    _serving(device).set_limit_callback(callback)


def close_admission(job: str, device: str = "cpu") -> None:
    """`job`'s threads call the admission callback before they allocate."""
    _serving(device).close_admission(_check_job(job))


def open_admission(job: str, device: str = "cpu") -> None:
    """`job`'s threads allocate without asking (it is admitted, or gone)."""
    _serving(device).open_admission(_check_job(job))


def job_meter(job: str, device: str = "cpu") -> Callable[[bool], tuple[int, int]]:
    """A cheap reader of `job`'s held bytes on the run's allocator ("cpu" or
    "cuda"): the pages under its live blocks, what it holds of the budget (Note
    [Layouts] in csrc/allocator/waterwave_allocator.h). `meter(restart)` returns
    (bytes now, most since the window last restarted) and with `restart` starts a
    new window. The engine reads NodeGroups' and iterations' peaks with it; the
    job's lifetime peak is not disturbed."""
    _check_job(job)
    if device == "cuda":
        module, index = _cuda(), torch.cuda.current_device()
        job_id = module.find_job(index, job)
        read = lambda restart=False: module.job_window(index, job_id, restart)  # noqa: E731
    else:
        module = _cpu()
        job_id = module.find_job(job)
        read = lambda restart=False: module.job_window(job_id, restart)  # noqa: E731
    if job_id is None:
        raise ValueError(f"unknown job {job!r}")
    return read


def can_park(device: str = "cpu") -> bool:
    """Whether the run's allocator can park a job's pages in host memory (Note
    [Parking]): on the CPU, yes; on a GPU, where its driver makes pinned host memory
    for the virtual memory API (CUDA 12.2 on, as the device says)."""
    if device == "cuda":
        return _cuda().can_park(torch.cuda.current_device())
    return _cpu().can_park()


def park_job(job: str, device: str = "cpu") -> int:
    """Moves the pages under `job`'s live blocks on the run's allocator to host
    memory, at the same addresses, and gives them to the budget (Note [Parking] in
    csrc/allocator/allocator_core.cpp); the bytes parked: 0 where the backend cannot
    park (a GPU whose driver maps no host memory). Its caller's job must not run
    meanwhile: it waits."""
    _check_job(job)
    if device == "cuda":
        return _cuda().park_job(torch.cuda.current_device(), job)
    return _cpu().park_job(job)


def unpark_job(job: str, device: str = "cpu") -> bool:
    """Brings `job`'s parked pages back into the budget, all or none: False when the
    budget has not the pages."""
    _check_job(job)
    if device == "cuda":
        return _cuda().unpark_job(torch.cuda.current_device(), job)
    return _cpu().unpark_job(job)


def is_job_thread() -> bool:
    return any(module.is_job_thread() for module in _loaded_modules(load_host=False))


def in_use(device: str = "cuda") -> str:
    """The allocator that serves `device`'s tensors in this process now:
    'waterwave' (ours), 'native' (PyTorch's caching allocator) or, on CUDA, the
    backend PyTorch was configured with ('cudaMallocAsync'). The one answer to
    which allocator a run or a benchmark measured: on CUDA it is the name of
    the allocator torch itself calls, so a fallback cannot go unseen."""
    if torch.device(device).type != "cuda":
        return "waterwave" if is_cpu_allocator_installed() else "native"
    if torch.version.cuda is None:
        return "native"
    backend = torch.cuda.get_allocator_backend()  # reads the installed allocator's name; no CUDA init
    return "waterwave" if backend == "wwrun" else backend


# --------------------------------------------------------------------------
# CPU: PyTorch's CPU allocator for a run
# --------------------------------------------------------------------------


def install_cpu_allocator(capacity: int) -> None:
    """Routes every CPU tensor torch allocates from now on through the allocator,
    with `capacity` bytes (the run's memory limit). Threads marked with
    mark_job_thread count to their job; a job that cannot get memory after
    rule f gets torch.OutOfMemoryError. Tensors made before keep freeing through
    their own allocator; numpy-backed tensors (torch.from_numpy) are not torch's
    memory and are not counted. Forked children (DataLoader workers) go back to
    torch's allocator. Installing again starts afresh with the new capacity."""
    module = _extension("cpu")
    if module.installed():  # a run that did not close: the new capacity holds from now on
        module.uninstall()
    module.install(_check_bytes(capacity, "capacity"))


def uninstall_cpu_allocator() -> None:
    """torch's previous CPU allocator serves new tensors again; tensors made
    meanwhile still free through ours."""
    if _modules.get("cpu") is not None:
        _modules["cpu"].uninstall()


def is_cpu_allocator_installed() -> bool:
    module = _modules.get("cpu")
    return module is not None and module.installed()


def _cpu():
    if not is_cpu_allocator_installed():
        raise RuntimeError(
            "wwrun allocator: the CPU allocator is not installed; call "
            "wwrun.memory.allocator.install_cpu_allocator() first"
        )
    return _modules["cpu"]


def cpu_stats() -> dict:
    """The CPU allocator's figures: {"device": ..., "jobs": {job: ...}, ...}, as stats()."""
    return _cpu().snapshot()


def cpu_job_stats(job: str) -> dict:
    """One job's CPU figures (allocated_bytes current/peak, allocations, limit, ...)."""
    return _job_view(cpu_stats(), _check_job(job))


def cpu_reset_peak_stats(job: str | None = None) -> None:
    """Peaks restart from current usage: of one job, or of the device and all jobs."""
    module = _cpu()
    if job is None:
        module.reset_peak(None)
        return
    job_id = module.find_job(_check_job(job))
    if job_id is None:
        raise ValueError(f"unknown job {job!r}")
    module.reset_peak(job_id)


def cpu_set_expected_releases(
    jobs: Iterable[str] | Mapping[str, int], timeout_s: float = 2.0
) -> None:
    """Rule f on the CPU: the jobs about to free memory, and how long a job thread waits."""
    _cpu().set_expected_releases(_expected_jobs(jobs), _check_wait(timeout_s))


def cpu_unregister_job(job: str) -> None:
    """The job ended: its figures stay; its blocks go to other jobs zeroed."""
    _cpu().unregister_job(_check_job(job))


def cpu_empty_cache(job: str | None = None) -> int:
    """Returns the idle pages of the ranges (of `job`'s alone, with `job`) and the
    budget's free pages (those holding `job`'s data) to the operating system;
    returns bytes."""
    if job is None:
        return _cpu().empty_cache()
    job_id = _cpu().find_job(_check_job(job))
    return 0 if job_id is None else _cpu().empty_cache(job_id)


# --------------------------------------------------------------------------
# CUDA: PyTorch's allocator
# --------------------------------------------------------------------------


def install(device: str | torch.device = "cuda") -> None:
    """Builds the CUDA allocator and installs it as PyTorch's CUDA allocator.

    Must run before any CUDA work in the process; idempotent afterwards.
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"the allocator is installed for a CUDA device, got {str(device)!r}")
    if _modules.get("cuda") is not None and _modules["cuda"].installed():
        return
    if torch.cuda.is_initialized():
        raise RuntimeError(
            "wwrun allocator: CUDA is already initialised in this process; call "
            "wwrun.memory.allocator.install() before any CUDA work"
        )
    if torch.version.cuda is None:
        raise RuntimeError("wwrun allocator: this torch build has no CUDA support")
    _extension("cuda").install()


def is_installed() -> bool:
    module = _modules.get("cuda")
    return module is not None and module.installed()


def _cuda():
    if not is_installed():
        raise RuntimeError("wwrun allocator: not installed; call wwrun.memory.allocator.install() first")
    return _modules["cuda"]


def _device_index(device) -> int:
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    return torch.device(device).index or 0


# Job streams (new_job_stream): made by the extension, never destroyed but
# reused once their job ended. A destroyed stream's handle can come back from
# the driver for a new stream, which the allocator would take for the old one
# (rule a: "stream order makes it safe") while the old one's work still runs.
_job_streams_lock = forksafe.Lock()
_idle_job_streams: dict[int, list[int]] = {}  # device -> handles of ended jobs' streams
_made_job_streams: set[tuple[int, int]] = set()  # (device, handle) made here
_job_stream_of: dict[tuple[int, str], list[int]] = {}  # (device, job) -> its handles


def new_job_stream(device=None) -> torch.cuda.ExternalStream:
    """A stream no live job holds, for one job (torch.cuda.ExternalStream): jobs
    are told apart by stream, and torch.cuda.Stream() recycles torch's 32
    streams per priority, so a sweep's 33rd job would get the 1st job's. Made
    with cudaStreamNonBlocking; after `unregister_job` of the job it was
    registered to, it goes to a later job."""
    module, index = _cuda(), _device_index(device)
    with _job_streams_lock:
        idle = _idle_job_streams.setdefault(index, [])
        handle = idle.pop() if idle else module.create_job_stream(index)
        _made_job_streams.add((index, handle))
    return torch.cuda.ExternalStream(handle, device=torch.device("cuda", index))


def drop_idle_workspaces(device=None) -> bool:
    """Drops torch's cuBLAS workspaces when no job of wwrun's streams is live (an
    earlier in-process run ended): torch keeps one per (handle, stream) for good,
    about 66 MiB each on sm_90, and an earlier run's would sit in this run's limit
    as the 'default' job's. Returns whether it dropped them: never while a job
    runs, whose cuBLAS call may be using its workspace."""
    index = _device_index(device)
    with _job_streams_lock:
        if _job_stream_of:
            return False
        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is None:
            return False
        torch.cuda.synchronize(index)
        clear()
        return True


def register_stream(stream, job: str, memory_limit: int | None = None) -> None:
    """Binds a job's CUDA stream (torch.cuda.Stream or its cuda_stream integer) to
    `job`; allocations on it count to the job and obey its `memory_limit` bytes.
    A stream a live job holds is refused (ValueError)."""
    module = _cuda()
    handle = stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)
    device = stream.device.index if hasattr(stream, "device") else torch.cuda.current_device()
    module.register_stream(device, handle, _check_job(job), _check_bytes(memory_limit))
    with _job_streams_lock:
        if (device, handle) in _made_job_streams:
            _job_stream_of.setdefault((device, job), []).append(handle)


_scrub_streams: dict[int, torch.cuda.ExternalStream] = {}
_scrub_streams_lock = forksafe.Lock()


def _scrub_stream(device: int) -> torch.cuda.ExternalStream:
    """The device's scrub stream, made once and not one of torch's pool (a
    script's torch.cuda.Stream() could be handed it): no job's work queues on
    it, so a scrub waits only on the blocks it zeroes."""
    with _scrub_streams_lock:
        if device not in _scrub_streams:
            handle = _cuda().create_job_stream(device)
            where = torch.device("cuda", device)
            _scrub_streams[device] = torch.cuda.ExternalStream(handle, device=where)
        return _scrub_streams[device]


def unregister_job(job: str, device=None) -> None:
    """The job ended (called from its thread after its script): unbinds its
    streams and scrubs its dirty free blocks in one launch on the device's scrub
    stream (Note [Batched scrub]); the host does not wait for it."""
    module, index = _cuda(), _device_index(device)
    if not module.unregister_job(index, _check_job(job)):
        raise ValueError(f"unknown job {job!r}")
    stream = _scrub_stream(index)
    handle = stream.cuda_stream
    _scrub_in_one_launch(
        lambda: module.take_dirty_blocks(index, job, handle),
        lambda ptrs, zeroed: module.finish_scrub(index, ptrs, handle, zeroed),
        torch.device("cuda", index),
        stream,
    )
    # Its streams (new_job_stream) go to later jobs; work still queued on them
    # orders before theirs, and blocks it left are zeroed for them (its data).
    with _job_streams_lock:
        _idle_job_streams.setdefault(index, []).extend(_job_stream_of.pop((index, job), []))


class Headroom(NamedTuple):
    """What the first warm-up of a device measured (`measure_headroom`)."""

    process_bytes: int
    """Device memory the calling thread's warm-up took outside the allocator: the
    context's growth, its and the autograd thread's cuBLAS/cuDNN handles, the
    kernels it loaded."""
    per_thread_bytes: int
    """Outside the allocator, for each further thread's first cuBLAS, cuDNN and
    Triton use (its own handles), averaged over `threads` threads."""
    threads: int
    stream_fixed_bytes: int
    """Inside the allocator and held for good, for each stream used forward and
    backward: torch's cuBLAS/cuBLASLt workspaces, one per (thread's handle,
    stream), kept in a process-wide map (the job's thread's and the autograd
    thread's: two per job stream)."""
    triton: bool
    """Whether a Triton kernel was part of the warm-up."""


_headrooms: dict[int, Headroom] = {}
_headrooms_lock = threading.Lock()


def _allocator_bytes(index: int) -> tuple[int, int]:
    """(allocated, reserved) bytes of the installed CUDA allocator, wwrun's or PyTorch's."""
    if is_installed():
        device = stats(index)["device"]
        return device["allocated_bytes"]["current"], device["reserved_bytes"]["current"]
    return torch.cuda.memory_allocated(index), torch.cuda.memory_reserved(index)


def _warm_up_blas(index: int) -> None:
    """A matmul and a linear layer (cuBLAS and cuBLASLt), forward and backward on
    the current stream: this thread's and the autograd thread's handles get their
    workspaces for it."""
    with torch.cuda.device(index), torch.enable_grad():
        x = torch.ones(8, 8, device="cuda", requires_grad=True)
        bias = torch.ones(8, device="cuda", requires_grad=True)
        (x @ x + torch.nn.functional.linear(x, x, bias)).sum().backward()


def warm_job_stream(stream) -> None:
    """Makes the calling thread's and the autograd thread's cuBLAS workspaces for
    a job's `stream` now, before the stream is bound to the job (register_stream)
    and the thread marked: they are per-stream fixed costs, held by no job (the
    default one) and planned for by the run's budget (`stream_fixed_cost`), not
    charged to the job's claim or limit. A later job on the same stream whose
    thread has the same cuBLAS handle makes none."""
    with torch.cuda.stream(stream):
        _warm_up_blas(stream.device.index or 0)


def _warm_up_libraries(index: int) -> bool:
    """cuBLAS and cuBLASLt forward and backward, a convolution (cuDNN) and a
    Triton kernel when Triton can run here, so that the calling thread has made
    its handles and loaded its first kernels. Returns whether Triton ran."""
    triton = False
    with torch.cuda.device(index):
        _warm_up_blas(index)
        image, kernel = torch.ones(1, 1, 8, 8, device="cuda"), torch.ones(1, 1, 3, 3, device="cuda")
        torch.nn.functional.conv2d(image, kernel).sum().item()
        zero_ranges_ = _batched_zeroing("cuda")
        if zero_ranges_ is not None:
            try:
                zero_ranges_([image.data_ptr()], [image.numel() * image.element_size()], index)
                triton = True
            except Exception:  # noqa: BLE001 - no compiler here: measured without it
                pass
        torch.cuda.synchronize(index)
    return triton


def _outside_allocator(index: int, work: Callable[[], object]) -> tuple[int, object]:
    """(device bytes `work` took outside the allocator, what it returned)."""
    free_before, _ = torch.cuda.mem_get_info(index)
    _, reserved_before = _allocator_bytes(index)
    result = work()
    torch.cuda.synchronize(index)
    free_after, _ = torch.cuda.mem_get_info(index)
    _, reserved_after = _allocator_bytes(index)
    return max(0, free_before - free_after - (reserved_after - reserved_before)), result


def _warm_up_in_threads(index: int, threads: int) -> None:
    """`threads` new threads warm up at once, each making its own handles."""
    errors: list[BaseException] = []

    def warm():
        try:
            _warm_up_libraries(index)
        except BaseException as error:  # noqa: BLE001 - raised by the caller
            errors.append(error)

    workers = [threading.Thread(target=warm, name=f"wwrun-headroom-probe-{n}", daemon=True)
               for n in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(_PROBE_WAIT_S)  # the probe's warm-up, bounded
        if worker.is_alive():
            raise RuntimeError("wwrun allocator: a headroom probe thread's warm-up did not end "
                               f"within {_PROBE_WAIT_S:.0f}s")
    if errors:
        raise errors[0]


def measure_headroom(device=None, threads: int = HEADROOM_PROBE_THREADS) -> Headroom:
    """Measures, once per device and process, what the device gives outside the
    allocator (free memory before and after warm-ups of the calling thread, then
    of `threads` new threads at once: cuBLAS, cuBLASLt, cuDNN and a Triton kernel)
    and the cuBLAS workspaces a stream holds inside it. torch's workspaces are
    dropped afterwards unless a job runs (drop_idle_workspaces; what they held
    stays in the allocator's cache). Call it before jobs start, as device_capacity does; later calls
    return the first measurement. For `wwrun doctor` too."""
    if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads must be a positive count, got {threads!r}")
    index = _device_index(device)
    with _headrooms_lock:
        if index in _headrooms:
            return _headrooms[index]
        torch.cuda.synchronize(index)
        allocated_before, _ = _allocator_bytes(index)
        process, triton = _outside_allocator(index, lambda: _warm_up_libraries(index))
        allocated_after, _ = _allocator_bytes(index)  # its tensors are gone: the workspaces stay
        in_threads, _ = _outside_allocator(index, lambda: _warm_up_in_threads(index, threads))
        drop_idle_workspaces(index)  # the probes' workspaces would serve no job
        _headrooms[index] = Headroom(
            process_bytes=process,
            per_thread_bytes=in_threads // threads,
            threads=threads,
            stream_fixed_bytes=max(0, allocated_after - allocated_before),
            triton=bool(triton),
        )
        return _headrooms[index]


def stream_fixed_cost(device=None) -> int:
    """Bytes each job stream holds for good in the allocator, for no job: torch's
    cuBLAS workspaces of the job's thread and of the autograd thread
    (`Headroom.stream_fixed_bytes`; 0 before `measure_headroom`). The run's
    budget plans for it once per job at once."""
    measured = _headrooms.get(_device_index(device))
    return 0 if measured is None else measured.stream_fixed_bytes


def capacity_headroom(measured: Headroom, jobs: int = 1) -> int:
    """What device_capacity keeps back for `jobs` jobs at once: CAPACITY_HEADROOM_BYTES,
    plus the measured per-thread bytes for each job's thread."""
    return CAPACITY_HEADROOM_BYTES + measured.per_thread_bytes * max(1, jobs)


def device_capacity(device=None, headroom: int | None = None, *, jobs: int = 1) -> int:
    """Bytes the device can really give the jobs' allocator: its free memory after
    the warm-ups of `measure_headroom`, plus what the allocator holds (its
    segments, free or not: the jobs' memory comes from them), less `headroom`
    (None: `capacity_headroom` for `jobs` jobs at once). Works with PyTorch's
    allocator too. The per-stream fixed costs (`stream_fixed_cost`) come out of
    it: the run's budget subtracts them."""
    if headroom is not None and (isinstance(headroom, bool) or not isinstance(headroom, int) or headroom < 0):
        raise ValueError(f"headroom must be a number of bytes >= 0, got {headroom!r}")
    index = _device_index(device)
    measured = measure_headroom(index)
    if headroom is None:
        headroom = capacity_headroom(measured, jobs)
    free, _total = torch.cuda.mem_get_info(index)
    _, held = _allocator_bytes(index)
    return max(0, free + held - headroom)


def set_expected_releases(
    jobs: Iterable[str] | Mapping[str, int],
    timeout_s: float = DEFAULT_RELEASE_WAIT_S,
    device=None,
) -> None:
    """Rule f, for the scheduler: these jobs are about to free memory."""
    _cuda().set_expected_releases(_device_index(device), _expected_jobs(jobs), _check_wait(timeout_s))


def stats(device=None) -> dict:
    """Device totals, per-job figures, rule counters, pending-event bytes and
    fragmentation, as a plain dict (see HostAllocator.stats)."""
    return _cuda().snapshot(_device_index(device))


def job_stats(job: str, device=None) -> dict:
    return _job_view(stats(device), _check_job(job))
