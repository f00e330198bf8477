"""Helpers shared by the Triton kernel tests: devices, random bytes, poisoned outputs."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()

# Without CUDA the kernels run in Triton's interpreter on CPU tensors (conftest.py);
# with CUDA they are compiled, and the interpreter (hence CPU-only launches) is off.
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="interpreter runs only without CUDA")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]

POISON = 0xA5
"""Fill for outputs: a byte the kernel should have written but did not shows up."""


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor (compares NaNs and bools bit for bit)."""
    return tensor.reshape(-1).view(torch.uint8)


def random_tensor(shape, dtype, generator, device) -> torch.Tensor:
    """A tensor of `shape` and `dtype` whose bytes are random (any bit pattern)."""
    numel = torch.Size(shape).numel()
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape).to(device)


def poisoned_like(tensor: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(tensor)
    byte_view(out).fill_(POISON)
    return out


def views_at(layout, generator, device) -> list[torch.Tensor]:
    """uint8 tensors at the given (byte offset, size) places of one random storage.

    The storage comes from the allocator, so its start is aligned (512 bytes on CUDA,
    64 on the CPU): `offset % 16` is then each view's address modulo 16.
    """
    end = max(offset + size for offset, size in layout)
    storage = random_tensor((end,), torch.uint8, generator, device)
    assert storage.data_ptr() % 16 == 0
    return [storage[offset : offset + size] for offset, size in layout]


_COMPILE_SCRIPT = """
import json, re, sys
from collections import Counter
import importlib, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton_kernels.utils import BLOCK_BYTES, CHUNK_BYTES, NUM_WARPS
module, name = sys.argv[1:3]
kernel = getattr(importlib.import_module(module), name)
signature = {arg: "constexpr" if arg in ("CHUNK", "BLOCK") else "i32" if arg == "num_ranges" else "*i64"
             for arg in kernel.arg_names}
source = ASTSource(fn=kernel, signature=signature, constexprs={"CHUNK": CHUNK_BYTES, "BLOCK": BLOCK_BYTES})
compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": NUM_WARPS})
accesses = Counter(re.findall(r"(?:ld|st)\\.global[.\\w]*", compiled.asm["ptx"]))
print(json.dumps({"accesses": accesses, "cubin_bytes": len(compiled.asm["cubin"])}))
"""


def compile_for_sm90(module: str, kernel: str, tmp_path) -> dict:
    """Compile a kernel for an H100 (sm_90) without a GPU, in a subprocess.

    This process runs Triton's interpreter, which never compiles; a fresh process
    without TRITON_INTERPRET goes through the real pipeline down to a cubin (Triton's
    wheel carries ptxas). Returns {"accesses": {PTX global access op: count}, ...}.
    """
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton_cache")
    env["TRITON_DEFAULT_FP_FUSION"] = "1"  # silences a 3.9 deprecation notice
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1]), env.get("PYTHONPATH", "")])
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_SCRIPT, module, kernel],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.strip().splitlines()[-1])
