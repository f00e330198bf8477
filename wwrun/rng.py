"""Per-job random state: each job draws from its own generators, as if run alone.

Python, numpy and torch keep their default random state process-wide: a job's
`torch.manual_seed(1337)` would reseed every job, and the jobs' draws would
interleave. From `enter_job()` on, the calling thread (a job's main thread) and the
threads it starts see the job's own state instead:

    state                          job's view                          how
    -----------------------------  ----------------------------------  ---------------------------------
    torch's CPU default generator  a `torch.Generator` per job         ops: `csrc/rng` (below); Python
    torch's CUDA generators        one `torch.Generator` per device      API: patched `torch.manual_seed`,
                                                                         `seed`, `initial_seed`,
                                                                         `get/set_rng_state`,
                                                                         `torch.cuda.default_generators`
    Python's `random`              a `random.Random()` per job         thread-dispatching module functions
    numpy's legacy global state    a `numpy.random.RandomState()`      same, for `numpy.random.<fn>`;
                                                                       `mtrand._rand` a property

Ops draw from the job's generator through a C++ extension (`csrc/rng/`, built at
first use against the installed torch like the allocator, `wwrun.build`; a run
stops with its error when it cannot be built): job threads carry a
dispatch key whose kernel, on every op with a `Generator?` argument, replaces a
missing (or torch's default) generator with the job's. So dropout, `randn`,
`randperm`, `torch.nn.init`, DataLoader shuffling and `fork_rng` all follow the
job's seed, and a seeded script reproduces its solo losses bit for bit beside others.

Fresh state is seeded as under `python`: torch's CPU generator and `random`,
`numpy.random` from the OS's entropy, CUDA generators with torch's default seed.
Threads of no job (the launcher) see the process's own state, untouched.

Not covered: ops registered after the first job started, ops that draw without
taking a generator on devices other than CUDA, `torch.default_generator` used
directly (`torch.default_generator.manual_seed(...)` reseeds the shared one, though
passing it to an op draws from the job's), and the process's numpy RandomState held
from before the job started (a library's `from numpy.random.mtrand import _rand`).
"""

from __future__ import annotations

import functools
import random
import sys
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path

from wwrun import forksafe

__all__ = ["JobRandomState", "current_state", "enter_job", "install", "leave_job", "source_dir"]

# CUDA kernels that draw from the default generator without taking one (Note
# [Swapped draws] in csrc/rng/job_generators.cpp); those absent from a torch are skipped.
SWAPPED_OPS = [
    "aten::native_dropout",
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_flash_attention_forward",
    "aten::_efficient_attention_forward",
]
_CXX_FLAGS = ["-O3", "-Wall"]
_TORCH_FUNCTIONS = ("manual_seed", "seed", "initial_seed", "get_rng_state", "set_rng_state")

_local = threading.local()
_install_lock = forksafe.Lock()
_installed = False
_extension = None  # the compiled module, once installed
_originals: dict = {}
_by_key: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # the extension's job keys


@dataclass(eq=False)
class JobRandomState:
    """One job's generators, shared by all its threads."""

    torch_cpu: object | None = None
    """The job's `torch.Generator`."""
    torch_cuda: list = field(default_factory=list)
    """The job's CUDA generators, by device index."""
    python: random.Random = field(default_factory=random.Random)
    numpy: object | None = None


def current_state() -> JobRandomState | None:
    """The calling thread's job state, or None outside jobs. A thread of torch's
    that runs a job's work (the autograd thread in its backward on CUDA, see Note
    [Work for a job] in csrc/rng) gets that job's."""
    state = getattr(_local, "state", None)
    if state is None and _extension is not None:
        key = _extension.current_job()
        if key:
            state = _by_key.get(key)
    return state


def source_dir() -> Path:
    """`csrc/rng` of a checkout, or its copy installed as package data."""
    here = Path(__file__).resolve().parent
    for candidate in (here / "csrc" / "rng", here.parent / "csrc" / "rng"):
        if (candidate / "job_generators.cpp").is_file():
            return candidate
    raise RuntimeError(f"wwrun rng: C++ sources not found next to {here} (expected csrc/rng)")


def enter_job() -> JobRandomState:
    """Give the calling thread (a job's main thread) fresh random state of its own."""
    install()
    import torch

    state = JobRandomState(numpy=_new_numpy_state())
    state.torch_cpu = torch.Generator()
    state.torch_cpu.seed()  # as torch seeds its default generator at start-up
    if torch.cuda.is_available():
        _wrap_cuda_generators()
        state.torch_cuda = [torch.Generator(device=f"cuda:{i}") for i in range(torch.cuda.device_count())]
    _activate(state)
    return state


def leave_job() -> None:
    """The calling thread draws from the process's state again."""
    _activate(None)


def _activate(state: JobRandomState | None) -> None:
    _local.state = state
    if _extension is None:
        return
    if state is None:
        _extension.leave()
    else:
        _by_key[id(state)] = state
        _extension.enter(state.torch_cpu, state.torch_cuda, id(state))


def install() -> None:
    """Build the extension and put the per-job views in place (once per process);
    raises wwrun.build.BuildError when the extension cannot be built."""
    global _installed
    with _install_lock:
        if _installed:
            return
        _build_extension()
        _patch_threads()
        _patch_python_random()
        _patch_numpy()
        _patch_torch()
        _installed = True


def _build_extension() -> None:
    """Builds the extension (wwrun.build) and registers its kernels. A failure is
    raised (wwrun.build.BuildError): without it, seeded jobs would share torch's
    generator and no longer reproduce their solo runs."""
    global _extension
    from wwrun import build

    src = source_dir()
    module = build.load("wwrun_rng", [src / "job_generators.cpp"], what="wwrun's per-job random generators",
                        extra_cflags=_CXX_FLAGS, extra_include_paths=[src.parent / "common"])
    module.register_kernels(SWAPPED_OPS)
    _extension = module


# -- threads ------------------------------------------------------------------------


def _patch_threads() -> None:
    # A thread takes up its starter's state once it runs, before its `run`: nothing
    # in between the thread's own frames (a traceback of an error in it is Python's).
    start, bootstrap = threading.Thread.start, threading.Thread._bootstrap_inner

    def thread_start(self):
        self._wwrun_rng_state = current_state()
        return start(self)

    def bootstrap_inner(self):
        state = getattr(self, "_wwrun_rng_state", None)
        if state is not None:
            _activate(state)
        return bootstrap(self)

    threading.Thread.start = functools.wraps(start)(thread_start)
    threading.Thread._bootstrap_inner = functools.wraps(bootstrap)(bootstrap_inner)


# -- Python's random and numpy.random -------------------------------------------------


def _view(module, name: str, own, method: str | None = None) -> None:
    """Replace `module.name` by a function that calls the job's
    `own(state).<method or name>`."""
    original = getattr(module, name)
    method = method or name

    @functools.wraps(original)
    def dispatch(*args, **kwargs):
        state = getattr(_local, "state", None)
        if state is None:
            return original(*args, **kwargs)
        return getattr(own(state), method)(*args, **kwargs)

    setattr(module, name, dispatch)


def _patch_python_random() -> None:
    for name in random.__all__:
        if callable(getattr(random._inst, name, None)) and not isinstance(getattr(random, name), type):
            _view(random, name, lambda state: state.python)


def _new_numpy_state():
    numpy = sys.modules.get("numpy")
    return numpy.random.RandomState() if numpy is not None else None


def _patch_numpy() -> None:
    try:
        import numpy
        import numpy.random.mtrand as mtrand
    except ImportError:
        return
    for name in dir(mtrand):
        if name.startswith("_") or isinstance(getattr(mtrand, name), type):
            continue
        if name in ("ranf", "sample"):  # aliases of random_sample, not RandomState methods
            _view(numpy.random, name, lambda state: state.numpy, "random_sample")
            continue
        if callable(getattr(numpy.random.RandomState, name, None)) and hasattr(numpy.random, name):
            _view(numpy.random, name, lambda state: state.numpy)
    _per_job_rand(mtrand)


def _per_job_rand(mtrand) -> None:
    """`numpy.random.mtrand._rand`, the RandomState numpy.random's functions draw from,
    as the job's: scikit-learn's `check_random_state(None)` (every `random_state=None`)
    reads it directly, and drew from the process's state whatever the job seeded. A
    module global cannot be a property, so the module gets a subclass of its type."""
    base = type(mtrand)
    if getattr(base, "_wwrun_per_job", False):
        return

    def own():
        state = getattr(_local, "state", None)
        return state if state is not None and state.numpy is not None else None

    def get(module):
        state = own()
        return module.__dict__["_rand"] if state is None else state.numpy

    def set_(module, value):
        state = own()
        if state is None:
            module.__dict__["_rand"] = value
        else:
            state.numpy = value

    mtrand.__class__ = type(base.__name__, (base,), {"_rand": property(get, set_), "_wwrun_per_job": True})


# -- torch's Python API ---------------------------------------------------------------


def _manual_seed(seed):
    state = current_state()
    if state is None:
        return _originals["manual_seed"](seed)
    seed = int(seed)
    for generator in state.torch_cuda:
        generator.manual_seed(seed)
    return state.torch_cpu.manual_seed(seed)


def _seed():
    state = current_state()
    if state is None:
        return _originals["seed"]()
    seed = state.torch_cpu.seed()
    for generator in state.torch_cuda:
        generator.manual_seed(seed)
    return seed


def _initial_seed():
    state = current_state()
    return _originals["initial_seed"]() if state is None else state.torch_cpu.initial_seed()


def _get_rng_state():
    state = current_state()
    return _originals["get_rng_state"]() if state is None else state.torch_cpu.get_state()


def _set_rng_state(new_state):
    state = current_state()
    if state is None:
        return _originals["set_rng_state"](new_state)
    state.torch_cpu.set_state(new_state)


_REPLACEMENTS = {
    "manual_seed": _manual_seed,
    "seed": _seed,
    "initial_seed": _initial_seed,
    "get_rng_state": _get_rng_state,
    "set_rng_state": _set_rng_state,
}


def _patch_torch() -> None:
    import torch
    import torch.random

    for name in _TORCH_FUNCTIONS:
        original = getattr(torch.random, name)
        _originals[name] = original
        replacement = functools.wraps(original)(_REPLACEMENTS[name])
        torch.random.__dict__[name] = replacement
        # `torch.manual_seed` is torch.random's, or dynamo's wrapper of it once
        # torch._dynamo is imported (it keeps dynamo from tracing into seeding).
        exported = getattr(torch, name, None)
        if exported is original or getattr(exported, "__wrapped__", None) is original:
            setattr(torch, name, replacement)
    if torch.cuda.is_available():
        # torch.cuda.manual_seed(_all), seed, get/set_rng_state(_all) and fork_rng
        # index torch.cuda.default_generators, set when CUDA initializes.
        torch.cuda._lazy_call(_wrap_cuda_generators)


class _JobCudaGenerators(tuple):
    """`torch.cuda.default_generators`: the calling job's, else the process's."""

    def __getitem__(self, index):
        state = current_state()
        if state is not None and state.torch_cuda:
            return state.torch_cuda[index]
        return tuple.__getitem__(self, index)

    def __iter__(self):
        state = current_state()
        if state is not None and state.torch_cuda:
            return iter(state.torch_cuda)
        return tuple.__iter__(self)


def _wrap_cuda_generators() -> None:
    import torch

    shared = torch.cuda.default_generators
    if shared and not isinstance(shared, _JobCudaGenerators):
        torch.cuda.default_generators = _JobCudaGenerators(shared)
