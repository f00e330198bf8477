"""The run's memory, behind one object the launcher holds (`Memory`).

    allocator.py   the memory-flow allocator's Python face (C++ in csrc/allocator/):
                   the source of truth about the bytes each job holds, on both devices
    engine.py      finds each job's models, cuts them into NodeGroups, gates them
    scheduler.py   admission of jobs and NodeGroups under the budget (no torch)
    nodegroups.py  profiles -> balanced contiguous NodeGroups
    trace.py       Perfetto trace and memory plot
    offload.py     activation offload: saved tensors to host memory and back

The launcher makes one `Memory` per run and, in each job's thread, holds a
`JobMemory` session for the job's life (`with memory.session(spec): run the
script`): it binds the thread (and the threads the job starts) to the job in the
allocator and closes the job's admission gate (its first device allocation waits for
the engine's admission, `Memory._admission`), and on leaving hands everything back.

One memory truth on both devices: on the CPU every tensor torch allocates goes
through the allocator installed for the run (its capacity is `--memory-limit`, or
most of what the machine can give), on CUDA through the allocator installed as
PyTorch's. The engine reads each job's allocated bytes from it; the report's
`peak_memory_bytes` is the allocator's, and `memory_limit_bytes` what it enforces.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from wwrun import forksafe

HOST_HEADROOM_FRACTION = 0.10
"""Without --memory-limit, the CPU allocator keeps this share of what the machine can
give (available memory, the address-space limit) for what is not torch's: thread
stacks (OpenMP creates its threads at the first parallel region), Python objects,
libraries. A job that outgrows the rest gets torch.OutOfMemoryError alone, instead of
the machine refusing a thread and taking the whole process down."""

HOST_HEADROOM_MIN = 512 << 20

OUTLIVED_NOTE_BYTES = 2 << 20
"""Memory held for no live job beyond this (a page) is said once (Memory._budget_now)."""


def host_capacity() -> int:
    """Bytes the CPU allocator may hold for the run without --memory-limit: what the
    machine can still give (available memory, under the address-space and cgroup
    limits when set), less the headroom."""
    import resource

    can_give = _meminfo("MemAvailable") or host_total()
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        with open("/proc/self/statm") as f:
            mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        can_give = min(can_give, soft - mapped)
    cgroup = _cgroup_room()
    if cgroup is not None:
        can_give = min(can_give, cgroup)
    headroom = max(HOST_HEADROOM_MIN, int(can_give * HOST_HEADROOM_FRACTION))
    return max(can_give - headroom, 64 << 20)


def torch_backend_requested(environ=os.environ) -> str | None:
    """The CUDA allocator backend the user asked torch for, when not its default:
    `backend:cudaMallocAsync` in PYTORCH_ALLOC_CONF (or its older name,
    PYTORCH_CUDA_ALLOC_CONF). wwrun keeps it rather than override the request."""
    for var in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        for item in environ.get(var, "").split(","):
            key, _, value = item.partition(":")
            if key.strip() == "backend" and value.strip() != "native":
                return value.strip()
    return None


def host_total() -> int:
    """The machine's memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _meminfo(field: str) -> int | None:
    """A /proc/meminfo figure in bytes (Linux; psutil would cost every run its import)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room() -> int | None:
    """Bytes left under this process's cgroup (v2) memory limit, if it has one."""
    try:
        with open("/proc/self/cgroup") as f:
            path = next(line.split(":", 2)[2].strip() for line in f if line.startswith("0::"))
        base = os.path.join("/sys/fs/cgroup", path.lstrip("/"))
        with open(os.path.join(base, "memory.max")) as f:
            limit = f.read().strip()
        if limit == "max":
            return None
        with open(os.path.join(base, "memory.current")) as f:
            return int(limit) - int(f.read().strip())
    except (OSError, StopIteration, ValueError):
        return None


class Memory:
    """The allocator, the budget and the engine of one run.

    device      'cpu' or 'cuda'
    limit       --memory-limit: bytes, or a fraction of the device's memory; None
    policy      'waterwave' makes an engine that gates NodeGroups; the baselines
                ('concurrent', 'sequential') only measure
    note        prints a line to the user (the allocator could not be had, ...)
    jobs_at_once  the most jobs that run at once: on CUDA each has a stream whose
                cuBLAS workspaces the budget plans for (`fixed_bytes`), and a thread
                whose handles the device's headroom keeps room for
    offload     never | auto | always, and offload_limit (bytes, a fraction of the
                host memory available now, or None): activation offload
                (wwrun/memory/offload.py), for the engine's jobs
    """

    def __init__(
        self,
        device: str,
        limit: int | float | None,
        policy: str,
        *,
        nodegroups: int | None = None,
        queue: str = "fifo",
        trace: bool = False,
        note: Callable[[str], None] = lambda line: None,
        current_job: Callable[[], str | None] | None = None,
        jobs_at_once: int = 1,
        offload: str = "never",
        offload_limit: int | float | None = None,
        in_shared_lock: Callable[[], bool] | None = None,
    ):
        self.device = device
        self._offload = (offload, offload_limit)
        self._note = note
        self.jobs_at_once = max(1, jobs_at_once)
        self.fixed_bytes = 0
        """Of `limit`, what the jobs' streams hold for good for no job (cuBLAS
        workspaces, `allocator.stream_fixed_cost`): the engine plans for the rest."""
        self.allocator = self._install(limit)
        self.limit = self._limit(limit)
        self.engine = self._make_engine(policy, nodegroups, queue, trace, current_job)
        self._in_shared_lock = in_shared_lock  # a job thread there must not wait (an import)
        self._pid = os.getpid()  # a forked child's job threads never wait at the limit
        self.admits_at_allocation = self.engine is not None and self.allocator == "waterwave"
        """A job waits for admission at its first device allocation (`_admission`),
        not before its script starts: its imports and data loading run beside the
        running jobs. Without wwrun's allocator, before its script starts."""
        if self.admits_at_allocation:
            from wwrun.memory import allocator

            allocator.set_admission_callback(self._admission, device)
            allocator.set_limit_callback(self._at_limit, device)
        self._expected_releases: set[str] = set()  # what rule f was last told
        self._releases_lock = forksafe.Lock()
        self._sessions: dict[str, JobMemory] = {}  # the live session of each job name
        self._closed = False
        self.outlived_bytes = 0
        """The most bytes ended jobs still held as a job ended (`_budget_now`)."""
        self._outlived_note: str | None = None

    # -- the run ------------------------------------------------------------------
    def _device_total(self) -> int:
        if self.device == "cuda":
            import torch

            return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return host_total()

    def _install(self, limit) -> str:
        """wwrun's allocator for the run, or PyTorch's when it cannot be had (said
        once); the allocator that then serves the jobs, as `allocator.in_use`
        names it ('waterwave', 'native', 'cudaMallocAsync'), for the report.

        A build that fails stops the run (wwrun.build.BuildError): the allocator is
        the run's memory truth and its isolation, and a run on PyTorch's instead
        would differ from what the user asked for in every figure. PyTorch's serves
        only where the user chose it (`backend:cudaMallocAsync`) or where it is
        already in place (CUDA initialised before an in-process `launch`)."""
        from wwrun.build import BuildError
        from wwrun.config import resolve_size
        from wwrun.memory import allocator

        requested = torch_backend_requested() if self.device == "cuda" else None
        if requested:
            self._note(f"PyTorch's allocator configuration asks for its {requested} backend: "
                       "the jobs use it, not wwrun's memory-flow allocator")
            return allocator.in_use(self.device)
        try:
            if self.device == "cuda":
                allocator.install()
            else:
                capacity = resolve_size(limit, self._device_total()) or host_capacity()
                allocator.install_cpu_allocator(capacity)
        except BuildError:
            raise
        except Exception as err:  # noqa: BLE001 - CUDA already in use, ...
            self._note(f"memory-flow allocator unavailable, using PyTorch's: {err}")
        return allocator.in_use(self.device)

    def _limit(self, limit) -> int | None:
        """The bytes the run may use, enforced by the allocator and planned for by the
        engine: --memory-limit (a fraction means of the device's memory); on CUDA at
        most what the device can really give (`allocator.device_capacity`: free after
        a cuBLAS/cuDNN warm-up, less a headroom for the driver); on the CPU without a
        limit, none to plan for (the allocator still guards the machine). On CUDA,
        sets `fixed_bytes`: the job streams' workspaces, inside the limit."""
        from wwrun.config import resolve_size

        total = self._device_total()
        resolved = resolve_size(limit, total)
        if self.device != "cuda":
            return resolved
        import torch

        from wwrun.config import ConfigError, format_size
        from wwrun.memory import allocator

        index = torch.cuda.current_device()
        usable = allocator.device_capacity(index, jobs=self.jobs_at_once)
        if usable <= 0:
            raise ConfigError("device", f"the GPU has no memory left for jobs (of {format_size(total)}, "
                              "the rest is taken by other processes and the driver's headroom)")
        bytes_ = min(resolved or usable, usable)
        self.fixed_bytes = allocator.stream_fixed_cost(index) * self.jobs_at_once
        if self.fixed_bytes >= bytes_:
            raise ConfigError("memory_limit", f"{format_size(bytes_)} leaves nothing for {self.jobs_at_once} "
                              f"job(s) at once once their streams' cuBLAS workspaces "
                              f"({format_size(self.fixed_bytes)}) are held")
        if torch.cuda.is_initialized():  # (after device_capacity's warm-up, always on a GPU)
            # The run starts from what is live: the CUDA allocator lives as long as the
            # process, and an earlier in-process run (wwrun.launch in a benchmark or a
            # notebook) left its cached segments, its streams' cuBLAS workspaces and
            # peaks, which are not this run's.
            allocator.drop_idle_workspaces(index)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        if self.allocator == "waterwave":  # the allocator enforces it (its reserved limit)
            torch.cuda.set_per_process_memory_fraction(min(1.0, bytes_ / total))
        return bytes_

    def _make_engine(self, policy, nodegroups, queue, trace, current_job):
        if policy != "waterwave":
            return None
        from wwrun.memory.engine import Engine

        mode, host_limit = self._offload
        engine = Engine(
            None if self.limit is None else self.limit - self.fixed_bytes,
            policy=policy,
            nodegroups=nodegroups,
            queue=queue,
            device=self.device,
            trace=trace,
            current_job=current_job,
            meter=self._meter if self.allocator == "waterwave" else None,
            page_bytes=self._page_bytes() if self.allocator == "waterwave" else 1,
            offload=mode,
            offload_limit=self._offload_limit(host_limit),
        )
        if engine.capacity is not None and engine.offloader is not None and self.jobs_at_once > 1:
            # Parking weighs copies at this rate (offload.py, rule 6); one job alone never parks.
            engine.offloader.copy_rate = self._copy_rate(engine.capacity)
        if self.allocator == "waterwave":
            engine.release_listeners.append(self._expect_releases)
            if self.limit is not None:
                engine.capacity_source = self._budget_now
            from wwrun.memory import allocator

            device = self.device
            if allocator.can_park(device):  # else a job that gives way at the limit fails (Note [Parking])
                engine.pages_parking = (lambda job: allocator.park_job(job, device),
                                        lambda job: allocator.unpark_job(job, device))
        return engine

    def _copy_rate(self, budget: int) -> float:
        """Bytes/s between the device and host memory, measured at start-up on this
        thread (no job's): on CUDA its probe takes at most a quarter of the jobs'
        budget (a whole probe once stopped a run under a tight limit), and its pages
        go back at once."""
        from wwrun.memory.offload import RATE_PROBE_BYTES, measure_copy_rate

        if self.device != "cuda":
            return measure_copy_rate(self.device)
        import torch

        rate = measure_copy_rate(self.device, max(1 << 20, min(RATE_PROBE_BYTES, budget // 4)))
        torch.cuda.empty_cache()
        return rate

    @staticmethod
    def _offload_limit(limit) -> int:
        """--offload-limit in bytes: a fraction is of the host memory available now,
        and without one, OFFLOAD_HOST_SHARE of it."""
        from wwrun.config import OFFLOAD_HOST_SHARE, resolve_size

        available = _meminfo("MemAvailable") or host_total()
        return int(OFFLOAD_HOST_SHARE * available) if limit is None else resolve_size(limit, available)

    def close(self) -> None:
        """The run ended: torch's own CPU allocator serves new tensors again (those
        made meanwhile still free through ours). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.allocator != "waterwave":
            return
        from wwrun.memory import allocator

        if self.admits_at_allocation:
            allocator.set_admission_callback(None, self.device)
            allocator.set_limit_callback(None, self.device)
        if self.device == "cpu":
            allocator.cpu_empty_cache()
            allocator.uninstall_cpu_allocator()

    # -- jobs -----------------------------------------------------------------------
    def session(self, name: str, priority: int = 0, memory_limit: int | float | None = None) -> JobMemory:
        return JobMemory(self, name, priority, memory_limit)

    def join_thread(self, name: str) -> None:
        """A thread the job started (not once the job has left): on CUDA it runs on
        the job's stream, so its work is ordered with the job's as under `python`
        (where every thread shares the legacy default stream); its tensors count to
        the job, and it may wait for other jobs' frees as the job's own thread does."""
        session = self._sessions.get(name)
        if session is None:
            return
        if session.stream is not None:
            import torch

            torch.cuda.set_stream(session.stream)
        if session._bound:
            from wwrun.memory import allocator

            allocator.mark_job_thread(name, session.limit)

    def abandon(self, name: str) -> None:
        """The job's thread did not stop within its grace period: what it reserved goes
        back now, and its late leave() will not touch a retry of the same name."""
        self._sessions.pop(name, None)
        if self.engine is not None:
            self.engine.job_finished(name)  # and so rule f stops waiting for it

    def _admission(self, name: str) -> None:
        """The allocator's admission gate (Note [Admission at the first allocation] in
        csrc/allocator/admission_gate.h): a thread of job `name` is about to take its
        first device memory. Waits for the engine's admission and opens the job's gate.
        What reaches the job meanwhile (Ctrl-C) is raised by its allocation."""
        if os.getpid() != self._pid:
            return  # a forked child's memory is its own: nothing there admits it
        if self._in_shared_lock is not None and self._in_shared_lock():
            # An import (a module-level tensor): waiting here would hold the module's
            # lock, which a running job may need before it can make room. Counted to
            # the job, not yet planned; its next allocation outside asks again.
            return
        self.engine.admit(name)
        from wwrun.memory import allocator

        allocator.open_admission(name, self.device)

    def _at_limit(self, name: str, nbytes: int, attempt: int) -> bool | str:
        """The allocator's last word before a job thread's request fails at the limit
        (Note [Waiting at the limit] in csrc/allocator/python_wait_hooks.h): a job that
        fits alone waits for the others' frees (`Engine.wait_at_limit`); True: it
        tries again; a str: it fails, and this says why. Only on the job's own thread
        (one it started would die of the job's giving way), not in a forked child (a
        DataLoader worker: no other job frees there), not inside an import (a running
        job may need its lock)."""
        session = self._sessions.get(name)
        if session is None or session.thread != threading.get_ident() or os.getpid() != self._pid:
            return False  # a thread the job started, or a forked child's
        if self._in_shared_lock is not None and self._in_shared_lock():
            return False
        return self.engine.wait_at_limit(name, nbytes, attempt)

    def _meter(self, name: str):
        """The job's (held bytes now, most since the window restarted) reader: the
        pages under its blocks; (0, 0) once the run is over (a leftover graph may die
        later)."""
        from wwrun.memory import allocator

        read = allocator.job_meter(name, self.device)
        return lambda restart=False: (0, 0) if self._closed else read(restart)

    def _page_bytes(self) -> int:
        """The allocator's page: the unit the engine plans the budget in."""
        from wwrun.memory import allocator

        stats = allocator.stats() if self.device == "cuda" else allocator.cpu_stats()
        return stats["device"]["page_bytes"]

    def _expect_releases(self, job: str, held: int) -> None:
        """Backward progress, from the engine: jobs still holding activations are
        about to free memory; the allocator's rule f waits for them before failing.
        It is told only when that set of jobs changes, not at every NodeGroup."""
        if (held > 0) == (job in self._expected_releases):
            return  # told already: most calls, a NodeGroup's, change nothing (checked again below)
        from wwrun.memory import allocator

        with self._releases_lock:  # the last set told is the current one
            if self._closed or (held > 0) == (job in self._expected_releases):
                return
            if held > 0:
                self._expected_releases.add(job)
            else:
                self._expected_releases.discard(job)
            names = sorted(self._expected_releases)
            if self.device == "cuda":
                allocator.set_expected_releases(names)
            else:
                allocator.cpu_set_expected_releases(names)

    def _budget_now(self) -> int | None:
        """The engine's budget as a job ends (its `capacity_source`): the limit less
        what the allocator holds for no live job, measured (at least the streams'
        planned fixed costs). Blocks that outlived the job that made them stay, e.g. a
        cuBLAS workspace for a thread's handle paired with a reused job stream (torch
        keeps one per pair), a library's cache, a tensor a script left in a
        process-wide object. Planned as free, they made the next jobs' plans overrun
        the device."""
        if self._closed:
            return None
        from wwrun.config import format_size
        from wwrun.memory import allocator

        stats = allocator.stats() if self.device == "cuda" else allocator.cpu_stats()
        # Ended jobs' blocks only: the default owner's (the streams' warm-up
        # workspaces, planned as fixed; a thread not yet marked) are not a job's leftovers.
        outlived = sum(figures["held_bytes"]["current"] for job, figures in stats["jobs"].items()
                       if job != "default" and job not in self._sessions)
        if outlived > OUTLIVED_NOTE_BYTES >= self.outlived_bytes:  # said once, out of the engine's lock
            self._outlived_note = (f"{format_size(outlived)} allocated by ended jobs is still held (a library's "
                                   "cache, a tensor kept in a process-wide object): the jobs plan within the rest")
        self.outlived_bytes = max(self.outlived_bytes, outlived)
        return max(1, self.limit - self.fixed_bytes - outlived)

    # -- figures --------------------------------------------------------------------
    def job_figures(self, name: str) -> dict | None:
        """The allocator's allocated_bytes figures of a job (current, peak, ...)."""
        if self.allocator != "waterwave":
            return None
        from wwrun.memory import allocator

        try:
            stats = allocator.job_stats(name) if self.device == "cuda" else allocator.cpu_job_stats(name)
        except (ValueError, RuntimeError):  # not registered yet, or the run is over
            return None
        return stats["allocated_bytes"]

    def memory_of(self, name: str) -> int | None:
        """A job's current bytes, for the live table; None while unknown."""
        figures = self.job_figures(name)
        if figures is not None:
            return figures["current"]
        return self.engine.memory_of(name) if self.engine is not None else None

    def job_report(self, name: str, started: bool) -> dict:
        """The report's memory fields of a job: the allocator's peak, the engine's
        waits and NodeGroups."""
        report = {}
        if self.engine is not None and started:
            try:
                report.update(self.engine.job_report(name))
            except KeyError:  # it failed before the engine saw it (no such script, ...)
                pass
        figures = self.job_figures(name)
        if figures is not None:
            report["peak_memory_bytes"] = figures["peak"]
        return report

    def run_report(self) -> dict:
        report = {"memory_limit_bytes": self.limit, "allocator": self.allocator}
        if self.device == "cuda":  # of memory_limit_bytes, held by the job streams for no job
            report["stream_fixed_bytes"] = self.fixed_bytes
        if self.engine is not None:
            report.update(self.engine.run_report())
            report["outlived_bytes"] = self.outlived_bytes
        if self.allocator == "waterwave":
            from wwrun.memory import allocator

            stats = allocator.stats() if self.device == "cuda" else allocator.cpu_stats()
            report["peak_memory_bytes"] = stats["device"]["allocated_bytes"]["peak"]
            report["peak_reserved_bytes"] = stats["device"]["reserved_bytes"]["peak"]
        elif self.device == "cuda":  # PyTorch's allocator: its own figures, all jobs together
            import torch

            report["peak_memory_bytes"] = torch.cuda.max_memory_allocated()
            report["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        return report


class JobMemory:
    """One job's memory session, entered and left on the job's own thread: the
    thread is bound to the job in the allocator (its stream on CUDA), and the job
    is admitted by the engine at its first device allocation (it may wait there
    until the job fits beside the others; without wwrun's allocator, here);
    leaving hands back every byte and wakes the others."""

    def __init__(self, memory: Memory, name: str, priority: int, memory_limit):
        self.memory = memory
        self.name = name
        self.priority = priority
        self.memory_limit = memory_limit
        self.limit: int | None = None  # bytes, once entered
        self.stream = None  # on CUDA, the job's stream, current in every thread of the job
        self.thread: int | None = None  # the job's own thread, once entered: only it waits at the limit
        self._bound = False

    def __enter__(self) -> JobMemory:
        memory = self.memory
        memory._sessions[self.name] = self
        self.thread = threading.get_ident()
        if memory.allocator == "waterwave":
            from wwrun.config import resolve_size
            from wwrun.memory import allocator

            # A fraction is of the device's memory, as the run's --memory-limit.
            self.limit = limit = resolve_size(self.memory_limit, memory._device_total())
            if memory.device == "cuda":
                import torch

                # A stream of its own (torch's pool recycles 32), handed on when it ends.
                self.stream = stream = allocator.new_job_stream(torch.cuda.current_device())
                # Its cuBLAS workspaces, made before it is the job's, count to no job.
                allocator.warm_job_stream(stream)
                allocator.register_stream(stream, self.name, limit)
                self._bound = True
                torch.cuda.set_stream(stream)
            allocator.mark_job_thread(self.name, limit)  # rule f may wait on this thread only
            self._bound = True
            if memory.admits_at_allocation:  # its first device allocation waits to be admitted
                allocator.close_admission(self.name, memory.device)
        elif memory.device == "cuda":
            import torch

            # Each job on its own stream: the legacy default stream would serialize them.
            self.stream = torch.cuda.Stream()
            torch.cuda.set_stream(self.stream)
        if memory.engine is not None:  # without the allocator's gate, waits here until the job fits
            memory.engine.job_started(self.name, self.priority, admit=not memory.admits_at_allocation)
        return self

    def __exit__(self, *exc) -> None:
        self.leave()

    def leave(self) -> None:
        """Every byte the job reserved goes back; its memory passes to others zeroed.
        An abandoned attempt's late leave touches nothing of a retry's."""
        memory = self.memory
        current = memory._sessions.get(self.name) is self
        if current:
            del memory._sessions[self.name]
        if self._bound:
            self._bound = False
            from wwrun.memory import allocator

            allocator.unmark_job_thread()
            if current and memory.admits_at_allocation:  # its threads left behind ask no more
                allocator.open_admission(self.name, memory.device)
            if current and memory.device == "cuda":
                allocator.unregister_job(self.name)
            elif current:
                allocator.cpu_unregister_job(self.name)
                # What it left cached goes back to the machine (a sweep's queue would
                # otherwise keep every ended job's high-water mark); the running
                # jobs keep theirs.
                allocator.cpu_empty_cache(self.name)
        # Only now do the waiting jobs wake: told while the allocator still held the
        # job's segments, the next job's first large request found the limit reached
        # and nobody left to wait for ("no free memory left" with 2 MiB reserved).
        if current and memory.engine is not None:
            memory.engine.job_finished(self.name)  # measures what outlived it (_budget_now)
            note, memory._outlived_note = memory._outlived_note, None
            if note:
                memory._note(note)
