"""Fused multi-tensor copy: pack many tensors into one flat byte buffer and back.

`pack(tensors)` is `torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors])`
and `unpack(buffer, tensors)` its inverse (each tensor's bytes copied back from its
offset), each in one kernel launch whatever the number of tensors, their dtypes,
sizes or alignments. The buffer may be device memory or pinned host memory, which
is what offloading a waiting job's saved activations to the host needs: one launch
streams them all over the bus, instead of one `copy_` per tensor.

Layout: tensor k occupies bytes [offset_k, offset_k + nbytes_k) of the buffer, with
offset_k = nbytes_0 + ... + nbytes_{k-1} (no padding, int64). See `utils.py` for how a
launch is cut into programs, and Liger-Kernel's `ops/` for the file layout.
"""

from __future__ import annotations

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
    launch_device,
    on_device,
    range_table,
)


@triton.jit
def _multi_tensor_copy_kernel(
    src_addrs_ptr,
    dst_addrs_ptr,
    nbytes_ptr,
    block_starts_ptr,
    num_ranges,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    index, lo, hi = _chunk_of_program(block_starts_ptr, nbytes_ptr, num_ranges, CHUNK)
    src_addr = tl.load(src_addrs_ptr + index)
    dst_addr = tl.load(dst_addrs_ptr + index)
    _move_chunk(src_addr, dst_addr, lo, hi, False, BLOCK)


def pack(tensors: Sequence[torch.Tensor], out: torch.Tensor | None = None) -> torch.Tensor:
    """Gather the bytes of `tensors` into one flat buffer, in order, in one launch.

    `out`, if given, is any contiguous tensor of at least the total byte size (e.g. a
    reusable pinned host buffer); its first bytes are written and it is returned.
    Otherwise a uint8 buffer is allocated on the tensors' device. Asynchronous on the
    current stream, like any kernel: synchronize before reading a host buffer.
    An empty list returns `out` untouched (or an empty CPU uint8 tensor).
    """
    tensors = list(tensors)
    if not tensors:
        return out if out is not None else torch.empty(0, dtype=torch.uint8)
    device = launch_device(tensors if out is None else [*tensors, out], "pack")
    check_contiguous(tensors, "pack")
    nbytes = byte_sizes(tensors)
    total = int(nbytes.sum())
    if out is None:
        out = torch.empty(total, dtype=torch.uint8, device=device)
    else:
        _check_buffer(out, total, "pack", "out")
    _launch(
        src=data_addresses(tensors),
        dst=out.data_ptr() + _offsets(nbytes),
        nbytes=nbytes,
        device=device,
    )
    return out


def unpack(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Scatter the bytes of `buffer` back into `tensors` (the inverse of `pack`), in one launch.

    `buffer` holds at least the total byte size of `tensors`; the tensors must be
    contiguous and are overwritten in place. Asynchronous on the current stream.
    An empty list does nothing.
    """
    tensors = list(tensors)
    if not tensors:
        return
    device = launch_device([*tensors, buffer], "unpack")
    check_contiguous(tensors, "unpack")
    nbytes = byte_sizes(tensors)
    _check_buffer(buffer, int(nbytes.sum()), "unpack", "buffer")
    _launch(
        src=buffer.data_ptr() + _offsets(nbytes),
        dst=data_addresses(tensors),
        nbytes=nbytes,
        device=device,
    )


def _launch(src: torch.Tensor, dst: torch.Tensor, nbytes: torch.Tensor, device: torch.device) -> None:
    table, num_programs = range_table([src, dst], nbytes, device)
    if num_programs == 0:
        return
    src_addrs, dst_addrs, nbytes, block_starts = table
    with on_device(device):
        _multi_tensor_copy_kernel[(num_programs,)](
            src_addrs,
            dst_addrs,
            nbytes,
            block_starts,
            len(nbytes),
            CHUNK=CHUNK_BYTES,
            BLOCK=BLOCK_BYTES,
            num_warps=NUM_WARPS,
        )


def _offsets(nbytes: torch.Tensor) -> torch.Tensor:
    """Exclusive prefix sum: where each tensor starts in the packed buffer (int64)."""
    return torch.cumsum(nbytes, 0) - nbytes


def _check_buffer(buffer: torch.Tensor, needed: int, what: str, name: str) -> None:
    if not buffer.is_contiguous():
        raise ValueError(f"{what}: {name} must be contiguous")
    have = buffer.numel() * buffer.element_size()
    if have < needed:
        raise ValueError(f"{what}: {name} holds {have} bytes, the tensors need {needed}")
