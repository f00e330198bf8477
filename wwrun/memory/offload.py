"""Move tensors out of device memory into one pinned host buffer, and back, with one
fused copy each way (`triton_kernels.pack` / `unpack`).

For the scheduler: a job waiting at a NodeGroup gate still holds the activations it
saved for backward while another job's forward needs the room. `stash(tensors)`
gathers any number of tensors, of any dtypes, into one host buffer in one launch;
once the caller drops the originals, their device memory is free for the other job.
`Stash.restore()` allocates them again and scatters the bytes back in one launch.

Both are asynchronous on the current stream and never block the host (they may be
called from a backward hook, on the autograd thread that all jobs share): an event
orders the restore after the stash on whatever stream restores, and the host buffer
stays referenced until the copy reading it has run.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from triton_kernels import pack, unpack


@dataclass(frozen=True)
class _Layout:
    shape: torch.Size
    dtype: torch.dtype
    device: torch.device


class Stash:
    """Tensors held in one host buffer; `restore()` gives equal tensors on their devices."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        tensors = list(tensors)
        self._layouts = [_Layout(t.shape, t.dtype, t.device) for t in tensors]
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors)
        on_cuda = any(t.device.type == "cuda" for t in tensors)
        self._buffer = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=on_cuda)
        pack(tensors, out=self._buffer)
        self._written = _record_event() if on_cuda else None

    def restore(self) -> list[torch.Tensor]:
        """New tensors equal to the stashed ones, on their original devices."""
        out = [torch.empty(layout.shape, dtype=layout.dtype, device=layout.device) for layout in self._layouts]
        if self._written is not None:
            torch.cuda.current_stream().wait_event(self._written)
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
