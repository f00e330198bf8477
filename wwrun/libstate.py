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
    tqdm        its bars (`tqdm._instances`)      the job's own bars: its first bar is at
                                                 position 0, as when alone
    rich        its global console               the job's own console: `reconfigure`
                (`rich.get_console()`)           and its live displays stay the job's
    logging.config  `dictConfig` and `fileConfig`    the job's own root handlers only
                first close every handler
    accelerate  its Borg state (`PartialState`,  the job's own: its process and
                `AcceleratorState`,              accumulation state
                `GradientState._shared_state`)
    wandb       the run in progress in module    the job's own run, `wandb.config`,
                globals (`wandb.run`, `.config`,  `.log`, `.summary`...
                `.log`, `.summary`...)
    joblib      loky's reusable executor         the job's own executor, its workers
                (`reusable_executor._executor`)  in the job's folder and environment
    hydra       its singletons of the run in     the job's own `GlobalHydra`,
                progress (`Singleton._instances`) `HydraConfig`, `JobRuntime` and
                                                 `VersionBase`; its registries (config
                                                 store, plugins) stay shared, as modules
                                                 fill them at import

Others cannot be made per job, only used by one job at a time. torch's tracers keep
the trace in progress in module globals (`torch.export`'s module hierarchy and proxy
mode, `torch.jit.trace`'s graph checks): two jobs tracing at once fail ("Trying to pop
empty mode stack", "Graphs differed across invocations"). `torch.jit.trace`,
`torch.jit.trace_module`, `torch.jit.script` and `torch.export.export` take one
process-wide lock, as dynamo's own `compile_lock` does for `torch.compile`; what they
produce runs concurrently.

torch's module locks that a forked child may take (torch.cuda's seeding lock, which
every DataLoader worker takes as it seeds) are made free in the child (`forksafe`).

torch's profiler is one per process too (kineto's session, the autograd profiler's
state): two jobs profiling at once crashed the process (a segfault as one stopped).
A profiling session, `torch.profiler.profile` or `torch.autograd.profiler.profile`
from its start to its stop, is one job's at a time; another job's waits, saying so,
and a job's session ends with the job.

torch.fx's tracer, which torch.compile runs on every graph, needs both: while it
traces it points `nn.Module.__call__` and `__getattr__` at itself and raises a global
flag, so another job's module calls went into its trace ("module is not installed as
a submodule") and that job's compiled model refused to run ("Detected that you are
using FX to symbolically trace a dynamo-optimized function"). Its traces take turns
(under dynamo's `compile_lock`), and what a trace points at itself, and its flag,
hold only in the thread that traces.

One is a flag: `torch.compiler.is_compiling()` reads a module global that dynamo
holds True for a whole compile session. Another job's eager code asking it meanwhile
took the compiled path: `torch.optim.Adam(W)` then kept its step count as a tensor
(`optimizer._get_value`) and computed the bias correction in float32 rather than in
Python floats, ending a few ulps away from the same seeded script alone. The flag is
made per thread: true in the thread that compiles, as when alone.

One goes the other way: inductor tells its compiled C++ wrappers an address through
the environment (`_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`, read with C `getenv`),
which a job's own `os.environ` would keep from them. The address is the same for
every job, so it is set once in the process's environment.
"""

from __future__ import annotations

import builtins
import collections
import collections.abc
import contextlib
import functools
import importlib.abc
import sys
import threading
import types
import weakref
from collections.abc import Callable

from wwrun import forksafe, isolation


class _PerJobFigures(collections.abc.MutableMapping):
    """`Gcf.figs` (an OrderedDict of figure managers) as seen by the calling job."""

    def __init__(self, shared: collections.OrderedDict):
        self._shared = shared
        self._own = _JobValues(collections.OrderedDict)

    def _target(self) -> collections.OrderedDict:
        own = self._own.mine()
        return self._shared if own is None else own

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


class _PerJobBars:
    """`tqdm._instances` (a WeakSet of the live bars, which chooses each new bar's
    screen row) as seen by the calling job. Alone, a script's first bar is at row 0
    and draws with carriage returns only; sharing one set, a second job's bar went
    to row 1 and moved the cursor up and down in its output. Threads of no job (tqdm's
    monitor thread) see every bar."""

    def __init__(self, shared):
        self._shared = shared
        self._own = _JobValues(weakref.WeakSet)

    def _target(self):
        own = self._own.mine()
        return self._shared if own is None else own

    def _all(self) -> list:
        sets = [self._shared, *self._own.all()]
        return [bar for bars in sets for bar in list(bars)]

    def add(self, bar) -> None:
        self._target().add(bar)

    def remove(self, bar) -> None:
        """From its own job's set, wherever it is closed from (a collection in
        another job's thread closes an abandoned bar)."""
        own = self._target()
        if bar in own:
            own.remove(bar)
            return
        for bars in [self._shared, *self._own.all()]:
            if bar in bars:
                bars.discard(bar)
                return
        raise KeyError(bar)

    def discard(self, bar) -> None:
        try:
            self.remove(bar)
        except KeyError:
            pass

    def _view(self) -> list:
        return self._all() if isolation.current_job() is None else list(self._target())

    def __iter__(self):
        return iter(self._view())

    def __len__(self):
        return len(self._view())

    def __contains__(self, bar):
        return bar in self._view()

    def copy(self):
        return weakref.WeakSet(self._view())


def _patch_tqdm(module) -> None:
    if not isinstance(module.tqdm._instances, _PerJobBars):
        module.tqdm._instances = _PerJobBars(module.tqdm._instances)
    # tqdm's write lock takes a process-shared lock, then this thread lock: a DataLoader
    # worker forked while another job's thread drew a bar found it held for good, and
    # held the shared one meanwhile, so every job's workers and bars waited on it.
    # The shared lock is made at the first bar; a plain os.fork() child (no
    # multiprocessing bootstrap to reset it) that took it kept it when done.
    write_lock = module.TqdmDefaultWriteLock
    if write_lock.th_lock is not None:
        forksafe.register(write_lock.th_lock)
    if getattr(write_lock.create_mp_lock, "__wwrun_registers__", False):
        return
    create_mp_lock = write_lock.create_mp_lock.__func__

    def create_and_register(cls):
        create_mp_lock(cls)
        if getattr(cls, "mp_lock", None) is not None:
            forksafe.register(cls.mp_lock)

    create_and_register.__wwrun_registers__ = True
    write_lock.create_mp_lock = classmethod(create_and_register)
    if getattr(write_lock, "mp_lock", None) is not None:
        forksafe.register(write_lock.mp_lock)


def _patch_pylab_helpers(module) -> None:
    if not isinstance(module.Gcf.figs, _PerJobFigures):
        module.Gcf.figs = _PerJobFigures(module.Gcf.figs)


class _JobValues:
    """One value per job, made at the calling job's first ask (`make()`) and gone with
    the job; threads of no job have none (None)."""

    def __init__(self, make: Callable[[], object]):
        self._make = make
        self._by_job: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        # Reentrant: a collection inside may close an abandoned tqdm bar, which removes
        # it. Fork-safe: a DataLoader worker forked while another job held it uses it too.
        self._lock = forksafe.RLock()

    def mine(self):
        job = isolation.current_job()
        if job is None:
            return None
        value = self._by_job.get(job)
        if value is None:
            with self._lock:
                value = self._by_job.get(job)
                if value is None:
                    value = self._by_job[job] = self._make()
        return value

    def peek(self):
        """The calling job's value if it has one yet, without making it."""
        job = isolation.current_job()
        return self._by_job.get(job) if job is not None else None

    def all(self) -> list:
        """Every job's value."""
        with self._lock:
            return list(self._by_job.values())

    def set_mine(self, value) -> bool:
        """False for a thread of no job (nothing set)."""
        job = isolation.current_job()
        if job is None:
            return False
        with self._lock:
            self._by_job[job] = value
        return True


def _new_console():
    from rich.console import Console

    return Console()


def _get_console():
    """Runs as `rich.get_console`, in rich's namespace: the job's console, else rich's
    global one (made at first use, as rich does)."""
    global _console
    console = _wwrun_job_console()  # noqa: F821 - rich's globals
    if console is not None:
        return console
    if _console is None:
        from rich.console import Console

        _console = Console()
    return _console


def _patch_rich(module) -> None:
    if "_wwrun_job_console" in vars(module):
        return
    # The console `rich.get_console()` gives a job: progress bars, live displays and
    # `rich.print` find it there, and `rich.reconfigure` replaces it. Shared,
    # Lightning's RichProgressBar in one job reconfigured the console while another
    # job's bar was live on it: that bar then failed as it stopped ("pop from empty
    # list", its live display gone from the console).
    module._wwrun_job_console = _JobValues(_new_console).mine
    # Its identity stays, only its code changes: rich's own modules (progress, live,
    # logging), imported before the jobs by our live table, hold the function itself.
    # `reconfigure` reaches the job's console through it.
    module.get_console.__code__ = _get_console.__code__


_HYDRA_PER_JOB = frozenset({"hydra.core.global_hydra.GlobalHydra", "hydra.core.hydra_config.HydraConfig",
                            "hydra.core.utils.JobRuntime", "hydra.version.VersionBase"})


class _PerJobSingletons(collections.abc.MutableMapping):
    """Hydra's `Singleton._instances` (class -> its one instance) as the calling job
    sees it: the singletons of a `@hydra.main` run in progress are the job's own, the
    registries that modules fill at import are shared. Shared, a second job's
    `@hydra.main` failed at once ("GlobalHydra is already initialized"), and
    `HydraConfig.get()` would have been another job's."""

    def __init__(self, shared: dict):
        self._shared = shared
        self._own = _JobValues(dict)

    def _target(self, cls) -> dict:
        if f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', '')}" not in _HYDRA_PER_JOB:
            return self._shared
        own = self._own.mine()
        return self._shared if own is None else own

    def _view(self) -> dict:
        return {**self._shared, **(self._own.peek() or {})}

    def __getitem__(self, cls):
        return self._target(cls)[cls]

    def __setitem__(self, cls, instance):
        self._target(cls)[cls] = instance

    def __delitem__(self, cls):
        del self._target(cls)[cls]

    def __contains__(self, cls):
        return cls in self._target(cls)

    def __iter__(self):
        return iter(self._view())

    def __len__(self):
        return len(self._view())

    def __deepcopy__(self, memo):  # `Singleton.get_state()`: what the calling job sees, as a plain dict
        import copy

        return copy.deepcopy(self._view(), memo)


def _patch_hydra_singletons(module) -> None:
    if not isinstance(module.Singleton._instances, _PerJobSingletons):
        module.Singleton._instances = _PerJobSingletons(module.Singleton._instances)


class _PerJobSharedState:
    """A Borg class's shared state as the calling job sees it: accelerate's
    `PartialState`, `AcceleratorState` and `GradientState` keep theirs in a class
    attribute dict that every instance's `__dict__` is. Shared, two jobs' Accelerators
    were one: each job's `accumulate()` synced on the other's steps, and both trained
    to other losses than under `python`. Each job's is its own, as in a process of its
    own (accelerate keeps it per thread itself on TPUs, `ThreadLocalSharedDict`)."""

    def __init__(self, shared: dict):
        self._shared = shared
        self._own = _JobValues(dict)

    def __get__(self, obj, objtype=None) -> dict:
        state = self._own.mine()
        return self._shared if state is None else state

    def __set__(self, obj, value) -> None:
        if not self._own.set_mine(value):
            self._shared = value


_ACCELERATE_BORGS = ("PartialState", "AcceleratorState", "GradientState")


def _patch_accelerate_state(module) -> None:
    for name in _ACCELERATE_BORGS:
        cls = getattr(module, name, None)
        if cls is not None and not isinstance(cls.__dict__.get("_shared_state"), _PerJobSharedState):
            cls._shared_state = _PerJobSharedState(cls._shared_state)


class _PerJobModuleAttribute:
    """A module global as the calling job sees it: what the job set, else the module's
    own value (what threads of no job, and jobs that set nothing, see)."""

    def __init__(self, name: str):
        self._name = name
        self._own = _JobValues(lambda: None)  # (value,) once the job set it: None is a value

    def __get__(self, module, owner=None):
        if module is None:
            return self
        held = self._own.peek()
        if held is not None:
            return held[0]
        try:
            return module.__dict__[self._name]
        except KeyError:
            raise AttributeError(f"module {module.__name__!r} has no attribute {self._name!r}") from None

    def __set__(self, module, value) -> None:
        if not self._own.set_mine((value,)):
            module.__dict__[self._name] = value


def per_job_attributes(module, names) -> None:
    """Make the module globals `names` per job (`_PerJobModuleAttribute`), through a
    subclass of the module's type: module attributes cannot be descriptors otherwise."""
    if getattr(type(module), "_wwrun_per_job", None) is not None:
        return
    attributes = {name: _PerJobModuleAttribute(name) for name in names}
    module.__class__ = type(type(module).__name__, (type(module),), {**attributes, "_wwrun_per_job": tuple(names)})


# wandb.init puts its run's methods in wandb's module globals (`set_global`), and its
# finish puts back placeholders (`unset_globals`): shared, a second job's init took the
# first job's `wandb.config`, `wandb.log` and `wandb.summary` over.
_WANDB_GLOBALS = ("run", "config", "log", "summary", "save", "use_artifact", "log_artifact", "define_metric",
                  "alert", "mark_preempting", "log_model", "use_model", "link_model", "watch", "unwatch")


def _patch_wandb(module) -> None:
    per_job_attributes(module, _WANDB_GLOBALS)


def _patch_logging_config(module) -> None:
    """`logging.config.dictConfig` and `fileConfig` first close every handler of the
    process (`_clearExistingHandlers`): in a job, another job's file handler opened
    with mode "w" then dropped its records for good. In a job they close the job's own
    root handlers, the ones its configuration replaces (the root's handlers are each
    job's, isolation's `_JobRootLogger`)."""
    clear = module._clearExistingHandlers
    if getattr(clear, "__wwrun_per_job__", False):
        return

    @functools.wraps(clear)
    def clear_existing_handlers():
        job = isolation.current_job()
        if job is None:
            return clear()
        module.logging._handlers.clear()  # the names a configuration's handlers are known by
        for handler in job.root_handlers:
            with contextlib.suppress(Exception):
                handler.flush()
                handler.close()

    clear_existing_handlers.__wwrun_per_job__ = True
    module._clearExistingHandlers = clear_existing_handlers


_TRACING = forksafe.RLock()
_tracer = threading.local()
_traced = 0  # tracer calls in progress, in any thread (one thread at a time: _TRACING)


def tracing() -> bool:
    """Whether this thread is inside `torch.jit.trace`/`script` or `torch.export.export`
    (the engine's hooks stay out of what they record). Asked at every module call of
    every job: the thread's own depth is looked up only while some thread traces."""
    return _traced > 0 and getattr(_tracer, "depth", 0) > 0


def _one_at_a_time(function):
    if getattr(function, "__wwrun_locked__", False):
        return function

    @functools.wraps(function)
    def locked(*args, **kwargs):
        global _traced
        with _TRACING:
            _tracer.depth = getattr(_tracer, "depth", 0) + 1
            _traced += 1
            try:
                return function(*args, **kwargs)
            finally:
                _tracer.depth -= 1
                _traced -= 1

    locked.__wwrun_locked__ = True
    return locked


def _patch_tracers(jit) -> None:
    for name in ("trace", "trace_module", "script"):
        setattr(jit, name, _one_at_a_time(getattr(jit, name)))


def _patch_export(export) -> None:
    export.export = _one_at_a_time(export.export)


class _ProfilerSessions:
    """Who profiles now: one job's session at a time (the launcher's own, None, too)."""

    WAIT_NOTE_S = 1.0

    def __init__(self):
        self._cond = forksafe.Condition(forksafe.Lock())
        self._owner: object = None
        self._depth = 0

    def acquire(self) -> None:
        me = isolation.current_job() or threading.current_thread()
        with self._cond:
            said = False
            while self._depth and self._owner is not me:
                if not self._cond.wait(self.WAIT_NOTE_S) and not said:
                    said = True
                    print(f"wwrun: {getattr(me, 'name', me)} waits for "
                          f"{getattr(self._owner, 'name', self._owner)}'s torch.profiler session to end "
                          "(one job profiles at a time)", file=isolation.original_stderr(), flush=True)
            self._owner = me
            self._depth += 1

    def release(self, owner: object = None) -> None:
        """One session of the caller's ends; with `owner` (an ended job), all of its."""
        me = owner if owner is not None else (isolation.current_job() or threading.current_thread())
        with self._cond:
            if self._owner is not me or not self._depth:
                return
            self._depth = 0 if owner is not None else self._depth - 1
            if not self._depth:
                self._owner = None
                self._cond.notify_all()


profiler_sessions = _ProfilerSessions()


def _patch_profiler(autograd_profiler) -> None:
    profile = autograd_profiler.profile
    if getattr(profile._prepare_trace, "__wwrun_locked__", False):
        return
    prepare, leave = profile._prepare_trace, profile.__exit__

    @functools.wraps(prepare)
    def prepare_trace(self, *args, **kwargs):
        if not getattr(self, "_wwrun_session", False):
            profiler_sessions.acquire()
            self._wwrun_session = True
        try:
            return prepare(self, *args, **kwargs)
        except BaseException:
            self._wwrun_session = False
            profiler_sessions.release()
            raise

    @functools.wraps(leave)
    def exit_(self, *args):
        try:
            return leave(self, *args)
        finally:
            if getattr(self, "_wwrun_session", False):
                self._wwrun_session = False
                profiler_sessions.release()

    prepare_trace.__wwrun_locked__ = True
    profile._prepare_trace, profile.__exit__ = prepare_trace, exit_


_compiling = threading.local()


def _is_compiling() -> bool:
    """Runs as `torch.compiler.is_compiling`, in that module's namespace: the global
    flag (export sets it) or this thread's compile session."""
    if torch.jit.is_scripting():  # noqa: F821 - torch.compiler's globals
        return False
    return _is_compiling_flag or getattr(_wwrun_compiling, "depth", 0) > 0  # noqa: F821


def _compiling_per_thread(compiler) -> None:
    if getattr(compiler, "_wwrun_compiling", None) is not None:
        return
    if not hasattr(compiler, "_compile_session_context") or not hasattr(compiler, "_is_compiling_flag"):
        return  # a torch that keeps the flag otherwise: left as it is

    @contextlib.contextmanager
    def compile_session():
        _compiling.depth = getattr(_compiling, "depth", 0) + 1
        try:
            yield
        finally:
            _compiling.depth -= 1

    compiler._wwrun_compiling = _compiling
    compiler._compile_session_context = compile_session
    # The function keeps its identity, only its code changes: dynamo folds calls to
    # it by identity while it traces.
    compiler.is_compiling.__code__ = _is_compiling.__code__


_fx_tracer = threading.local()


def _is_fx_tracing() -> bool:
    """Runs as `torch.fx._symbolic_trace.is_fx_tracing`, in that module's namespace:
    the global flag, raised by the trace in this thread only."""
    is_fx_tracing_warning()  # noqa: F821 - the fx module's globals
    return _is_fx_tracing_flag and getattr(_wwrun_fx_tracer, "depth", 0) > 0  # noqa: F821


def _is_fx_symbolic_tracing() -> bool:
    """Runs as `torch.fx._symbolic_trace.is_fx_symbolic_tracing`, likewise."""
    return (_is_fx_tracing_flag and getattr(_wwrun_fx_tracer, "depth", 0) > 0  # noqa: F821
            and not torch.compiler.is_compiling())  # noqa: F821


def _for_the_tracing_thread(new_fn, original):
    """What an fx patch puts in place: `new_fn` in the thread that traces, `original`
    in every other."""
    tracer = threading.get_ident()

    @functools.wraps(new_fn)
    def patched(*args, **kwargs):
        if threading.get_ident() == tracer:
            return new_fn(*args, **kwargs)
        return original(*args, **kwargs)

    return patched


def _fx_tracing_per_thread(fx) -> None:
    """torch.fx's tracer (torch.compile runs it on every graph, through AOT autograd)
    is process-wide while it traces: it points `nn.Module.__call__` and `__getattr__`,
    and the functions it wraps in modules' globals, at itself, and raises a global flag.
    Another job's module calls meanwhile went into that trace ("module is not installed
    as a submodule"), and its compiled model refused to run ("Detected that you are
    using FX to symbolically trace a dynamo-optimized function"). Now a trace takes
    dynamo's compile lock, as a compile does, so traces take turns; what it points at
    itself is so only in its own thread, and the flag reads true only there."""
    tracer, patcher = fx.Tracer, fx._Patcher
    if getattr(tracer.trace, "__wwrun_locked__", False):
        return
    if not all(hasattr(fx, name) for name in ("_is_fx_tracing_flag", "is_fx_tracing_warning")):
        return  # a torch that keeps the flag otherwise: left as it is
    trace, patch, patch_method = tracer.trace, patcher.patch, patcher.patch_method

    @functools.wraps(trace)
    def locked_trace(self, *args, **kwargs):
        # dynamo's lock, not `_TRACING`: a compile traces holding it, and an export
        # takes `_TRACING` before it; one lock in both orders would deadlock.
        from torch._dynamo.convert_frame import compile_lock

        with compile_lock:
            _fx_tracer.depth = getattr(_fx_tracer, "depth", 0) + 1
            try:
                return trace(self, *args, **kwargs)
            finally:
                _fx_tracer.depth -= 1

    @functools.wraps(patch)
    def patch_here(self, frame_dict, name, new_fn, *args, **kwargs):
        original = frame_dict[name] if name in frame_dict else getattr(builtins, name, None)
        return patch(self, frame_dict, name, _for_the_tracing_thread(new_fn, original), *args, **kwargs)

    @functools.wraps(patch_method)
    def patch_method_here(self, cls, name, new_fn, *args, **kwargs):
        original = getattr(cls, name)
        return patch_method(self, cls, name, _for_the_tracing_thread(new_fn, original), *args, **kwargs)

    locked_trace.__wwrun_locked__ = True
    fx._wwrun_fx_tracer = _fx_tracer
    patcher.patch, patcher.patch_method = patch_here, patch_method_here
    # Each function keeps its identity, only its code changes: dynamo folds calls to
    # them by identity while it traces.
    fx.is_fx_tracing.__code__ = _is_fx_tracing.__code__
    fx.is_fx_symbolic_tracing.__code__ = _is_fx_symbolic_tracing.__code__
    tracer.trace = locked_trace


def _patch_cloudpickle(module) -> None:
    """cloudpickle reduces a module by its exact type (a dispatch table), so the modules
    wwrun gives a subclass of their type for per-job attributes (`sys`, `os`,
    `threading`, numpy's `mtrand`, wandb) could not be pickled: any function of a
    script's that names `os`, sent to joblib's workers (scikit-learn's `n_jobs`), Ray
    or dask, failed with "cannot pickle 'module' object". They pickle as the modules
    they are, by reference. Other module subclasses (a library's own lazy module) are
    left to cloudpickle, as without wwrun."""
    pickler = module.Pickler
    reducer_override = pickler.reducer_override
    if getattr(reducer_override, "__wwrun_per_job__", False):
        return

    @functools.wraps(reducer_override)
    def reduce_wwrun_modules(self, obj):
        if isinstance(obj, types.ModuleType) and type(obj).__module__.startswith("wwrun."):
            return module._module_reduce(obj)
        return reducer_override(self, obj)

    reduce_wwrun_modules.__wwrun_per_job__ = True
    pickler.reducer_override = reduce_wwrun_modules


class _PerJobGlobals:
    """Module globals that a library's own code reads and rebinds (`global _executor`),
    which no per-job attribute can reach: the calling job's own values are put in place
    for the length of each call that uses them (`around`), under one process-wide lock
    (the globals are the process's). A call from inside such a call (the library
    calling itself again) runs with them in place. Threads of no job see the
    originals."""

    _swap_lock = forksafe.RLock()

    def __init__(self, module, first: dict[str, Callable[[], object]]):
        self._module = module
        self._first = first
        """Each global's value for a job that has none yet."""
        self._by_job: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
        self._inside = threading.local()

    def around(self, function: Callable) -> Callable:
        @functools.wraps(function)
        def call(*args, **kwargs):
            job = isolation.current_job()
            if job is not None and getattr(self._inside, "job", None) is job:
                return function(*args, **kwargs)
            with self._swap_lock:
                if job is None:
                    return function(*args, **kwargs)
                namespace = vars(self._module)
                outside = {name: namespace[name] for name in self._first}
                mine = self._by_job.get(job) or {name: make() for name, make in self._first.items()}
                namespace.update(mine)
                self._inside.job = job
                try:
                    return function(*args, **kwargs)
                finally:
                    self._inside.job = None
                    self._by_job[job] = {name: namespace[name] for name in self._first}
                    namespace.update(outside)

        call.__wwrun_per_job__ = True
        return call


def _per_job_classmethod(cls, name: str, per_job: _PerJobGlobals) -> None:
    method = vars(cls).get(name) if cls is not None else None
    function = getattr(method, "__func__", None)
    if function is None or getattr(function, "__wwrun_per_job__", False):
        return  # a version of the library without it: left as it is
    setattr(cls, name, classmethod(per_job.around(function)))


def _per_job_loky_executor(module) -> None:
    """loky's reusable executor (joblib's `Parallel`, scikit-learn's `n_jobs`) is one
    per process, in `reusable_executor._executor`: each job gets its own, as each
    script alone has, and its own lock for it (every executor's submit takes that
    lock). Shared, a job's tasks ran in workers another job started, in that job's
    folder and environment and printing into its log. A job's executor is shut down
    as the job ends (`jobthread._shut_down_executors`)."""
    per_job = _PerJobGlobals(module, {"_executor": lambda: None, "_executor_kwargs": lambda: None,
                                      "_executor_lock": forksafe.RLock})
    _per_job_classmethod(getattr(module, "_ReusablePoolExecutor", None), "get_reusable_executor", per_job)


def _per_job_joblib_executor_args(module) -> None:
    """joblib's memmapping executor decides reuse on `executor._executor_args`, one per
    process: per job, beside loky's executor (another job's arguments would make a
    job's own executor start afresh at each call)."""
    per_job = _PerJobGlobals(module, {"_executor_args": lambda: None})
    _per_job_classmethod(getattr(module, "MemmappingExecutor", None), "get_memmapping_executor", per_job)


def _share_inductor_address(codecache) -> None:
    import torch

    address = torch._C._dynamo.guards._torchinductor_pyobject_tensor_data_ptr
    isolation.process_environ()["_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR"] = str(address)


_FORK_SAFE_LOCKS = {
    "torch.cuda": "_initialization_lock",
    "torch.xpu": "_initialization_lock",
    "torch.mtia": "_initialization_lock",
    "torch.storage": "_share_memory_lock",
    "torch.utils._pytree": "_NODE_REGISTRY_LOCK",
}


def _fork_safe_lock(module) -> None:
    """A torch lock that another job's thread may hold as a job forks, made free in
    the child (`forksafe`). `torch.manual_seed` takes torch.cuda's (and xpu's, mtia's)
    to queue a seeding, formatting the stack under it, and every DataLoader worker
    seeds at its start: a worker forked meanwhile waited on it for good (the Hugging
    Face Trainer, three jobs with `dataloader_num_workers=2`: one run in three hung).
    Workers share tensors under `_share_memory_lock` and import modules that register
    pytree nodes (transformers' outputs) under `_NODE_REGISTRY_LOCK`."""
    lock = getattr(module, _FORK_SAFE_LOCKS[module.__name__], None)
    if lock is not None:
        forksafe.register(lock)


_PATCHES = {
    **dict.fromkeys(_FORK_SAFE_LOCKS, _fork_safe_lock),
    "matplotlib._pylab_helpers": _patch_pylab_helpers,
    "tqdm.std": _patch_tqdm,
    "rich": _patch_rich,
    "hydra.core.singleton": _patch_hydra_singletons,
    "logging.config": _patch_logging_config,
    "accelerate.state": _patch_accelerate_state,
    "wandb": _patch_wandb,
    "cloudpickle.cloudpickle": _patch_cloudpickle,  # and the copies libraries ship
    "ray.cloudpickle.cloudpickle": _patch_cloudpickle,
    "joblib.externals.cloudpickle.cloudpickle": _patch_cloudpickle,
    "srsly.cloudpickle.cloudpickle": _patch_cloudpickle,
    "joblib.externals.loky.reusable_executor": _per_job_loky_executor,
    "loky.reusable_executor": _per_job_loky_executor,
    "joblib.executor": _per_job_joblib_executor_args,
    "torch.jit": _patch_tracers,
    "torch.autograd.profiler": _patch_profiler,
    "torch.export": _patch_export,
    "torch.compiler": _compiling_per_thread,
    "torch.fx._symbolic_trace": _fx_tracing_per_thread,
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
            _apply(patch, module)

        loader.exec_module = exec_then_patch
        return spec


def _apply(patch: Callable, module) -> None:
    """A patch that does not fit the library's version (a name it lacks) leaves the
    library as it is, saying so: the job's import of it goes on."""
    try:
        patch(module)
    except Exception as exc:  # noqa: BLE001
        print(f"wwrun: warning: {module.__name__} left as it is, shared by every job "
              f"({type(exc).__name__}: {exc})", file=isolation.original_stderr(), flush=True)


def install() -> None:
    """Patch the libraries already imported; patch the others on their first import."""
    for name, patch in _PATCHES.items():
        if name in sys.modules:
            _apply(patch, sys.modules[name])
    if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
