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
"""

from __future__ import annotations

import collections
import collections.abc
import importlib.abc
import sys
import threading
import weakref

from wwrun import isolation


class _PerJobFigures(collections.abc.MutableMapping):
    """`Gcf.figs` (an OrderedDict of figure managers) as seen by the calling job."""

    def __init__(self, shared: collections.OrderedDict):
        self._shared = shared
        self._by_job: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()

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


_PATCHES = {"matplotlib._pylab_helpers": _patch_pylab_helpers}


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
