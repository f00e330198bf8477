"""zero_ and zero_ranges_ against plain torch `zero_`, bit for bit.

Every case zeroes views or ranges inside one poisoned storage and compares the whole
storage with the same views zeroed by torch, so a missed byte and a stray write
(a byte outside the ranges) both fail. CPU runs use Triton's interpreter (conftest.py).
"""

import pytest
import torch

from tests.kernel_helpers import DEVICES, POISON, byte_view, compile_for_sm90, random_tensor
from triton_kernels import zero_, zero_ranges_
from triton_kernels.utils import BLOCK_BYTES, CHUNK_BYTES

# (byte offset, size) places in one storage; gaps between them must stay untouched.
LAYOUTS = {
    "single_byte": [(0, 1)],
    "odd_sizes_and_offsets": [(1, 3), (7, 5), (13, 17), (31, 2), (40, 15)],
    "around_block": [(3, BLOCK_BYTES - 1), (BLOCK_BYTES + 16, BLOCK_BYTES + 1)],
    "across_chunks_misaligned": [(5, 2 * CHUNK_BYTES + 27)],
    "with_empty": [(0, 0), (9, 4), (20, 0)],
    "many_small": [(8 * i + i % 3, i % 7) for i in range(300)],
}


def storage_and_views(layout, device):
    end = max(offset + size for offset, size in layout) + 16
    storage = torch.full((end,), POISON, dtype=torch.uint8, device=device)
    return storage, [storage[offset : offset + size] for offset, size in layout]


def reference(layout, device):
    storage, views = storage_and_views(layout, device)
    for view in views:
        view.zero_()
    return storage


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_zero_matches_torch_and_touches_nothing_else(device, layout):
    storage, views = storage_and_views(layout, device)
    zero_(views)
    assert torch.equal(storage, reference(layout, device))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_mixed_dtypes(device):
    generator = torch.Generator().manual_seed(0)
    shapes_and_dtypes = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((), torch.int64),
                         ((11,), torch.bool), ((5, 3), torch.complex128), ((1001,), torch.int8)]
    tensors = [random_tensor(shape, dtype, generator, device) for shape, dtype in shapes_and_dtypes]
    expected = [t.clone().zero_() for t in tensors]
    zero_(tensors)
    for got, want in zip(tensors, expected):
        assert torch.equal(byte_view(got), byte_view(want))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("as_tensor", [False, True], ids=["int_lists", "int64_tensors"])
@pytest.mark.parametrize("layout", [LAYOUTS["odd_sizes_and_offsets"], LAYOUTS["across_chunks_misaligned"]])
def test_zero_ranges_from_real_pointers(device, as_tensor, layout):
    storage, _ = storage_and_views(layout, device)
    ptrs = [storage.data_ptr() + offset for offset, _ in layout]
    nbytes = [size for _, size in layout]
    if as_tensor:
        ptrs, nbytes = torch.tensor(ptrs), torch.tensor(nbytes, dtype=torch.int32)
    zero_ranges_(ptrs, nbytes, storage.device)
    assert torch.equal(storage, reference(layout, device))


@pytest.mark.parametrize("device", DEVICES)
def test_zero_ranges_across_several_tensors(device):
    """Ranges of unrelated allocations in one batch, as the allocator's scrub makes them."""
    tensors = [torch.full((n,), POISON, dtype=torch.uint8, device=device) for n in (10, 4097, 1)]
    zero_ranges_([t.data_ptr() for t in tensors], [10, 4000, 1], device)
    assert bool((tensors[0] == 0).all()) and bool((tensors[2] == 0).all())
    assert bool((tensors[1][:4000] == 0).all()) and bool((tensors[1][4000:] == POISON).all())


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches_are_no_ops(device):
    zero_([])
    zero_ranges_([], [], device)
    zero_ranges_(torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64), device)
    storage = torch.full((4,), POISON, dtype=torch.uint8, device=device)
    zero_ranges_([storage.data_ptr()], [0], device)
    zero_([storage[:0]])
    assert bool((storage == POISON).all())


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_value_error(device):
    with pytest.raises(ValueError, match="not contiguous"):
        zero_([torch.zeros(3, 3, device=device).t()])
    with pytest.raises(ValueError, match="expected tensors"):
        zero_([3])
    storage = torch.zeros(8, dtype=torch.uint8, device=device)
    ptr = storage.data_ptr()
    bad_calls = {
        "2 ptrs but 1 nbytes": ([ptr, ptr], [1]),
        "nbytes must be >= 0": ([ptr], [-1]),
        "null pointer": ([0], [4]),
        "ptrs must hold ints": ([float(ptr)], [4]),
        "nbytes must hold integers": (torch.tensor([ptr]), torch.tensor([4.0])),
        "ptrs must be 1-D": (torch.tensor([[ptr]]), torch.tensor([4])),
    }
    for message, (ptrs, nbytes) in bad_calls.items():
        with pytest.raises(ValueError, match=message):
            zero_ranges_(ptrs, nbytes, device)
    with pytest.raises(ValueError, match="bad device"):
        zero_ranges_([ptr], [4], "not-a-device")
    other = "cuda" if device == "cpu" else "cpu"
    with pytest.raises(ValueError, match="device"):
        zero_ranges_([ptr], [4], other)


def test_compiles_for_sm90_with_128_bit_stores(tmp_path):
    """The GPU build, checked without a GPU: zeroing stores 16 bytes per access."""
    compiled = compile_for_sm90("triton_kernels.multi_tensor_zero", "_multi_tensor_zero_kernel", tmp_path)
    assert compiled["cubin_bytes"] > 0
    assert compiled["accesses"].get("st.global.v4.b32", 0) > 0


# ------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
def test_zero_ranges_runs_on_the_given_stream():
    """The scrub is ordered on the receiving job's stream, after its earlier work."""
    storage = torch.zeros(4096, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # a scrub on another stream would run before the fill
        storage.fill_(POISON)
    zero_ranges_([storage.data_ptr() + 100], [1000], storage.device, stream=stream)
    torch.cuda.synchronize()
    expected = torch.full_like(storage, POISON)
    expected[100:1100] = 0
    assert torch.equal(storage, expected)


@pytest.mark.gpu
def test_zero_pinned_host_and_device_together():
    host = torch.full((5000,), POISON, dtype=torch.uint8).pin_memory()
    device_tensor = torch.full((77,), POISON, dtype=torch.uint8, device="cuda")
    zero_([host, device_tensor])
    torch.cuda.synchronize()
    assert bool((host == 0).all()) and bool((device_tensor == 0).all())


@pytest.mark.gpu
def test_zero_range_beyond_2_gib():
    storage = torch.full((2**31 + 100,), POISON, dtype=torch.uint8, device="cuda")
    zero_ranges_([storage.data_ptr() + 3], [2**31 + 90], storage.device)
    assert int(storage[3:-7].max()) == 0
    assert bool((storage[:3] == POISON).all()) and bool((storage[-7:] == POISON).all())
