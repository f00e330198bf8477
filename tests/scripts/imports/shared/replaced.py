"""A module that puts another object in sys.modules as its import ends, as transformers
does with its lazy module: its names are the replacement's alone. With REPLACED_MARKER
set, its import says it has begun (the file) and lasts until another thread waits for
it (at most 10 s), so that a test can import it from a second job at that moment."""

import importlib._bootstrap
import os
import sys
import time
import types


def _someone_waits() -> bool:
    ref = importlib._bootstrap._module_locks.get(__name__)
    lock = ref() if ref is not None else None
    waiters = getattr(lock, "waiters", 0)
    return (len(waiters) if isinstance(waiters, list) else waiters) > 0


if os.environ.get("REPLACED_MARKER"):
    open(os.environ["REPLACED_MARKER"], "w").close()
    deadline = time.monotonic() + 10
    while not _someone_waits() and time.monotonic() < deadline:
        time.sleep(0.005)


class _Lazy(types.ModuleType):
    def __getattr__(self, name):
        if name == "VALUE":
            return 42
        raise AttributeError(name)


replacement = _Lazy(__name__)
replacement.__spec__ = __spec__
sys.modules[__name__] = replacement
