"""wwrun's Python locks, safe across fork().

Jobs fork: a DataLoader's workers are forked from the job's thread while the other
jobs' threads run on. fork() copies only the forking thread, so a lock another
thread held at that moment stays held forever in the child, and the worker hangs
the first time it takes it (printing, importing, drawing a random number). Every
lock of wwrun that a child may take is made here: in the child each is made free
again, unless the forking thread itself holds it (an RLock, or a Condition over
one, that it will release as usual). A plain Lock is always freed: its holders
never fork while holding it (wwrun's sections run no user code under one). A
library's lock that job code holds across its calls (tqdm's write lock) is registered
here too (`register`); a multiprocessing lock among them keeps its semaphore, shared
with the parent, and only forgets the holds of the threads the child does not have.

The C++ parts do the same with `pthread_atfork` (csrc/allocator/cpu_allocator.cpp,
torch_cuda_allocator.cpp, csrc/rng/job_generators.cpp).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

__all__ = ["Condition", "Lock", "RLock", "after_fork_in_child", "register"]

_locks: weakref.WeakSet = weakref.WeakSet()
_child_hooks: list[Callable[[], None]] = []
_RLOCK_TYPE = type(threading.RLock())


def Lock() -> threading.Lock:  # noqa: N802 - stands in for threading.Lock
    lock = threading.Lock()
    _locks.add(lock)
    return lock


def RLock() -> threading.RLock:  # noqa: N802
    lock = threading.RLock()
    _locks.add(lock)
    return lock


def Condition(lock=None) -> threading.Condition:  # noqa: N802
    condition = threading.Condition(lock)
    _locks.add(condition)
    return condition


def register(lock) -> None:
    """A lock made elsewhere (a library's, held across its own calls) is made free
    again in forked children as wwrun's are."""
    _locks.add(lock)


def after_fork_in_child(hook: Callable[[], None]) -> Callable[[], None]:
    """Runs `hook` in every forked child, after the locks are freed (for state a
    lock guarded that names threads the child does not have)."""
    _child_hooks.append(hook)
    return hook


def _held_by_forking_thread(lock) -> bool:
    inner = getattr(lock, "_lock", lock)  # a Condition's lock
    return isinstance(inner, _RLOCK_TYPE) and inner._is_owned()


def _free_in_child(lock) -> None:
    semlock = getattr(lock, "_semlock", None)
    if semlock is not None:
        # multiprocessing's: the semaphore is shared with the parent, where its holder
        # releases it; the count of holds is this process's. Left at the holder's, the
        # child's first acquire added to it, and its release then kept the semaphore.
        if not semlock._is_mine():
            semlock._after_fork()
    elif not _held_by_forking_thread(lock):
        lock._at_fork_reinit()


def _in_child() -> None:
    for lock in list(_locks):
        _free_in_child(lock)
    for hook in _child_hooks:
        hook()


os.register_at_fork(after_in_child=_in_child)
