"""Fused zeroing of many tensors, or of raw (address, nbytes) ranges, in one launch.

`zero_(tensors)` is `for t in tensors: t.zero_()` (torch's `_foreach_zero_`) in one
kernel launch. `zero_ranges_(ptrs, nbytes, device)` zeroes raw device memory that
belongs to no tensor: wwrun's allocator scrubs memory passing from one job to
another with it, in batches, on the receiving job's stream, so that no job can read
what another freed (see the mission's isolation rule).

The kernel is the copy kernel's byte mover with its constexpr ZERO flag set: no loads,
aligned 16-byte stores in the middle of each chunk (see `utils.py`).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch
import triton
import triton.language as tl

from triton_kernels.utils import (
    BLOCK_BYTES,
    CHUNK_BYTES,
    NUM_WARPS,
    _chunk_of_program,
    _move_chunk,
    byte_sizes,
    check_contiguous,
    data_addresses,
    interpreting,
    launch_device,
    on_device,
    range_table,
)


@triton.jit
def _multi_tensor_zero_kernel(
    dst_addrs_ptr,
    nbytes_ptr,
    block_starts_ptr,
    num_ranges,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, lo, hi = _chunk_of_program(block_starts_ptr, nbytes_ptr, num_ranges, CHUNK)
    dst_addr = tl.load(dst_addrs_ptr + index)
    _move_chunk(dst_addr, dst_addr, lo, hi, True, BLOCK)


def zero_(tensors: Sequence[torch.Tensor]) -> None:
    """Zero every byte of each (contiguous) tensor, in one launch on the current stream.

    Any dtype; CUDA tensors of one device and pinned host tensors may be mixed.
    An empty list does nothing.
    """
    tensors = list(tensors)
    if not tensors:
        return
    device = launch_device(tensors, "zero_")
    check_contiguous(tensors, "zero_")
    _launch(data_addresses(tensors), byte_sizes(tensors), device)


def zero_ranges_(
    ptrs: Sequence[int] | torch.Tensor,
    nbytes: Sequence[int] | torch.Tensor,
    device: torch.device | str | int,
    stream: torch.cuda.Stream | None = None,
) -> None:
    """Zero `nbytes[i]` bytes at address `ptrs[i]` for every i, in one launch.

    `ptrs` and `nbytes` are lists of ints or 1-D integer tensors on the CPU (the
    launch size is computed on the host, so device-side tables would cost a sync).
    `device` is the CUDA device the memory is reachable from ("cpu" under
    `TRITON_INTERPRET=1`). The kernel is queued on `stream`, or on the device's
    current stream; it allocates a small range table through the current CUDA
    allocator, so an allocator must not call it while holding its own lock.
    Ranges of 0 bytes are skipped; an empty batch does nothing. The addresses are
    trusted: a wrong one is a wrong write, exactly as with `cudaMemsetAsync`.
    """
    ptrs = _as_int64_vector(ptrs, "ptrs")
    nbytes = _as_int64_vector(nbytes, "nbytes")
    if len(ptrs) != len(nbytes):
        raise ValueError(f"zero_ranges_: {len(ptrs)} ptrs but {len(nbytes)} nbytes")
    if bool((nbytes < 0).any()):
        raise ValueError("zero_ranges_: nbytes must be >= 0")
    if bool(((ptrs == 0) & (nbytes > 0)).any()):
        raise ValueError("zero_ranges_: a null pointer with a nonzero size")
    device = _range_device(device)
    if len(ptrs) == 0:
        return
    if stream is not None and device.type == "cuda" and stream.device != device:
        raise ValueError(f"zero_ranges_: stream is on {stream.device}, ranges on {device}")
    with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
        _launch(ptrs, nbytes, device)


def _launch(dst: torch.Tensor, nbytes: torch.Tensor, device: torch.device) -> None:
    table, num_programs = range_table([dst], nbytes, device)
    if num_programs == 0:
        return
    dst_addrs, nbytes, block_starts = table
    with on_device(device):
        _multi_tensor_zero_kernel[(num_programs,)](
            dst_addrs,
            nbytes,
            block_starts,
            len(nbytes),
            CHUNK=CHUNK_BYTES,
            BLOCK=BLOCK_BYTES,
            num_warps=NUM_WARPS,
        )


def _as_int64_vector(values, name: str) -> torch.Tensor:
    """A 1-D int64 CPU tensor from a list of ints or an integer tensor; ValueError otherwise."""
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError(f"zero_ranges_: {name} must be on the CPU, got {values.device}")
        if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
            raise ValueError(f"zero_ranges_: {name} must hold integers, got {values.dtype}")
        if values.dim() != 1:
            raise ValueError(f"zero_ranges_: {name} must be 1-D, got shape {tuple(values.shape)}")
        return values.to(torch.int64)
    values = list(values)
    for value in values:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"zero_ranges_: {name} must hold ints, got {type(value).__name__}")
    try:
        return torch.tensor(values, dtype=torch.int64)
    except RuntimeError as error:  # ints beyond int64
        raise ValueError(f"zero_ranges_: {name}: {error}") from None


def _range_device(device: torch.device | str | int) -> torch.device:
    """The launch device for raw ranges, with its index filled in; ValueError if unusable."""
    try:
        device = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"zero_ranges_: bad device {device!r}: {error}") from None
    if interpreting():
        if device.type != "cpu":
            raise ValueError(f"zero_ranges_: TRITON_INTERPRET=1 runs kernels on the CPU, got device {device}")
        return device
    if device.type != "cuda":
        raise ValueError(
            f"zero_ranges_: device must be a CUDA device, got {device} "
            "(CPU-only: set TRITON_INTERPRET=1 to run the kernels in Triton's interpreter)"
        )
    if not torch.cuda.is_available():
        raise ValueError("zero_ranges_: CUDA is not available")
    return torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
