"""Stashing tensors in one host buffer and restoring them: bit-exact, any dtypes.

On the CPU the Triton kernels run in the interpreter (tests/conftest.py); the GPU test
moves device tensors to pinned host memory and back for real.
"""

from __future__ import annotations

import pytest
import torch

from wwrun.memory.offload import stash


def _tensors(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g).to(device),
        torch.randint(-100, 100, (7,), generator=g, dtype=torch.int8).to(device),
        torch.randn(2, 2, 3, generator=g).to(torch.float16).to(device),
        torch.tensor([True, False, True], device=device),
        torch.empty(0, 4, device=device),
    ]


def test_restore_gives_back_equal_tensors():
    originals = _tensors("cpu")
    stashed = stash(originals)
    assert stashed.nbytes == sum(t.numel() * t.element_size() for t in originals)
    for _ in range(2):  # restoring twice gives two equal, independent copies
        restored = stashed.restore()
        assert len(restored) == len(originals)
        for before, after in zip(originals, restored):
            assert after.dtype == before.dtype and after.shape == before.shape
            assert torch.equal(after, before)
            assert after.data_ptr() != before.data_ptr() or before.numel() == 0


def test_stash_copies_so_later_writes_to_the_originals_do_not_leak_in():
    original = torch.arange(10, dtype=torch.float32)
    stashed = stash([original])
    original.fill_(-1)
    assert torch.equal(stashed.restore()[0], torch.arange(10, dtype=torch.float32))


def test_empty_and_bad_input():
    assert stash([]).restore() == []
    with pytest.raises(ValueError, match="not contiguous"):
        stash([torch.randn(4, 4).t()])


@pytest.mark.gpu
def test_device_tensors_leave_device_memory_and_come_back_bit_exact():
    originals = _tensors("cuda")
    expected = [t.cpu() for t in originals]
    stashed = stash(originals)
    assert stashed._buffer.is_pinned()
    before = torch.cuda.memory_allocated()
    del originals
    assert torch.cuda.memory_allocated() < before  # the device memory is free now
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream restores: the event orders it
        restored = stashed.restore()
    torch.cuda.synchronize()
    for want, got in zip(expected, restored):
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
