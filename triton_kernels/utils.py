"""Shared pieces of the multi-range kernels: range lookup, the byte mover, launch checks.

Every op here works on a batch of *byte ranges* `(src address, dst address, nbytes)`
described by a small int64 table in device memory, and does the whole batch in one
launch. The work is cut into chunks of `CHUNK_BYTES` per program (apex's
`multi_tensor_apply` and Liger-Kernel's launchers are the references for the idea;
nothing is copied from them):

    range i covers programs  block_starts[i] <= pid < block_starts[i + 1]
    program pid moves bytes  [j * CHUNK_BYTES, min((j + 1) * CHUNK_BYTES, nbytes[i]))
                             of range i, with j = pid - block_starts[i]

Addresses and byte offsets are int64 throughout, so ranges and buffers may be larger
than 2**31 bytes. The kernels see raw addresses (not tensors), which is what lets one
launch touch tensors of any dtype, device memory and pinned host memory alike (pinned
host memory is mapped into the device's address space under CUDA's unified
addressing), and lets the allocator scrub ranges that belong to no tensor.

Under `TRITON_INTERPRET=1` the same kernels run on the CPU with host addresses; that
is how the tests check them bit for bit on machines without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import triton
import triton.language as tl

CHUNK_BYTES = 64 * 1024
"""Bytes one program moves. Big enough that the per-program set-up (range lookup, a
few table loads) is amortized over many vector steps; small enough that a 1 MiB
tensor still spreads over 16 programs."""

BLOCK_BYTES = 4096
"""Bytes one vector step moves: 4 warps x 32 threads x 16-byte accesses x 2."""

NUM_WARPS = 4


# --------------------------------------------------------------------------- kernels


@triton.jit
def _range_of_program(pid, block_starts_ptr, num_ranges):
    """The range program `pid` works on: the last i with block_starts[i] <= pid.

    A binary search over the (sorted) table, so a launch over N ranges costs
    log2(N) small loads per program instead of an N-entry program->range map that
    would have to be built and copied for every launch.
    """
    lo = 0
    hi = num_ranges
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if tl.load(block_starts_ptr + mid) <= pid:
            lo = mid
        else:
            hi = mid
    return lo


@triton.jit
def _move(src_ptr, dst_ptr, offsets, mask, ZERO: tl.constexpr):
    """dst[offsets] = src[offsets] (or 0 when ZERO) where mask holds."""
    if ZERO:
        values = tl.zeros(offsets.shape, dtype=tl.uint8)
    else:
        values = tl.load(src_ptr + offsets, mask=mask)
    tl.store(dst_ptr + offsets, values, mask=mask)


@triton.jit
def _move_chunk(src_addr, dst_addr, lo, hi, ZERO: tl.constexpr, BLOCK: tl.constexpr):
    """Move bytes [lo, hi) of the range starting at src_addr -> dst_addr (int64 addresses).

    Bytes are the unit of meaning, but byte-wide accesses would run at a fraction of
    memory bandwidth (one load instruction per byte per thread). When source and
    destination have the same address modulo 16 (always so when zeroing; so when
    packing allocator-made tensors whose byte sizes are multiples of 16, as fp32 and
    bf16 activations nearly always are), the middle of the chunk is moved in aligned
    16-byte accesses and only the <16-byte head and tail byte by byte. Otherwise the
    whole chunk goes byte by byte.
    """
    dst_bytes = dst_addr.to(tl.pointer_type(tl.uint8))
    src_bytes = src_addr.to(tl.pointer_type(tl.uint8))
    if ((src_addr - dst_addr) & 15) == 0:
        # Head: bytes until the destination (hence also the source) is 16-byte aligned.
        head = tl.minimum((0 - (dst_addr + lo)) & 15, hi - lo)
        body_start = lo + head
        body_units = (hi - body_start) >> 4  # whole 16-byte units
        # The compiler cannot see the alignment of an address loaded from memory and
        # would emit byte accesses (ld.global.b8, one per byte per thread); the hint
        # gives 128-bit ones (ld/st.global.v4.b32 in the sm_90 PTX). True here:
        # body_start puts dst on a 16-byte boundary, and src has the same residue.
        dst_body = tl.multiple_of((dst_addr + body_start).to(tl.pointer_type(tl.uint8)), 16)
        src_body = tl.multiple_of((src_addr + body_start).to(tl.pointer_type(tl.uint8)), 16)
        body_bytes = body_units * 16
        for start in range(0, body_bytes, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            _move(src_body, dst_body, offsets, offsets < body_bytes, ZERO)
        # Head and tail are each under 16 bytes: one masked step apiece.
        small = tl.arange(0, 16)
        _move(src_bytes, dst_bytes, lo + small, small < head, ZERO)
        tail_start = body_start + body_bytes
        _move(src_bytes, dst_bytes, tail_start + small, tail_start + small < hi, ZERO)
    else:
        for start in range(lo, hi, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            _move(src_bytes, dst_bytes, offsets, offsets < hi, ZERO)


@triton.jit
def _chunk_of_program(block_starts_ptr, nbytes_ptr, num_ranges, CHUNK: tl.constexpr):
    """(range index, lo, hi): the range and the byte interval this program moves."""
    pid = tl.program_id(0)
    index = _range_of_program(pid, block_starts_ptr, num_ranges)
    # int64 before the multiply: chunk offsets pass 2**31 in ranges over 2 GiB.
    lo = (pid - tl.load(block_starts_ptr + index)).to(tl.int64) * CHUNK
    hi = tl.minimum(lo + CHUNK, tl.load(nbytes_ptr + index))
    return index, lo, hi


# --------------------------------------------------------------------- host helpers


# Decided once, as `@triton.jit` decided it for the kernels above when this module was
# imported: setting TRITON_INTERPRET later changes neither.
_INTERPRETED = bool(triton.knobs.runtime.interpret)


def interpreting() -> bool:
    """True when the kernels run on the CPU in Triton's interpreter (`TRITON_INTERPRET=1`)."""
    return _INTERPRETED


def launch_device(tensors: Sequence[torch.Tensor], what: str) -> torch.device:
    """The device a kernel over `tensors` runs on; ValueError when there is none.

    On a GPU: every CUDA tensor on one device, every CPU tensor in pinned memory
    (the kernel reaches it over the bus through its unified address). Under the
    interpreter: every tensor on the CPU.
    """
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{what}: expected tensors, got {type(tensor).__name__}")
        if tensor.layout != torch.strided:
            raise ValueError(f"{what}: expected strided (dense) tensors, got {tensor.layout}")
    if interpreting():
        for tensor in tensors:
            if tensor.device.type != "cpu":
                raise ValueError(
                    f"{what}: TRITON_INTERPRET=1 runs kernels on the CPU, "
                    f"but a tensor is on {tensor.device}"
                )
        return torch.device("cpu")
    cuda_devices = {t.device for t in tensors if t.device.type == "cuda"}
    others = {t.device.type for t in tensors} - {"cuda", "cpu"}
    if others:
        raise ValueError(f"{what}: tensors must be on CUDA or pinned CPU memory, got {sorted(others)}")
    if len(cuda_devices) > 1:
        raise ValueError(f"{what}: tensors on several CUDA devices {sorted(map(str, cuda_devices))}")
    if not cuda_devices:
        raise ValueError(
            f"{what}: needs at least one CUDA tensor (CPU-only: set TRITON_INTERPRET=1 "
            "to run the kernels in Triton's interpreter)"
        )
    for tensor in tensors:
        if tensor.device.type == "cpu" and not tensor.is_pinned():
            raise ValueError(
                f"{what}: CPU tensors must be in pinned memory (tensor.pin_memory()) "
                "to be reached from the GPU"
            )
    return cuda_devices.pop()


def on_device(device: torch.device):
    """Context in which a Triton launch goes to `device` (its current stream)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def check_contiguous(tensors: Sequence[torch.Tensor], what: str) -> None:
    for index, tensor in enumerate(tensors):
        if not tensor.is_contiguous():
            raise ValueError(
                f"{what}: tensor {index} is not contiguous (shape {tuple(tensor.shape)}, "
                f"stride {tensor.stride()}); call .contiguous() first"
            )


def byte_sizes(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 CPU tensor of each tensor's size in bytes."""
    return torch.tensor([t.numel() * t.element_size() for t in tensors], dtype=torch.int64)


def data_addresses(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """int64 CPU tensor of each tensor's first byte address."""
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.int64)


def range_table(columns: Sequence[torch.Tensor], nbytes: torch.Tensor, device: torch.device):
    """Upload one launch's range table; returns (column views on device, num_programs).

    `columns` are int64 CPU tensors of addresses (one entry per range) and `nbytes`
    the byte counts. Empty ranges are left out (they need no program). The returned
    views are `*columns, nbytes, block_starts`; when num_programs == 0 there is nothing
    to do and no table (None).
    Everything goes up in one host->device copy from pinned memory: asynchronous, and
    the caching host allocator keeps the pinned block alive until the copy has run.
    """
    nonempty = nbytes > 0
    if not bool(nonempty.all()):
        columns = [column[nonempty] for column in columns]
        nbytes = nbytes[nonempty]
    chunks = (nbytes + (CHUNK_BYTES - 1)) // CHUNK_BYTES
    block_starts = torch.zeros(len(nbytes) + 1, dtype=torch.int64)
    torch.cumsum(chunks, 0, out=block_starts[1:])
    num_programs = int(block_starts[-1])
    if num_programs == 0:
        return None, 0
    table = torch.cat([*columns, nbytes, block_starts])
    if device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    views = table.split([len(nbytes)] * (len(columns) + 1) + [len(nbytes) + 1])
    return views, num_programs
