"""Triton kernels for wwrun's bulk memory work: fused multi-tensor copy and zeroing.

    from triton_kernels import pack, unpack, zero_, zero_ranges_
    buffer = pack(tensors)          # all tensors' bytes, in order, one launch
    unpack(buffer, tensors)         # and back
    zero_(tensors)                  # zero many tensors, one launch
    zero_ranges_(ptrs, nbytes, device)  # zero raw (address, bytes) ranges, one launch

Runs on CUDA devices (and pinned host memory); on the CPU only under Triton's
interpreter (`TRITON_INTERPRET=1`, set before triton is first imported).
"""

from triton_kernels.multi_tensor_copy import pack, unpack
from triton_kernels.multi_tensor_zero import zero_, zero_ranges_

__all__ = ["pack", "unpack", "zero_", "zero_ranges_"]
