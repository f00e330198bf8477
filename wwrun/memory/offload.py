"""Activation offload: the tensors a job's forward saves for backward go to host
memory in packed chunks and come back ahead of backward (TENSILE, arXiv 2105.13336,
tensor-granular swapping under a lower peak), so that a job whose iteration does not
fit the budget still trains, unchanged and with the same losses.

    Offloader    one per run: the mode (never | auto | always), the host pool and
                 each job's figures (bytes offloaded and fetched, time stalled)
    HostPool     the host memory chunks are packed into, under --offload-limit:
                 pinned on CUDA (allocated once per size and reused), and on the
                 CPU anonymous mmap pages the run's CPU allocator never sees, so
                 that the budget (which stands for device memory) does not count them
    PassOffload  one forward pass: `keep(tensor)` is called by the engine's
                 saved-tensor hook for each tensor autograd saves, `boundary()`
                 before each module call; saved tensors wait in `pending` until they
                 are worth a chunk, then are packed into one host buffer in one copy
                 (triton_kernels.pack on CUDA; a plain copy on the CPU); `park()`
                 packs all of them at once (the job waits at a gate, rule 6)
    _Chunk       one packed buffer; its handles' first unpack in backward restores
                 it (one copy, triton_kernels.unpack) and prefetches the chunk saved
                 before it, so backward finds the next chunk on the device already
    UnstashedMeter  the job's allocator meter as the engine reads it, which also
                 keeps the most the job would have held with nothing offloaded

Rules (in order):
1. Only tensors that own their storage whole (contiguous, offset 0, the storage's
   size) and live on the pass's device are offloaded: a view's base may be alive
   (nothing freed) and a restored copy has exactly the original's layout, so the
   backward computes the same bits. Parameters never reach `keep` (the engine keeps
   them); tensors inside someone else's saved-tensor hooks (torch.utils.checkpoint,
   which recomputes them) never reach it either.
2. A storage saved twice while alive (a layer's output is the next layer's input) is
   one entry: restored once.
3. `always` stashes from the first pass. `auto` stashes once the job needs it: a
   request of its can never be granted (the engine's `_start_offload`); from then on
   the job stashes in every pass. While a pass is profiled, auto also stashes once its
   bytes above the pass start plus twice its largest one-module growth reach PRESSURE
   of its room, but only for a trial (`provisional`): when the profiled iteration
   ends, the engine weighs what the job would have held with nothing offloaded
   (`UnstashedMeter`); a job that fits without offload stops stashing (the engine
   profiles it again, unstashed), else it stashes from then on.
4. Pending tensors are stashed once they hold `room / CHUNKS_PER_ROOM` bytes, a chunk
   closing at that size (or one tensor, if larger): backward holds about two chunks
   (the one in use and the one prefetched) besides the tail forward left on the device.
5. When the pool is full, tensors stay on the device (the job may then fail as it
   would without offload); nothing waits for host memory.
6. Parking (auto and always): a pass that may have to wait at a gate while other
   jobs wait too (`parkable`: the engine's jobs oversubscribe the budget) keeps its
   saved tensors as handles, still on the device. When the job waits at a gate and
   its saved tensors are what another waiting job needs, the engine parks them
   (`park()`: stashed, as above, in one go) when the copies there and back, at the
   rate `measure_copy_rate` found at start-up, take less than a forward of the job:
   the other job runs now, and backward fetches the chunks back as for any stash.
   Only tensors nothing else holds are parked: a copy frees nothing of one the
   script still has (its batch, the activation the forward is passing on), and
   counting it freed let another job in on bytes that were not there.

On CUDA the copies run on a side stream of the job's (ordered by events, so forward
and backward compute overlap them) and `record_stream` keeps a block from being reused
while a copy reads it; nothing in a backward hook waits on the host. On the CPU they
are synchronous, through the same chunks and handles.
"""

from __future__ import annotations

import mmap
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from wwrun.config import OFFLOAD_MODES as MODES

CHUNKS_PER_ROOM = 8
"""A chunk holds at most this fraction of the job's room: backward holds about two."""

MIN_CHUNK_BYTES = 64 << 10
"""Smaller chunks cost more in per-copy overhead than they save."""

CPU_TRITON = False
"""Pack CPU chunks with the Triton kernels in Triton's interpreter (TRITON_INTERPRET=1
before triton is imported) rather than a plain copy: the same kernels a GPU runs, at
~0.4 s per MiB, for tests of the kernels' path."""

RATE_PROBE_BYTES = 32 << 20
"""The copy `measure_copy_rate` times, each way: larger than a CPU's caches."""

PRESSURE = 0.75
"""`auto` starts stashing in a profiled pass, on trial, when the job's bytes above the
pass start, plus twice its largest one-module growth, reach this share of its room:
the rest is left for its backward, two chunks of which are back on the device."""


# ---- host memory -----------------------------------------------------------------
class HostPool:
    """Host buffers for chunks, `limit` bytes at most (free ones included). A freed
    buffer is kept for the next chunk of its size (iterations repeat their sizes), so
    pinned memory is registered once and reused; a new size evicts free buffers when
    the pool would go over its limit."""

    def __init__(self, limit: int, pinned: bool):
        if limit < 0:
            raise ValueError(f"offload limit must be >= 0, got {limit}")
        self.limit = limit
        self.pinned = pinned
        self.held = 0  # bytes of every buffer, free or in use
        self.peak = 0
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> tuple[torch.Tensor | None, object]:
        """(a uint8 host buffer of `nbytes`, the CUDA event after which it is free or
        None), or (None, None) when the limit leaves no room."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
            if not self._room_for(nbytes):
                return None, None
            self.held += nbytes
            self.peak = max(self.peak, self.held)
        return self._allocate(nbytes), None

    def reserve(self, nbytes: int) -> bool:
        """Counts `nbytes` of host memory about to be made outside the pool (a job's
        pages parked at the limit, Note [Parking]) against its limit, evicting free
        buffers for them (`_room_for`); False, with nothing counted, when the limit
        leaves no room. `settle` says what was made."""
        with self._lock:
            if not self._room_for(nbytes):
                return False
            self.held += nbytes
            return True

    def settle(self, reserved: int, made: int) -> None:
        """`made` bytes were made of the `reserved` (more, or none: 0)."""
        with self._lock:
            self.held += made - reserved
            self.peak = max(self.peak, self.held)

    def release(self, nbytes: int) -> None:
        """Counts `nbytes` made outside the pool (settled) no longer."""
        with self._lock:
            self.held -= nbytes

    def _room_for(self, nbytes: int) -> bool:
        """Under the lock: whether the limit has room for `nbytes` more, evicting free
        buffers for them; none is evicted when even without them it would not."""
        free = sum(size * len(entries) for size, entries in self._free.items())
        if self.held - free + nbytes > self.limit:
            return False
        while self.held + nbytes > self.limit and self._evict():
            pass
        return self.held + nbytes <= self.limit  # (not when a free buffer's copy still runs)

    def _evict(self) -> bool:
        """Frees the largest free buffer no copy still uses; False if none."""
        for size in sorted(self._free, reverse=True):
            entries = self._free[size]
            for i, (_, done) in enumerate(entries):
                if done is None or done.query():
                    del entries[i]
                    if not entries:
                        del self._free[size]
                    self.held -= size
                    return True
        return False

    def give(self, buffer: torch.Tensor, done=None) -> None:
        """`buffer` is free once `done` (a CUDA event: the last copy using it) is."""
        with self._lock:
            self._free.setdefault(buffer.numel(), []).append((buffer, done))

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pinned:
            return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        # Pages of our own: torch.frombuffer wraps them without torch's CPU allocator
        # (wwrun's, during a run), so they count to no job and to no budget.
        return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=torch.uint8)


def _kernels():
    """triton_kernels' (pack, unpack), imported at first use, on a job's thread: the
    engine makes its Offloader at start-up, on the main thread, where a Ctrl-C
    landing in Triton's import (in a native callback) would abort the process."""
    from triton_kernels import pack, unpack

    return pack, unpack


def _copy_out(tensors: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
    """Pack `tensors` into `buffer`, in order: one Triton launch on CUDA (or under
    CPU_TRITON), else one plain copy per tensor."""
    if tensors[0].is_cuda or CPU_TRITON:
        pack, _ = _kernels()
        pack(tensors, out=buffer)
        return
    offset = 0
    for tensor in tensors:
        nbytes = _nbytes(tensor)
        buffer[offset:offset + nbytes].copy_(tensor.reshape(-1).view(torch.uint8))
        offset += nbytes


def _copy_in(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """The inverse of _copy_out."""
    if tensors[0].is_cuda or CPU_TRITON:
        _, unpack = _kernels()
        unpack(buffer, tensors)
        return
    offset = 0
    for tensor in tensors:
        nbytes = _nbytes(tensor)
        tensor.reshape(-1).view(torch.uint8).copy_(buffer[offset:offset + nbytes])
        offset += nbytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


_STORAGE_USE_COUNT = getattr(torch._C, "_storage_Use_Count", None)


def _only_saved(handle: _Handle) -> bool:
    """Whether the handle holds the only reference to its tensor and the tensor the
    only one to its storage (no view of it): then copying it away frees its memory.
    sys.getrefcount counts the handle's slot, and its own argument."""
    if handle.tensor is None or sys.getrefcount(handle.tensor) > 2:
        return False
    if _STORAGE_USE_COUNT is None:
        return True
    # The storage's Python object made here counts once, as the tensor does.
    return _STORAGE_USE_COUNT(handle.tensor.untyped_storage()._cdata) <= 2


def _owns_storage(tensor: torch.Tensor) -> bool:
    """Rule 1: a plain dense tensor that is its whole storage, contiguous."""
    if type(tensor) is not torch.Tensor or tensor.layout != torch.strided or not tensor.numel():
        return False
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return (tensor.is_contiguous() and tensor.storage_offset() == 0
            and storage.nbytes() == _nbytes(tensor))


# ---- the figures ---------------------------------------------------------------------
@dataclass
class JobOffload:
    """One job's offload state and figures (for the report)."""

    name: str
    stashing: bool = False  # rule 3: once on, every pass of the job stashes
    provisional: bool = False  # stashing on trial, since pressure in a profiled pass (rule 3)
    meter: UnstashedMeter | None = None  # told of every move to and from the host
    offloaded_bytes: int = 0
    fetched_bytes: int = 0
    fetch_stall_s: float = 0.0
    kept_bytes: int = 0  # saved tensors that stayed on the device: pool full
    parked_bytes: int = 0  # of offloaded_bytes, those parked while the job waited at a gate (rule 6)
    stream: object = None  # on CUDA, the job's copy stream
    lock: threading.Lock = field(default_factory=threading.Lock)

    def report(self) -> dict:
        return {
            "offloaded_bytes": self.offloaded_bytes,
            "fetched_bytes": self.fetched_bytes,
            "fetch_stall_s": round(self.fetch_stall_s, 6),
            "parked_bytes": self.parked_bytes,
        }

    def measure(self, meter: Callable[[bool], tuple[int, int]]) -> UnstashedMeter:
        """The job's allocator meter, also weighing what the job would hold unstashed."""
        self.meter = UnstashedMeter(meter)
        return self.meter

    def moved(self, nbytes: int) -> None:
        if self.meter is not None:
            self.meter.moved(nbytes)


class UnstashedMeter:
    """A job's allocator meter, `meter(restart)` -> (bytes now, the most since the
    last restart), read as before, that also keeps `peak`: the most the job would have
    held with nothing offloaded, its bytes on the device plus those `away` on the host
    (what the originals would have taken). The allocator's window is cut at every read
    and every move, so that each stretch's most is added to the bytes away during it.
    A stashed tensor still referenced elsewhere counts twice: the figure errs high."""

    def __init__(self, meter: Callable[[bool], tuple[int, int]]):
        self._meter = meter
        self._lock = threading.Lock()  # reads come from the job's thread, backward's and the display's
        self._window = 0  # the caller's window: the most since its last restart
        self.away = 0  # bytes on the host neither fetched back nor dropped
        self.peak = 0

    def __call__(self, restart: bool = False) -> tuple[int, int]:
        with self._lock:
            now, window = self._cut()
            if restart:
                self._window = now
            return now, window

    def _cut(self) -> tuple[int, int]:
        now, peak = self._meter(True)
        self.peak = max(self.peak, peak + self.away)
        self._window = max(self._window, peak)
        return now, self._window

    def moved(self, nbytes: int) -> None:
        """`nbytes` went to the host (once their device memory is free), or came back
        (negative: before their device memory is taken) or were dropped there."""
        with self._lock:
            self._cut()
            self.away += nbytes

    def restart_peak(self) -> int:
        """`peak` so far; a new one starts from now (an iteration begins)."""
        with self._lock:
            now, _ = self._cut()
            peak, self.peak = self.peak, now + self.away
            return peak


class Offloader:
    """Offload for one run.

    mode        never | auto | always (see rule 3)
    limit       host bytes the pool may hold (--offload-limit, resolved by wwrun.memory)
    device      'cpu' or 'cuda'
    span        (job, label, start, end, bytes) -> None: trace spans ("offload", "fetch")
    """

    def __init__(self, mode: str, limit: int, device: str,
                 span: Callable[[str, str, float, float, int], None] | None = None):
        if mode not in MODES:
            raise ValueError(f"offload mode must be one of {', '.join(MODES)}, got {mode!r}")
        self.mode = mode
        self.device = device
        self.pool = HostPool(limit, pinned=device == "cuda")
        self._span = span or (lambda *_: None)
        self._jobs: dict[str, JobOffload] = {}
        self.copy_rate: float | None = None  # bytes/s each way, once measured (rule 6)

    def copy_seconds(self, nbytes: int) -> float:
        """What copying `nbytes` to the host and back costs (rule 6); measured the first
        time it is asked, when no engine has asked at start-up."""
        if self.copy_rate is None:
            self.copy_rate = measure_copy_rate(self.device)
        return 2 * nbytes / self.copy_rate

    def job(self, name: str) -> JobOffload:
        job = self._jobs.get(name)
        if job is None:
            job = self._jobs[name] = JobOffload(name)
        return job

    def forget(self, name: str) -> None:
        """A new attempt of a job starts afresh (its figures are its own)."""
        self._jobs.pop(name, None)

    def report(self, name: str) -> dict:
        return self.job(name).report()

    def begin_pass(self, name: str, room: int, device: torch.device | str,
                   held: Callable[[], int] | None = None, parkable: bool = False) -> PassOffload | None:
        """The offload of a forward pass of job `name`, which may hold `room` bytes
        above its pass start; None when it stashes nothing. `held`, while the pass is
        profiled in auto mode: the job's bytes above its pass start now (rule 3);
        `parkable`: its saved tensors may be parked at a gate (rule 6)."""
        if self.mode == "never" or room <= 0:
            return None
        job = self.job(name)
        if self.mode == "always":
            job.stashing = True
        if not job.stashing and held is None and not parkable:
            return None
        return PassOffload(self, job, room, torch.device(device).type, held)


# ---- one pass ----------------------------------------------------------------------
class _Handle:
    """What autograd keeps for an offloaded saved tensor."""

    __slots__ = ("tensor", "chunk", "index")

    def __init__(self, tensor: torch.Tensor):
        # On the device until stashed; an alias without its autograd history, as the
        # engine keeps one (engine._kept: the tensor itself would make a cycle).
        self.tensor: torch.Tensor | None = tensor if tensor.is_leaf else tensor.detach()
        self.chunk: _Chunk | None = None
        self.index = 0

    def get(self) -> torch.Tensor:
        if self.tensor is not None:
            return self.tensor
        return self.chunk.tensor(self.index)


class PassOffload:
    def __init__(self, offloader: Offloader, job: JobOffload, room: int, device: str,
                 held: Callable[[], int] | None):
        self.offloader = offloader
        self.job = job
        self.room = room
        self.device = device  # 'cpu' or 'cuda'
        self.held = held  # watching (auto, profiled) until `job.stashing`
        self.chunk_bytes = max(MIN_CHUNK_BYTES, room // CHUNKS_PER_ROOM)
        self.thread = threading.get_ident()
        self.pending: list[_Handle] = []
        self.pending_bytes = 0
        self.last: _Chunk | None = None
        # Rule 2: storage address -> (a weak reference to a tensor there, its version, its handle)
        self._seen: dict[int, tuple[weakref.ref, int, _Handle]] = {}

    def keep(self, tensor: torch.Tensor):
        """From the saved-tensor pack hook: what autograd keeps instead of `tensor`."""
        if tensor.device.type != self.device or not _owns_storage(tensor):
            return tensor
        key = tensor.untyped_storage().data_ptr()
        seen = self._seen.get(key)
        if seen is not None:
            ref, version, handle = seen
            other = ref()
            if (other is not None and other.untyped_storage().data_ptr() == key
                    and other.dtype == tensor.dtype and other.shape == tensor.shape
                    and tensor._version == version):
                return handle
        handle = _Handle(tensor)
        self._seen[key] = (weakref.ref(tensor), tensor._version, handle)
        self.pending.append(handle)
        self.pending_bytes += _nbytes(tensor)
        return handle

    def boundary(self, step: int = 0) -> None:
        """Before a module call on the pass's thread: stash what is worth a chunk.
        `step`: the largest growth of one module so far (profiled passes)."""
        if threading.get_ident() != self.thread or not self.pending:
            return
        if not self.job.stashing:
            if self.held is None or self.held() + 2 * step < PRESSURE * self.room:
                return
            # Rule 3: on trial, until the engine has weighed the profiled iteration.
            self.job.stashing = self.job.provisional = True
        if self.pending_bytes >= self.chunk_bytes:
            self.stash()

    def parkable_bytes(self) -> int:
        """What `park()` would free: the pending tensors nothing else holds, when
        worth a chunk."""
        free = sum(_nbytes(handle.tensor) for handle in self.pending if _only_saved(handle))
        return free if free >= MIN_CHUNK_BYTES else 0

    def park(self) -> int:
        """Rule 6: the job waits at a gate; every pending tensor nothing else holds
        goes to the host now. Returns the bytes stashed (0 when the pool had no room)."""
        parked = self.stash([handle for handle in self.pending if _only_saved(handle)])
        with self.job.lock:
            self.job.parked_bytes += parked
        return parked

    def stash(self, handles: list[_Handle] | None = None) -> int:
        """Pack the pending tensors (or those of them in `handles`) into chunks of at
        most `chunk_bytes`; the bytes that went to the host."""
        if handles is None:
            pending, self.pending, self.pending_bytes = self.pending, [], 0
        else:
            chosen = set(map(id, handles))
            pending = handles
            self.pending = [handle for handle in self.pending if id(handle) not in chosen]
            self.pending_bytes = sum(_nbytes(handle.tensor) for handle in self.pending)
        self._seen = {k: v for k, v in self._seen.items() if v[0]() is not None}
        start, size, stashed = 0, 0, 0
        for i, handle in enumerate(pending):
            size += _nbytes(handle.tensor)
            if size >= self.chunk_bytes or i == len(pending) - 1:
                stashed += self._stash_chunk(pending[start:i + 1], size)
                start, size = i + 1, 0
        return stashed

    def _stash_chunk(self, handles: list[_Handle], nbytes: int) -> int:
        offloader, job = self.offloader, self.job
        buffer, free_after = offloader.pool.take(nbytes)
        if buffer is None:  # rule 5
            with job.lock:
                job.kept_bytes += nbytes
            return 0
        began = time.perf_counter()
        self.last = _Chunk(offloader, job, handles, buffer, free_after, self.last)
        offloader._span(job.name, "offload", began, time.perf_counter(), nbytes)
        job.moved(nbytes)  # the chunk holds no device tensor of theirs now
        with job.lock:
            job.offloaded_bytes += nbytes
        return nbytes


class _Chunk:
    """Saved tensors packed into one host buffer. Alive while a handle of it is
    (autograd's graph); the chunk saved before it is its `previous`, prefetched when
    this one is first fetched."""

    def __init__(self, offloader: Offloader, job: JobOffload, handles: list[_Handle],
                 buffer: torch.Tensor, free_after, previous: _Chunk | None):
        tensors = [h.tensor for h in handles]
        self.offloader, self.job = offloader, job
        self.layouts = [(t.shape, t.dtype, t.device) for t in tensors]
        self.nbytes = sum(_nbytes(t) for t in tensors)
        self.buffer = buffer
        self.previous = previous
        self.restored: list[torch.Tensor] | None = None
        self.lock = threading.Lock()
        self.ready = None  # on CUDA: the event after which the restored tensors are written
        self.stream = None
        if tensors[0].is_cuda:
            self.stream = _copy_stream(job, tensors[0].device)
            compute = torch.cuda.current_stream(tensors[0].device)
            self.stream.wait_stream(compute)  # the tensors are written
            if free_after is not None:  # the buffer's last copy (maybe another job's stream) is done
                self.stream.wait_event(free_after)
            with torch.cuda.stream(self.stream):
                _copy_out(tensors, buffer)
            for tensor in tensors:  # their blocks are not reused before the copy read them
                tensor.record_stream(self.stream)
        else:
            _copy_out(tensors, buffer)
        for i, handle in enumerate(handles):
            handle.tensor, handle.chunk, handle.index = None, self, i

    def tensor(self, index: int) -> torch.Tensor:
        """A handle's tensor, on the device: the first call restores the chunk (a
        stall, unless prefetched) and prefetches the one before it."""
        with self.lock:
            restored = self.restored
        if restored is None:
            began = time.perf_counter()
            restored = self._fetch()
            stalled = time.perf_counter() - began
            with self.job.lock:
                self.job.fetch_stall_s += stalled
        if self.ready is not None:
            torch.cuda.current_stream(restored[index].device).wait_event(self.ready)
        previous, self.previous = self.previous, None
        if previous is not None:
            previous._fetch()  # prefetch one chunk ahead
        return restored[index]

    def _fetch(self) -> list[torch.Tensor]:
        with self.lock:
            if self.restored is not None:
                return self.restored
            began = time.perf_counter()
            self.job.moved(-self.nbytes)
            out = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in self.layouts]
            if self.stream is not None:
                compute = torch.cuda.current_stream(out[0].device)
                self.stream.wait_stream(compute)  # the new blocks' earlier users are done
                with torch.cuda.stream(self.stream):
                    _copy_in(self.buffer, out)
                    self.ready = torch.cuda.Event()
                    self.ready.record()
                for tensor in out:
                    tensor.record_stream(self.stream)
            else:
                _copy_in(self.buffer, out)
            self.restored = out
            self.offloader._span(self.job.name, "fetch", began, time.perf_counter(), self.nbytes)
        with self.job.lock:
            self.job.fetched_bytes += self.nbytes
        return out

    def __del__(self):
        buffer, self.buffer = self.buffer, None
        if buffer is None:
            return
        try:
            done = None
            if self.stream is not None:  # its next user waits for our copies (never the host)
                done = torch.cuda.Event()
                done.record(self.stream)
            self.offloader.pool.give(buffer, done)
            if self.restored is None:  # never fetched: its graph went without a backward
                self.job.moved(-self.nbytes)
        except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone: the buffer goes with it
            pass


def measure_copy_rate(device: str, nbytes: int = RATE_PROBE_BYTES) -> float:
    """Bytes per second of one copy between the device and host memory (pinned on
    CUDA; on the CPU two host buffers of the offload's own, outside the budget), the
    better of two tries of `nbytes`: what parking costs (rule 6)."""
    host = HostPool(2 * nbytes, pinned=device == "cuda")
    source, _ = host.take(nbytes)
    target, _ = host.take(nbytes)
    if device == "cuda":
        source = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = float("inf")
    for _ in range(2):
        began = time.perf_counter()
        target.copy_(source, non_blocking=device == "cuda")
        source.copy_(target, non_blocking=device == "cuda")
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - began) / 2)
    return nbytes / max(best, 1e-9)


def _copy_stream(job: JobOffload, device: torch.device):
    """The job's copy stream, made on first use by the job's thread (the allocator
    then counts what is allocated on it to the job)."""
    if job.stream is None:
        job.stream = torch.cuda.Stream(device)
    return job.stream


def unpack_saved(saved):
    """The saved-tensor unpack hook's side: a handle's tensor, on the device."""
    return saved.get() if isinstance(saved, _Handle) else saved


# ---- stashing a list of tensors at once ----------------------------------------------
class Stash:
    """Tensors held in one host buffer; `restore()` gives equal tensors on their devices."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        tensors = list(tensors)
        for tensor in tensors:
            if not tensor.is_contiguous():
                raise ValueError("stash: tensors must be contiguous (a tensor is not contiguous)")
        self._layouts = [(t.shape, t.dtype, t.device) for t in tensors]
        self.nbytes = sum(_nbytes(t) for t in tensors)
        on_cuda = any(t.device.type == "cuda" for t in tensors)
        self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        if tensors:
            pack, _ = _kernels()
            pack(tensors, out=self._buffer)
        self._written = _record_event() if on_cuda else None

    def restore(self) -> list[torch.Tensor]:
        """New tensors equal to the stashed ones, on their original devices."""
        out = [torch.empty(shape, dtype=dtype, device=device) for shape, dtype, device in self._layouts]
        if self._written is not None:
            torch.cuda.current_stream().wait_event(self._written)
        _, unpack = _kernels()
        unpack(self._buffer, out)
        if self._written is not None:
            _keep_until_done(_record_event(), self._buffer)
        return out


def stash(tensors: Sequence[torch.Tensor]) -> Stash:
    """Copy `tensors` (contiguous; CUDA, or CPU under Triton's interpreter) to one host buffer."""
    return Stash(tensors)


def _record_event() -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record()
    return event


# Host buffers still read by an enqueued copy: a buffer freed early could be handed
# out again by the pinned-memory cache and overwritten before the copy runs.
_in_flight: list[tuple[torch.cuda.Event, torch.Tensor]] = []


def _keep_until_done(event: torch.cuda.Event, buffer: torch.Tensor) -> None:
    _in_flight[:] = [(e, b) for e, b in _in_flight if not e.query()]
    _in_flight.append((event, buffer))
