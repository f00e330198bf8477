"""pack/unpack against plain torch, bit for bit (`torch.cat` of byte views, `copy_`).

On a CPU-only machine the kernels run in Triton's interpreter (see conftest.py) on CPU
tensors; with a GPU the same tests run compiled, on CUDA tensors, plus the host<->device
and >2 GiB cases below. Outputs start poisoned so that a byte the kernel failed to
write cannot pass as right.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernel_helpers import (
    DEVICES,
    POISON,
    byte_view,
    compile_for_sm90,
    poisoned_like,
    random_tensor,
    views_at,
)
from triton_kernels import pack, unpack
from triton_kernels.utils import BLOCK_BYTES, CHUNK_BYTES


def reference_pack(tensors):
    return torch.cat([byte_view(t) for t in tensors])


def assert_round_trip(tensors, device):
    """pack equals torch.cat of the byte views; unpack restores every byte."""
    buffer = pack(tensors)
    assert buffer.dtype == torch.uint8 and buffer.device.type == torch.device(device).type
    assert torch.equal(buffer, reference_pack(tensors))
    restored = [poisoned_like(t) for t in tensors]
    unpack(buffer, restored)
    for original, copy in zip(tensors, restored):
        assert torch.equal(byte_view(copy), byte_view(original))


SIZE_LISTS = {
    "single_byte": [1],
    "odd_small": [3, 5, 7, 1, 2],
    "around_alignment": [15, 16, 17, 31, 33],
    "around_block": [BLOCK_BYTES - 1, BLOCK_BYTES, BLOCK_BYTES + 1],
    "around_chunk": [CHUNK_BYTES - 1, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 13],
    "with_empty": [0, 9, 0, 0, 100, 0],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", SIZE_LISTS.values(), ids=SIZE_LISTS.keys())
def test_round_trip_byte_sizes(device, sizes):
    generator = torch.Generator().manual_seed(len(sizes))
    assert_round_trip([random_tensor((n,), torch.uint8, generator, device) for n in sizes], device)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_mixed_dtypes_and_shapes(device):
    generator = torch.Generator().manual_seed(1)
    shapes_and_dtypes = [
        ((3, 5), torch.float32),
        ((7,), torch.float16),
        ((2, 3, 1), torch.bfloat16),
        ((), torch.int64),  # a 0-d tensor
        ((11,), torch.bool),
        ((5, 3), torch.complex64),
        ((1001,), torch.int8),
        ((129, 33), torch.float64),  # 34056 bytes: several blocks
    ]
    tensors = [random_tensor(shape, dtype, generator, device) for shape, dtype in shapes_and_dtypes]
    assert_round_trip(tensors, device)


@pytest.mark.parametrize("device", DEVICES)
def test_round_trip_many_small_tensors(device):
    generator = torch.Generator().manual_seed(2)
    sizes = torch.randint(0, 64, (400,), generator=generator).tolist()
    assert_round_trip([random_tensor((n,), torch.uint8, generator, device) for n in sizes], device)


# (source offset, size) of each tensor in one 16-byte-aligned storage, chosen to reach
# each path of the byte mover. A tensor's packed destination is at the sum of the sizes
# before it, so "dst" residues mod 16 below follow from the sizes.
ALIGNMENT_CASES = {
    # dst 0 / src 0, then dst 1008 / src 1024: both aligned, 16-byte body only.
    "aligned": [(0, 1008), (1024, 48)],
    # dst 3 / src 4099, across a chunk: byte head and tail around an aligned body.
    "same_residue_nonzero": [(0, 3), (4096 + 3, CHUNK_BYTES + 4000)],
    # dst 0 / src 5, then dst 4 / src 9: the byte path.
    "different_residue": [(5, 4100), (8192 + 9, 3)],
    "different_residue_across_chunks": [(7, CHUNK_BYTES + 4099)],
    # dst 1 / src 33: same residue but the 15-byte head is longer than the tensor.
    "head_longer_than_tensor": [(0, 1), (32 + 1, 5)],
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ALIGNMENT_CASES.values(), ids=ALIGNMENT_CASES.keys())
def test_round_trip_any_alignment(device, layout):
    generator = torch.Generator().manual_seed(3)
    tensors = views_at(layout, generator, device)
    assert_round_trip(tensors, device)
    # And into destinations at other residues: unpack into views of a poisoned storage.
    shifted = [(offset + 9, size) for offset, size in layout]
    targets = views_at(shifted, generator, device)
    unpack(pack(tensors), targets)
    for original, target in zip(tensors, targets):
        assert torch.equal(target, original)


@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=25, deadline=None)
@given(
    places=st.lists(st.tuples(st.integers(0, 47), st.integers(0, 300)), min_size=1, max_size=6),
    shift=st.integers(0, 15),
)
def test_round_trip_random_places(device, places, shift):
    """Any mix of sizes and of source / destination residues mod 16."""
    generator = torch.Generator().manual_seed(len(places) * 16 + shift)
    layout, end = [], 0
    for gap, size in places:  # disjoint places, each after a random gap
        layout.append((end + gap, size))
        end += gap + size
    tensors = views_at(layout, generator, device)
    assert_round_trip(tensors, device)
    targets = views_at([(offset + shift, size) for offset, size in layout], generator, device)
    unpack(pack(tensors), targets)
    for original, target in zip(tensors, targets):
        assert torch.equal(target, original)


@pytest.mark.parametrize("device", DEVICES)
def test_pack_into_larger_out_of_another_dtype_leaves_the_rest(device):
    generator = torch.Generator().manual_seed(4)
    tensors = [random_tensor((n,), torch.uint8, generator, device) for n in (5, 17, 2)]
    out = torch.full((10,), float("nan"), dtype=torch.float32, device=device)  # 40 bytes
    poison = byte_view(out).clone()
    assert pack(tensors, out=out) is out
    assert torch.equal(byte_view(out)[:24], reference_pack(tensors))
    assert torch.equal(byte_view(out)[24:], poison[24:])


@pytest.mark.parametrize("device", DEVICES)
def test_unpack_reads_the_front_of_a_larger_buffer(device):
    generator = torch.Generator().manual_seed(5)
    buffer = random_tensor((100,), torch.uint8, generator, device)
    targets = [poisoned_like(torch.empty(n, dtype=torch.uint8, device=device)) for n in (3, 30)]
    unpack(buffer, targets)
    assert torch.equal(torch.cat(targets), buffer[:33])


@pytest.mark.parametrize("device", DEVICES)
def test_empty_lists_are_no_ops(device):
    empty = pack([])
    assert empty.numel() == 0
    out = torch.full((8,), POISON, dtype=torch.uint8, device=device)
    assert pack([], out=out) is out
    unpack(out, [])
    assert bool((out == POISON).all())
    # Tensors with no bytes need no launch but are still a valid list.
    assert pack([torch.empty(0, device=device)]).numel() == 0


@pytest.mark.parametrize("device", DEVICES)
def test_bad_inputs_raise_value_error(device):
    tensor = torch.zeros(4, 4, device=device)
    with pytest.raises(ValueError, match="not contiguous"):
        pack([tensor.t()])
    with pytest.raises(ValueError, match="not contiguous"):
        unpack(torch.zeros(64, dtype=torch.uint8, device=device), [tensor.t()])
    with pytest.raises(ValueError, match="holds 63 bytes, the tensors need 64"):
        pack([tensor], out=torch.zeros(63, dtype=torch.uint8, device=device))
    with pytest.raises(ValueError, match="holds 8 bytes"):
        unpack(torch.zeros(8, dtype=torch.uint8, device=device), [tensor])
    with pytest.raises(ValueError, match="out must be contiguous"):
        pack([tensor], out=torch.zeros(64, 2, dtype=torch.uint8, device=device).t())
    with pytest.raises(ValueError, match="expected tensors"):
        pack([tensor, [1, 2]])
    with pytest.raises(ValueError, match="strided"):
        pack([torch.eye(3, device=device).to_sparse()])
    with pytest.raises(ValueError):
        pack([torch.zeros(4, device="meta")])


# ------------------------------------------------------------------------ GPU only


@pytest.mark.gpu
def test_device_to_pinned_host_and_back():
    generator = torch.Generator().manual_seed(6)
    tensors = [random_tensor((n,), torch.uint8, generator, "cuda") for n in (1, 4099, 3 * CHUNK_BYTES + 5, 16)]
    total = sum(t.numel() for t in tensors)
    host = torch.full((total,), POISON, dtype=torch.uint8).pin_memory()
    assert pack(tensors, out=host) is host
    torch.cuda.synchronize()
    assert torch.equal(host, reference_pack(tensors).cpu())
    restored = [poisoned_like(t) for t in tensors]
    unpack(host, restored)
    torch.cuda.synchronize()
    for original, copy in zip(tensors, restored):
        assert torch.equal(copy, original)


@pytest.mark.gpu
def test_unpinned_host_memory_is_refused():
    with pytest.raises(ValueError, match="pinned"):
        pack([torch.zeros(4, device="cuda")], out=torch.zeros(16, dtype=torch.uint8))
    with pytest.raises(ValueError, match="at least one CUDA tensor"):
        pack([torch.zeros(4).pin_memory()])


@pytest.mark.gpu
def test_offsets_beyond_2_gib():
    """A tensor that starts past byte 2**31 of the buffer, and chunks past 2**31 in a range."""
    generator = torch.Generator(device="cuda").manual_seed(7)
    big = torch.randint(0, 256, (2**31 + 5,), dtype=torch.uint8, device="cuda", generator=generator)
    small = torch.randint(0, 256, (1000,), dtype=torch.uint8, device="cuda", generator=generator)
    buffer = pack([big, small])
    assert torch.equal(buffer[2**31 + 5 :], small)
    assert torch.equal(buffer[: 2**31 + 5], big)
    del buffer
    restored = [torch.full_like(big, POISON), torch.full_like(small, POISON)]
    unpack(pack([big, small]), restored)
    assert torch.equal(restored[0], big) and torch.equal(restored[1], small)


@pytest.mark.gpu
def test_runs_on_the_current_stream():
    """The launch is ordered after earlier work on the caller's current stream."""
    tensors = [torch.zeros(1000, dtype=torch.int32, device="cuda"), torch.zeros(3, device="cuda")]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        torch.cuda._sleep(50_000_000)  # a launch on another stream would overtake the fill
        tensors[0].fill_(7)
        buffer = pack(tensors)
    torch.cuda.synchronize()
    assert torch.equal(buffer, reference_pack(tensors))


def test_compiles_for_sm90_with_128_bit_accesses(tmp_path):
    """The GPU build, checked without a GPU: aligned bodies move 16 bytes per access."""
    compiled = compile_for_sm90("triton_kernels.multi_tensor_copy", "_multi_tensor_copy_kernel", tmp_path)
    assert compiled["cubin_bytes"] > 0
    assert compiled["accesses"].get("ld.global.v4.b32", 0) > 0
    assert compiled["accesses"].get("st.global.v4.b32", 0) > 0
