"""Per-job views of state that third-party libraries keep in a module global.

Some libraries that training scripts use keep "the current thing" process-wide:
pyplot's figure registry decides which figure `plt.plot` draws into and what
`plt.get_fignums()` lists. Two jobs drawing at once would draw into each other's
figures (`plt.scatter` then fails with "Argument must be an image or collection in
this Axes"). Each such global gets a per-job view, put in place when the library is
first imported, by whichever thread imports it; threads that belong to no job keep
seeing the original.

    library     state                            job's view
    ----------  -------------------------------  ---------------------------------------
    matplotlib  pyplot's figures (`Gcf.figs`)    the job's own figures, numbered from 1

Others cannot be made per job, only used by one job at a time. torch's tracers keep
the trace in progress in module globals (`torch.export`'s module hierarchy and proxy
mode, `torch.jit.trace`'s graph checks): two jobs tracing at once fail ("Trying to pop
empty mode stack", "Graphs differed across invocations"). `torch.jit.trace`,
`torch.jit.trace_module`, `torch.jit.script` and `torch.export.export` take one
process-wide lock, as dynamo's own `compile_lock` does for `torch.compile`; what they
produce runs concurrently.

One goes the other way: inductor tells its compiled C++ wrappers an address through
the environment (`_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`, read with C `getenv`),
which a job's own `os.environ` would keep from them. The address is the same for
every job, so it is set once in the process's environment.
"""

from __future__ import annotations

import collections
import collections.abc
import functools
import importlib.abc
import sys
import threading
import weakref

from wwrun import forksafe, isolation


class _PerJobFigures(collections.abc.MutableMapping):
    """`Gcf.figs` (an OrderedDict of figure managers) as seen by the calling job."""

    def __init__(self, shared: collections.OrderedDict):
        self._shared = shared
        self._by_job: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = forksafe.Lock()

    def _target(self) -> collections.OrderedDict:
        job = isolation.current_job()
        if job is None:
            return self._shared
        with self._lock:
            return self._by_job.setdefault(job, collections.OrderedDict())

    def __getitem__(self, key):
        return self._target()[key]

    def __setitem__(self, key, value):
        self._target()[key] = value

    def __delitem__(self, key):
        del self._target()[key]

    def __iter__(self):
        return iter(self._target())

    def __len__(self):
        return len(self._target())

    def __contains__(self, key):
        return key in self._target()

    # pyplot reverses these views (`next(reversed(figs.values()))`): the dict's own are.
    def keys(self):
        return self._target().keys()

    def values(self):
        return self._target().values()

    def items(self):
        return self._target().items()

    def move_to_end(self, key, last=True):
        self._target().move_to_end(key, last)

    def __repr__(self):
        return repr(self._target())


def _patch_pylab_helpers(module) -> None:
    if not isinstance(module.Gcf.figs, _PerJobFigures):
        module.Gcf.figs = _PerJobFigures(module.Gcf.figs)


_TRACING = forksafe.RLock()
_tracer = threading.local()


def tracing() -> bool:
    """Whether this thread is inside `torch.jit.trace`/`script` or `torch.export.export`
    (the engine's hooks stay out of what they record)."""
    return getattr(_tracer, "depth", 0) > 0


def _one_at_a_time(function):
    if getattr(function, "__wwrun_locked__", False):
        return function

    @functools.wraps(function)
    def locked(*args, **kwargs):
        with _TRACING:
            _tracer.depth = getattr(_tracer, "depth", 0) + 1
            try:
                return function(*args, **kwargs)
            finally:
                _tracer.depth -= 1

    locked.__wwrun_locked__ = True
    return locked


def _patch_tracers(jit) -> None:
    for name in ("trace", "trace_module", "script"):
        setattr(jit, name, _one_at_a_time(getattr(jit, name)))


def _patch_export(export) -> None:
    export.export = _one_at_a_time(export.export)


def _share_inductor_address(codecache) -> None:
    import torch

    address = torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr
    isolation.process_environ()["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(address)


_PATCHES = {
    "matplotlib._pylab_helpers": _patch_pylab_helpers,
    "torch.jit": _patch_tracers,
    "torch.export": _patch_export,
    "torch._inductor.codecache": _share_inductor_address,
}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Applies a patch to a module of `_PATCHES` right after its first execution."""

    def find_spec(self, fullname, path=None, target=None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_patch(module):
            exec_module(module)
            patch(module)

        loader.exec_module = exec_then_patch
        return spec


def install() -> None:
    """Patch the libraries already imported; patch the others on their first import."""
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            patch(sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
