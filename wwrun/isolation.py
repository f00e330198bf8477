"""Per-job views of process-wide state, so that scripts run as threads of one process
each behave as if started alone with `python script.py`.

Python keeps much of what a script sees in process-wide places: `sys.modules['__main__']`,
`sys.argv`, `os.environ`, `sys.stdin/stdout/stderr`, `atexit`, signal handlers, the
working directory. `install()` replaces each with a thread-dispatching view: a thread
that belongs to a job (its main thread, and every thread or forked process it starts)
sees that job's `JobContext`; any other thread sees the original objects, unchanged.

    state              job's view                         how
    -----------------  ---------------------------------  ------------------------------------
    __main__           the job's own module object        `_MainModule` proxy in sys.modules
    sibling modules    private copies (`from model ...`)  `_JobLocalFinder` + `_SharedName` proxies
    sys.argv, sys.path the job's own plain lists          `_PerJobName` on sys's class
    os.environ         launcher env + job env + WWRUN_*   `_PerJobName` on os's class (a
                       (a `JobEnviron`: os._Environ's     `JobEnviron`), `_ThreadEnviron`
                       type, no putenv)                   for os.getenv
    stdin/out/err      the job's pipes (logs, display),   `_PerJobName` + `_ThreadStream`
                       or what the job assigned (a Tee);
                       stdin: the launcher's for a lone   `job_stdin`
                       job or the `stdin: true` one
    working directory  the job's cwd                      unshare(CLONE_FS) per job thread (Linux)
    atexit, signal     per-job handlers, Python's         patched `atexit.register`, `signal.signal`,
                       defaults; alarm() per job          `getsignal`, `alarm`, `setitimer`
    os._exit           ends the job, not the process      patched `os._exit` (launcher process only)
    os.close(0|1|2)    closes the job's stream only       patched `os.close`
    os.kill(own pid)   signals the job only               patched `os.kill`, `signal.raise_signal`
    os.write(1|2),     the job's output, its env and      patched `os.write`, `os.system`
    os.system          folder
    os.exec*           the program replaces the job       patched `os.execv`, `os.execve`
    gc.disable(),      the job's own switch and           patched `gc.disable`... `get_threshold`
    set_threshold      thresholds (the collector runs)
    faulthandler       the run's crash log stays; a       patched `enable`, `disable`,
                       watchdog dumps and ends the job    `dump_traceback_later`...
    logging.getLogger  the job's own for `__main__` and   patched `logging.Manager.getLogger`
    (__name__)         its private modules' names
    logging's root     the job's own handlers (its        `_JobRootLogger` as the root's class
    handlers           basicConfig, dictConfig)
    runpy's __main__   swaps the job's main module        patched `runpy._TempModule`
    child processes    job's env, cwd and output pipes    patched `_posixsubprocess.fork_exec`
    multiprocessing's  per job (`set_start_method` once   `_PerJobStartMethod` on its default
    start method,      in each job, as in a process);     context's class; `forkserver`'s
    forkserver         the job's own forkserver           functions dispatch to the job's
    threads            inherit the job of their starter   patched `threading.Thread.start`;
                       ("Thread-1" is the job's first;    patched `threading._newname`,
                       its main thread is the job's)      `threading.main_thread`
    threading.settrace the job's threads' trace/profile   `_ThreadHook` as threading's hooks,
    /setprofile        functions                          patched `settrace`... `getprofile`
    sys.excepthook,    per job: the script's own prints  `_PerJobName` on sys's and threading's
    threading.excepthook its uncaught errors             classes; `jobthread` calls the former
    first imports      one job at a time (no partially    patched `importlib._bootstrap._find_and_load`
                       initialized module across jobs; a  and `_lock_unlock_module`
                       package that replaced itself in
                       sys.modules is whole to waiters)
    files written      noted per run: two jobs writing    patched `open`, `os.open`, torch.save's
                       one path are named (`WriteWatch`)  zip writer

Assigning one of these names in a job (`sys.argv = [...]`, `os.environ = {...}`,
`sys.stdout = Tee(...)`) rebinds it for that job only. The job's argv and path are
real lists and its environ Python's own mapping type, so `json.dumps(sys.argv)`,
`os.environ | {}`, `vars(os.environ)` and `torch.save({'argv': sys.argv})` behave as
under `python`.

What stays shared (documented for users): C-level `getenv`, torch's global flags
(cuDNN, TF32, matmul precision, default dtype, intra-op threads, deterministic
algorithms), `logging`'s root level, warning filters: `settings_watch` warns
once when jobs set one of them to different values.
"""

from __future__ import annotations

import atexit
import builtins
import collections.abc
import contextlib
import ctypes
import errno
import functools
import gc
import importlib._bootstrap
import importlib.abc
import importlib.machinery
import importlib.util
import io
import itertools
import logging
import os
import select
import signal
import sys
import termios
import threading
import time
import traceback
import types
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from wwrun import forksafe

_local = threading.local()
_LAUNCHER_PID = os.getpid()
_WWRUN_DIR = os.path.dirname(os.path.abspath(__file__))
_CLONE_FS = 0x00000200


def current_job() -> JobContext | None:
    """The job whose thread (or a thread it started) is running, else None."""
    return getattr(_local, "job", None)


class JobExit(BaseException):
    """Raised in a job's thread in place of `os._exit(code)`: ends that job only."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


class KilledBySignal(JobExit):
    """Raised in a job's thread for a signal its script leaves at the default action
    (SIGUSR1, SIGHUP, its own alarm's SIGALRM): it ends that job, with code 128 + the
    signal's number, as the signal would end the script's own process."""

    signum = 0

    def __init__(self):
        super().__init__(128 + self.signum)


_killed_by_types: dict[int, type[KilledBySignal]] = {}


def killed_by(signum: int) -> type[KilledBySignal]:
    """The exception class for `signum` (raised asynchronously: by class, no arguments)."""
    kind = _killed_by_types.get(signum)
    if kind is None:
        kind = _killed_by_types[signum] = type(f"KilledBy{signal.Signals(signum).name}", (KilledBySignal,),
                                               {"signum": signum})
    return kind


class JobEnviron(os._Environ):
    """A job's `os.environ`: Python's own mapping type, so that what code may ask of
    it is there as under `python` (`vars(os.environ)`, its `_data`, `isinstance(...,
    os._Environ)`: Hydra's checks ask all three, and a plain dict failed them). It holds
    the job's variables only: setting one changes neither the process's C
    environment (`putenv`) nor another job's."""

    def __init__(self, variables=()):
        real = _originals.get("os.environ", os.environ)
        codecs = getattr(real, "encodekey", None), getattr(real, "decodekey", None)
        values = getattr(real, "encodevalue", None), getattr(real, "decodevalue", None)
        if None in (*codecs, *values):  # a process whose os.environ is not os's own
            codecs = values = (_fs_encode, os.fsdecode)
        super().__init__({}, *codecs, *values)
        self.update(variables)

    def __setitem__(self, key, value):
        self._data[self.encodekey(key)] = self.encodevalue(value)

    def __delitem__(self, key):
        try:
            del self._data[self.encodekey(key)]
        except KeyError:
            raise KeyError(key) from None


def _fs_encode(value: str) -> bytes:
    if not isinstance(value, str):
        raise TypeError(f"str expected, not {type(value).__name__}")
    return os.fsencode(value)


@dataclass(eq=False)
class JobContext:
    """Everything a running job sees in place of the process's own state."""

    name: str
    argv: list[str]
    environ: JobEnviron
    """Its `os.environ` (made from the mapping it is given)."""
    cwd: str
    local_roots: list[str]
    """Folders whose modules are private to this job (the script's folder)."""
    stdout: io.TextIOBase
    stderr: io.TextIOBase
    stdout_fd: int
    stderr_fd: int
    main: types.ModuleType = field(default_factory=lambda: types.ModuleType("__main__"))
    modules: dict[str, types.ModuleType] = field(default_factory=dict)
    """Private copies of modules found in `local_roots`, by name."""
    imported: set[str] = field(default_factory=set)
    """Those of `modules` the job has imported (not only loaded for a submodule's sake)."""
    stdin: io.TextIOBase = field(default_factory=lambda: open(os.devnull))  # noqa: SIM115
    path: list[str] | None = None
    """The job's `sys.path`; None: the job's folders, then the launcher's path (set at `enter`)."""
    rebound: dict = field(default_factory=dict)
    """What the job assigned to `sys.stdin/stdout/stderr` (a Tee, a file), by name."""
    load_lock: threading.RLock = field(default_factory=forksafe.RLock)
    """Guards `modules` while the job's threads load its private modules."""
    atexit_handlers: list = field(default_factory=list)
    signal_handlers: dict = field(default_factory=dict)
    threads: list = field(default_factory=list)
    """Threads the job started (its non-daemon threads are joined when it ends)."""
    thread_hooks: list = field(default_factory=list)
    """Called with no arguments in each thread the job starts, before its target
    (the launcher binds the thread to the job's memory)."""
    excepthook: Callable = sys.__excepthook__
    thread_excepthook: Callable = threading.__excepthook__
    """The job's `sys.excepthook` and `threading.excepthook`: Python's own until it sets them."""
    thread_numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))
    """The N of its threads' default names, "Thread-N", as in a process of its own."""
    thread_trace: Callable | None = None
    thread_profile: Callable | None = None
    """What the job gave `threading.settrace` / `threading.setprofile`: its threads' hooks."""
    thread_id: int | None = None
    start_method_context: object = None
    """The multiprocessing context its `set_start_method` (or first use) fixed."""
    forkserver: object = None
    """Its own `multiprocessing.forkserver.ForkServer`, once it used one."""
    main_thread: threading.Thread | None = None
    """The job's own thread (`enter`): `threading.main_thread()` in its threads."""
    interrupts_open: bool = True
    """False once the script and its exit are over (`close_interrupts`): an interrupt
    then would land in wwrun's cleanup of the job, not in the job."""
    interrupt_lock: threading.Lock = field(default_factory=forksafe.Lock)
    faulthandler_on: bool = False
    watchdog: "_Watchdog | None" = None
    """Its `faulthandler.dump_traceback_later`, while one is armed."""
    loggers: dict = field(default_factory=dict)
    """Its own `logging.getLogger(__name__)` loggers: `__main__`'s and its modules'."""
    root_handlers: list = field(default_factory=list)
    """The root logger's handlers as the job sees them (`basicConfig`, `dictConfig`)."""
    gc_enabled: bool = True
    gc_threshold: tuple | None = None
    """What its `gc.disable()` / `gc.set_threshold` said (None: the process's thresholds)."""
    alarm: "_Alarm | None" = None
    """Its `signal.alarm` / `setitimer(ITIMER_REAL)` timer, while one is set."""
    traceback: str | None = None
    """The uncaught exception's traceback, once the job failed with one."""
    writes: WriteWatch | None = None
    """The run's record of the files its jobs write (None: not watched)."""

    def __post_init__(self):
        if not isinstance(self.environ, JobEnviron):
            self.environ = JobEnviron(self.environ)


def enter(job: JobContext) -> None:
    """Make the calling thread `job`'s main thread: its state and working directory."""
    job.thread_id = threading.get_ident()
    job.main_thread = threading.current_thread()
    if job.path is None:
        launcher_path = sys.__dict__["path"]
        first = [*job.local_roots, *_own_pythonpath(job, launcher_path)]
        job.path = [*first, *(p for p in launcher_path if p not in first)]
    _local.job = job
    with _install_lock:  # torch is imported by now (the launcher chose the device)
        _watch_settings()
        _watch_torch_save()
    own_working_directory(job.cwd)


def _own_pythonpath(job: JobContext, launcher_path: list[str]) -> list[str]:
    """The folders of the job's PYTHONPATH (a recipe's `env: {PYTHONPATH: ...}`) that the
    launcher's path lacks, as Python puts them: right after the script's folder. Only in
    the job's environment, they were never on its path ("No module named 'mingpt'")."""
    value = job.environ.get("PYTHONPATH", "")
    folders = dict.fromkeys(os.path.abspath(os.path.join(job.cwd, p)) for p in value.split(os.pathsep) if p)
    return [p for p in folders if p not in launcher_path]


def leave() -> None:
    """The calling job thread is done with its job: hand back the job's memory."""
    job = current_job()
    _local.job = None
    if job is not None:
        release(job)


def release(job: JobContext) -> None:
    """Drop what the ended job's code left alive: its `__main__` namespace, its private
    modules, its handlers and rebound streams, so that its tensors are freed as they
    would be when `python script.py` exits. A long sequential sweep then runs in the
    memory of one job, not of all of them.

    Namespaces are emptied (as Python empties modules at exit) unless a thread the job
    started still runs and may need them; then only the references are dropped.
    """
    namespaces = [job.main.__dict__, *(m.__dict__ for m in job.modules.values())]
    job.main = types.ModuleType("__main__")
    job.modules = {}
    if job.forkserver is not None:  # it ends with its job, as with a process at exit
        with contextlib.suppress(Exception):
            job.forkserver._stop()
        job.forkserver = None
    job.atexit_handlers.clear()
    job.signal_handlers.clear()
    job.rebound.clear()
    job.threads[:] = [t for t in job.threads if t.is_alive()]
    if not job.threads:
        # What `logging.shutdown` does at a process's exit: its root handlers flushed
        # and closed (a file handler's file with it).
        for handler in job.root_handlers:
            with contextlib.suppress(Exception):
                handler.flush()
                handler.close()
        job.root_handlers = []
        for namespace in namespaces:
            compiled = _compiled_globals(namespace)
            namespace.clear()
            namespace.update(dict.fromkeys(compiled))  # torch.compile deletes these itself
    del namespaces
    # Script namespaces are reference cycles (a function's __globals__): collect them
    # now, since a few large tensors allocate too few objects to trigger the collector.
    gc.collect()


def _compiled_globals(namespace: dict) -> list[str]:
    """The names torch.compile installed in a module's globals (its compiled and
    resume functions, the builtins it reads): dynamo deletes each itself once the code
    that uses it is collected (`CleanupHook`), and raised KeyError, printed as
    "Exception ignored" on wwrun's stderr, when a job's end had emptied the
    namespace first. Read from dynamo's registry only when dynamo is loaded."""
    registry = getattr(getattr(sys.modules.get("torch._dynamo.utils"), "CleanupManager", None), "instance", None)
    hooks = getattr(registry, "values", None)
    if not isinstance(hooks, dict):
        return []
    return [hook.name for group in list(hooks.values()) for hook in group
            if getattr(hook, "scope", None) is namespace and getattr(hook, "name", None) in namespace]


def find_spec(job: JobContext, name: str):
    """`importlib.util.find_spec` as seen from the job: its own folders first."""
    spec = _find_private_spec(job, name)
    return spec if spec is not None else importlib.util.find_spec(name)


class _TerminalReader(io.RawIOBase):
    """fd 0 when it is a terminal: `before_read()` runs before each read, so that what
    the job wrote before it waits for the user (a prompt: `input("name? ")`, pdb's
    `(Pdb) `) is on the screen when it does. Every read (`read()`, `readline()`, `for
    line in sys.stdin`) comes through `readinto`: RawIOBase makes `read` and `readall`
    of it, where FileIO's own skip it."""

    name = "<stdin>"

    def __init__(self, before_read: Callable[[], None]):
        super().__init__()
        self._before_read = before_read

    def readable(self) -> bool:
        return True

    def fileno(self) -> int:
        return 0

    def isatty(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        self._before_read()
        _wait_readable(0)
        return os.readv(0, [buffer])

    def read_secret(self, prompt: str, stream, encoding: str) -> str:
        """`getpass.getpass` on the terminal, as the standard library's: `prompt` written
        to `stream` or else /dev/tty, then a line read from /dev/tty with echo off,
        polled as every read here."""
        try:
            tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
        except OSError:  # no controlling terminal: it reads stdin (through readinto)
            return _originals["getpass.getpass"](prompt, stream)

        def say(text: str) -> None:
            if stream is None:
                os.write(tty, text.encode(encoding, "replace"))
            else:
                stream.write(text)
                stream.flush()

        try:
            echoing = termios.tcgetattr(tty)
            silent = [*echoing[:3], echoing[3] & ~termios.ECHO, *echoing[4:]]
            termios.tcsetattr(tty, termios.TCSAFLUSH, silent)
            try:
                if stream is None:  # the screen first given to plain lines, then the prompt
                    self._before_read()
                    say(prompt)
                else:  # the prompt in the job's output, which the hook then shows
                    say(prompt)
                    self._before_read()
                line = b""
                while not line.endswith(b"\n"):
                    _wait_readable(tty)
                    chunk = os.read(tty, 4096)
                    if not chunk:  # Ctrl-D
                        break
                    line += chunk
                if not line:
                    raise EOFError
            finally:
                termios.tcsetattr(tty, termios.TCSAFLUSH, echoing)
            say("\n")
        finally:
            os.close(tty)
        return line.decode(encoding, "replace").removesuffix("\n")


def _wait_readable(fd: int) -> None:
    """Polled, not one blocking read: a Ctrl-C reaches a job as an exception raised in
    its thread, which a read blocked in C would hold back until the user's Enter; under
    `python` it ends the wait at once."""
    while not select.select([fd], [], [], 0.25)[0]:
        pass


def job_stdin(reads_launcher_stdin: bool, before_terminal_read: Callable[[], None] | None = None) -> io.TextIOBase:
    """A job's standard input: the launcher's own (a lone job, or the one job of a
    recipe with `stdin: true`), else end of file as from /dev/null.

    A new reader over fd 0 that never closes it: the job may close its sys.stdin, and
    the launcher closes the job's copy when it ends. When fd 0 is a terminal,
    `before_terminal_read` runs before each read of it.
    """
    if reads_launcher_stdin:
        original = _originals.get("stdin", sys.__stdin__)
        try:
            if before_terminal_read is not None and os.isatty(0):
                raw = _TerminalReader(before_terminal_read)
            else:
                raw = io.FileIO(0, "r", closefd=False)
                raw.name = "<stdin>"  # as Python names its own
        except OSError:  # no fd 0 (started with stdin closed)
            pass
        else:
            return io.TextIOWrapper(
                io.BufferedReader(raw),
                encoding=getattr(original, "encoding", None) or "utf-8",
                errors=getattr(original, "errors", None) or "strict",
            )
    return open(os.devnull)  # noqa: SIM115 - the launcher closes it when the job ends


def _getpass(prompt: str = "Password: ", stream=None, **kwargs) -> str:
    """`getpass.getpass` in a job: the terminal is the job's that reads wwrun's standard
    input there (as `input()` is), and it waits as its `input()` does, its prompt shown
    and a Ctrl-C ending the wait; a job reading end of file has no terminal, and gets
    what a script without one gets (a warning, then EOFError)."""
    import getpass

    job = current_job()
    reader = getattr(getattr(getattr(job, "stdin", None), "buffer", None), "raw", None)
    if isinstance(reader, _TerminalReader):
        return reader.read_secret(prompt, stream, job.stdin.encoding)
    if job is not None and getattr(reader, "name", None) == os.devnull:
        return getpass.fallback_getpass(prompt, stream)
    return _originals["getpass.getpass"](prompt, stream, **kwargs)


def process_environ():
    """The process's real environment (what jobs start from)."""
    return _originals.get("os.environ", os.environ)


def own_working_directory(path: str) -> None:
    """Give the calling thread its own working directory, then move it to `path`.

    Linux's unshare(CLONE_FS) detaches the thread's filesystem context (cwd, umask)
    from the rest of the process; threads it starts afterwards share it, and C-level
    opens (`torch.save("x.pt")`) follow it. Elsewhere a job may only use the
    launcher's own directory: say so rather than misplace files.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.unshare(_CLONE_FS) != 0
    except (OSError, AttributeError):
        failed = True
    if failed:
        if os.path.realpath(path) != os.path.realpath(os.getcwd()):
            raise OSError(
                "per-job working directories need Linux unshare(CLONE_FS); "
                f"this system cannot run a job in {path!r}"
            )
        return
    os.chdir(path)


def run_atexit_handlers(job: JobContext) -> None:
    """Run the job's atexit handlers, last registered first, as Python does at exit."""
    while job.atexit_handlers:
        func, args, kwargs = job.atexit_handlers.pop()
        try:
            func(*args, **kwargs)
        except SystemExit:
            pass
        except BaseException:  # noqa: BLE001 - reported like Python's own atexit
            import traceback

            print("Exception ignored in atexit callback", func, file=sys.stderr)
            traceback.print_exc(file=sys.stderr)


def deliver_signal(job: JobContext, signum: int) -> None:
    """Do to the job what `signum` would do to the script run alone.

    Its own handler, if it set one, runs here (Python runs handlers in the main
    thread, which for a script alone is its own), under the job's identity; an
    exception the handler raises is raised in the job's thread. Ignored signals are
    ignored; otherwise the job gets KeyboardInterrupt.
    """
    handler = job.signal_handlers.get(signum, _python_default(signum))
    if handler == signal.SIG_IGN or not job.interrupts_open:
        return
    if not callable(handler) and signum not in (signal.SIGINT, signal.SIGTERM):
        interrupt(job.thread_id, killed_by(signum), job)  # the default action: the script's end
        return
    if not callable(handler) or handler is signal.default_int_handler:
        interrupt(job.thread_id, KeyboardInterrupt, job)
        return
    previous, _local.job = current_job(), job
    try:
        handler(int(signum), sys._current_frames().get(job.thread_id))  # as Python calls it: the int, the job's frame
    except BaseException as exc:  # noqa: BLE001 - handed on to the job
        interrupt(job.thread_id, _as_raisable(exc), job)
    finally:
        _local.job = previous


def _as_raisable(exc: BaseException) -> type[BaseException]:
    """A class of `exc`'s name whose instances, made with no arguments as Python makes
    an asynchronous exception, are `exc` again (its message: "step took too long", not
    a bare TimeoutError); `exc`'s own class where it cannot be subclassed."""
    kind, args = type(exc), exc.args
    try:
        return type(kind.__name__, (kind,), {"__init__": lambda self: kind.__init__(self, *args),
                                             "__module__": kind.__module__, "__qualname__": kind.__qualname__})
    except TypeError:
        return kind


def interrupt(thread_id: int, exc: type[BaseException] = KeyboardInterrupt, job: JobContext | None = None) -> bool:
    """Raise `exc` asynchronously in the thread, at its next Python bytecode outside
    an import or logging, and not while it starts a thread (see `_in_lock_code`);
    with `job`, only while its interrupts are open (`close_interrupts`).

    There it would wait: importlib's module locks and logging's locks are taken and
    let go by Python code, and an exception landing between the two leaves the lock
    held by a thread that is gone, so the next import of that module (`torch._dynamo`,
    on a job's first optimizer) or the next log call (torch's, at exit) waits forever.
    Raised before such code's first bytecode, it holds nothing. A thread still inside
    after `_IMPORT_WAIT_S` gets it anyway.
    """
    done = _interrupt_outside_locks(thread_id, exc, job)
    if done is None:
        threading.Thread(target=_interrupt_when_out, args=(thread_id, exc, job),
                         name="wwrun-interrupt", daemon=True).start()
    return done is not False


def close_interrupts(job: JobContext) -> None:
    """The job's script and its exit are over: no interrupt reaches its thread from
    now on, and one set but not yet raised is dropped (it would land in wwrun's
    cleanup: a finalizer's "Exception ignored", or the thread ending unreported)."""
    with job.interrupt_lock:
        job.interrupts_open = False
        if job.alarm is not None:  # an alarm left set ends with its job, as with its process
            _set_alarm(job, 0.0)
        if job.watchdog is not None:  # so does a faulthandler watchdog
            job.watchdog.cancel()
            job.watchdog = None
        if job.thread_id is not None:
            _drop_async_exc(job.thread_id)


def _interrupt_outside_locks(thread_id: int, exc, job: JobContext | None = None, force: bool = False) -> bool | None:
    """True once set; False if there is no such thread, or the job's interrupts are
    closed; None (nothing set) while it runs lock-taking code (unless `force`)."""
    with job.interrupt_lock if job is not None else contextlib.nullcontext():
        if job is not None and not job.interrupts_open:
            return False
        if not force and _in_lock_code(thread_id):
            return None
        if _set_async_exc(thread_id, exc) == 0:
            return False
        if not force and _in_lock_code(thread_id):  # it got there between the look and the set: take it back
            _drop_async_exc(thread_id)
            return None
        return True


def _set_async_exc(thread_id: int, exc) -> int:
    """Python's asynchronous exception for the thread (None: drop a pending one); the
    number of threads it found."""
    return ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), None if exc is None else ctypes.py_object(exc))


class _Dropped(BaseException):
    """Raised in a thread by itself only, to lower Python's flag (`_lower_async_flag`)."""


def _drop_async_exc(thread_id: int) -> None:
    """Drop the thread's pending asynchronous exception, if any."""
    _set_async_exc(thread_id, None)
    me = threading.get_ident()
    if me == thread_id or current_job() is None:  # not a job's thread: it has none of its own to lose
        _lower_async_flag()


# Before 3.12 Python keeps one interpreter-wide "an asynchronous exception is
# pending" flag, raised by every `PyThreadState_SetAsyncExc` (dropping one too) and
# lowered only by a thread that raises one, though each thread looks for its own at
# every switch of the GIL. Left up, a thread that sets a trace function (a debugger,
# coverage, `_raise_at_next_line` below) spins at its next call until it comes down:
# for good after a drop, and while another job waits in C with its Ctrl-C pending,
# perhaps for the lock the spinning thread holds. (From 3.12 any thread lowers it.)
_FLAG_STAYS_UP = sys.version_info < (3, 12)


def _lower_async_flag() -> None:
    """Lower Python's flag: the calling thread raises one in itself and catches it
    (replacing its own pending one, if any)."""
    if not _FLAG_STAYS_UP:
        return
    try:
        _set_async_exc(threading.get_ident(), _Dropped)
        _raised_here()
    except _Dropped:
        pass


def _raised_here() -> None:
    """A Python call: the eval loop looks for pending work as it enters one."""


def _interrupt_when_out(thread_id: int, exc, job: JobContext | None) -> None:
    deadline = time.monotonic() + _IMPORT_WAIT_S
    while _interrupt_outside_locks(thread_id, exc, job) is None:
        if time.monotonic() > deadline:
            _interrupt_outside_locks(thread_id, exc, job, force=True)
            return
        time.sleep(0.02)


def in_shared_lock() -> bool:
    """Whether the calling thread runs code that holds a lock every job takes (an
    import, logging, tqdm, `Thread.start`: `_in_lock_code`): it must not wait there
    for the other jobs."""
    return _in_lock_code(threading.get_ident())


def _in_lock_code(thread_id: int) -> bool:
    """The thread runs an import (importlib's code, or wwrun's first-import lock),
    logging's code, or `Thread.start`: until the new thread runs, its state carries
    its starter's id and, the newest, is the one Python sets the exception in; the
    new thread dies before it says it started, and the starter (a DataLoader, tqdm's
    monitor) waits for that forever, in a lock no exception reaches."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        code = frame.f_code
        if code.co_filename.startswith("<frozen importlib") or code.co_filename == _LOGGING_FILE \
                or (code.co_filename.endswith(_TQDM_FILE) and code.co_name not in _TQDM_LOCK_FREE) \
                or code in _IMPORT_CODES \
                or (code.co_name == "start" and code.co_filename == _THREADING_FILE):
            return True
        frame = frame.f_back
    return False


_THREADING_FILE = threading.__file__
# Libraries whose process-wide locks are taken and let go in Python code: logging's,
# and tqdm's (taken for every bar of every job; an interrupted job left it held).
_LOGGING_FILE = logging.__file__
_TQDM_FILE = os.path.join(os.sep + "tqdm", "std.py")
# A bar's iteration holds no lock while the loop it wraps runs (a whole epoch of a
# DataLoader): an interrupt waiting for it to end came after the workers had died of
# the same Ctrl-C. What it calls that takes the lock (update, close) is its own frame.
_TQDM_LOCK_FREE = frozenset({"__iter__"})


# An asynchronous exception can land in a finalizer (`__del__`, a weakref callback)
# that happens to run in the job's thread, often the engine's bookkeeping of a freed
# activation; Python then reports it as "Exception ignored in ..." and drops it, and
# the job trains on past its Ctrl-C. The hook raises it again in the job's own code:
# not asynchronously (it would land in the next finalizer just as well) but at the
# next line of the frame that was running when the finalizer was called, through that
# frame's trace function (Python's debugger mechanism), which no finalizer shares.
_REDELIVERED = (KeyboardInterrupt, SystemExit)


def _unraisable_hook(unraisable) -> None:
    exc_type = unraisable.exc_type
    if current_job() is not None and exc_type is not None and issubclass(exc_type, _REDELIVERED):
        _raise_at_next_line(sys._getframe(1), exc_type)
        return
    _originals["unraisablehook"](unraisable)


def _raise_at_next_line(frame, exc_type: type[BaseException]) -> None:
    previous = sys.gettrace()

    def other_frames(f, event, arg):  # new frames (finalizers among them) are not ours to stop
        return previous(f, event, arg) if previous is not None else None

    def stop_here(f, event, arg):
        sys.settrace(previous)
        f.f_trace = None
        if event == "return" and f.f_back is not None:  # it ends first: stop its caller instead
            _raise_at_next_line(f.f_back, exc_type)
            return None
        raise exc_type

    frame.f_trace = stop_here
    frame.f_trace_lines = True
    _lower_async_flag()  # the other jobs' Ctrl-Cs, still pending, would keep the trace from running
    sys.settrace(other_frames)


# ---------------------------------------------------------------------------------
# Thread-dispatching views


class _MainModule(types.ModuleType):
    """`sys.modules['__main__']`: the current job's main module, else the launcher's.

    Classes defined in a script have `__module__ == '__main__'`; pickle (DataLoader
    workers, torch.save) looks them up here and so finds the right job's class.
    """

    def __init__(self, original: types.ModuleType):
        super().__init__("__main__")
        object.__setattr__(self, "_wwrun_original", original)

    def _wwrun_target(self):
        job = current_job()
        return job.main if job else object.__getattribute__(self, "_wwrun_original")

    def __getattribute__(self, name):
        if name in ("_wwrun_target", "_wwrun_original", "__class__"):
            return object.__getattribute__(self, name)
        return getattr(self._wwrun_target(), name)

    def __setattr__(self, name, value):
        setattr(self._wwrun_target(), name, value)

    def __delattr__(self, name):
        delattr(self._wwrun_target(), name)

    def __dir__(self):
        return dir(self._wwrun_target())

    def __repr__(self):
        return repr(self._wwrun_target())


class _ThreadEnviron(collections.abc.MutableMapping):
    """`os.environ`: the current job's environment, else the process's real one.

    A job's changes stay in its own dict: they reach its child processes (see
    `_fork_exec`), not C-level `getenv` or other jobs.
    """

    def _target(self):
        job = current_job()
        return job.environ if job else _originals["os.environ"]

    def __getitem__(self, key):
        return self._target()[key]

    def __setitem__(self, key, value):
        if not isinstance(key, str) or not isinstance(value, str):
            raise TypeError(f"str expected, not {type(key if not isinstance(key, str) else value).__name__}")
        self._target()[key] = value

    def __delitem__(self, key):
        del self._target()[key]

    def __iter__(self):
        return iter(list(self._target()))

    def __len__(self):
        return len(self._target())

    def copy(self):
        return dict(self._target())

    def __repr__(self):
        return f"environ({dict(self._target())!r})"


class _ThreadStream(io.TextIOBase):
    """`sys.stdin/stdout/stderr` as C code sees them (`print`, `input`, tracebacks) and
    as objects that kept a reference see them: the current job's stream, else the
    original.

    A job that rebound the name (`sys.stdout = Tee(sys.stdout)`) gets its object here;
    when that object writes into the view it wrapped, the write goes on to the job's
    own stream (a per-thread re-entry flag), not round again.
    """

    def __init__(self, which: str, original=None):
        self._which = which  # (the launcher's stream lives in `_originals`)

    def _target(self):
        job = current_job()
        if job is None:
            return _originals[self._which]
        rebound = job.rebound.get(self._which)
        if rebound is None or self._which in _inside_rebound():
            return getattr(job, self._which)
        return rebound

    def _call(self, method: str, *args):
        job = current_job()
        if job is None:
            return getattr(_originals[self._which], method)(*args)
        rebound, inside = job.rebound.get(self._which), _inside_rebound()
        if rebound is None or self._which in inside:
            return getattr(getattr(job, self._which), method)(*args)
        inside.add(self._which)
        try:
            return getattr(rebound, method)(*args)
        finally:
            inside.discard(self._which)

    def write(self, text):
        return self._call("write", text)

    def writelines(self, lines):
        return self._call("writelines", lines)

    def flush(self):
        return self._call("flush")

    def read(self, *args):
        return self._call("read", *args)

    def readline(self, *args):
        return self._call("readline", *args)

    def readlines(self, *args):
        return self._call("readlines", *args)

    def __iter__(self):
        return iter(self._target())

    def fileno(self):
        return self._call("fileno")

    def isatty(self):
        return self._call("isatty")

    def readable(self):
        return self._call("readable")

    def writable(self):
        return self._call("writable")

    def close(self):  # `exit()` closes sys.stdin: only the job's copy
        job = current_job()
        if job:
            self._call("close")

    def __del__(self):
        # IOBase's finalizer calls close(): a view replaced by a newer one (install()
        # re-wraps) and collected in a job's thread closed that job's stream.
        pass

    @property
    def closed(self):
        return self._target().closed

    @property
    def encoding(self):
        return self._target().encoding

    @property
    def errors(self):
        return self._target().errors

    @property
    def buffer(self):
        return self._target().buffer

    def __getattr__(self, name):
        return getattr(self._target(), name)


def _inside_rebound() -> set:
    inside = getattr(_local, "inside_rebound", None)
    if inside is None:
        inside = _local.inside_rebound = set()
    return inside


# ---------------------------------------------------------------------------------
# Per-job names of the `sys` and `os` modules


class _PerJobName:
    """A name of `sys` or `os` that each job reads and rebinds on its own.

    A data descriptor on the module's class: Python code's `sys.argv`, `sys.argv =
    [...]`, `from os import environ` reach it; the module's dict keeps what C code and
    the module's own functions read (`print` finds the `_ThreadStream`, `os.getenv` the
    `_ThreadEnviron`). In a job the value is the job's own object (a real list, or
    a `JobEnviron`: `json.dumps`, pickle and `torch.save` see nothing of wwrun's);
    elsewhere it is the launcher's, unchanged.
    """

    def __init__(self, module: types.ModuleType, field: str, launcher_key: str | None = None):
        self.module = module
        self.field = field
        self.launcher_key = launcher_key
        """Key in `_originals` of the launcher's value, when the module's dict holds a view."""

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        if module is not self.module:  # another module made by `type(sys)(name)`
            try:
                return module.__dict__[self.name]
            except KeyError:
                raise AttributeError(self.name) from None
        job = current_job()
        if job is None:
            if self.launcher_key is not None:
                return _originals[self.launcher_key]
            return module.__dict__[self.name]
        if self.field in _STREAMS:
            rebound = job.rebound.get(self.field)
            return module.__dict__[self.name] if rebound is None else rebound
        return getattr(job, self.field)

    def __set__(self, module, value):
        job = current_job()
        if module is not self.module:
            module.__dict__[self.name] = value
        elif job is None:
            if self.launcher_key is None:
                module.__dict__[self.name] = value
            elif value is not module.__dict__[self.name]:  # (restoring the view itself)
                _originals[self.launcher_key] = value
        elif self.field in _STREAMS:
            if value is module.__dict__[self.name]:
                job.rebound.pop(self.field, None)
            else:
                job.rebound[self.field] = value
        else:
            setattr(job, self.field, value)

    def __delete__(self, module):
        if module is not self.module:
            try:
                del module.__dict__[self.name]
                return
            except KeyError:
                raise AttributeError(self.name) from None
        raise AttributeError(f"wwrun keeps {self.name!r} per job: it cannot be deleted")


_STREAMS = ("stdin", "stdout", "stderr")


class _StartStream:
    """`sys.__stdin__`, `sys.__stdout__`, `sys.__stderr__`: in a job, the streams it
    started with (its log's pipes), as a script's own are: `sys.stdout =
    sys.__stdout__`, the usual restore after a redirect, sent the rest of the job's
    output to wwrun's console, untagged and in no log."""

    def __init__(self, field: str):
        self.field = field

    def __set_name__(self, owner, name):
        self.name = name

    def __get__(self, module, owner=None):
        if module is None:
            return self
        job = current_job()
        return module.__dict__[self.name] if job is None or module is not sys else getattr(job, self.field)

    def __set__(self, module, value):
        module.__dict__[self.name] = value


class _SysModule(types.ModuleType):
    __stdin__ = _StartStream("stdin")
    __stdout__ = _StartStream("stdout")
    __stderr__ = _StartStream("stderr")
    argv = _PerJobName(sys, "argv")
    path = _PerJobName(sys, "path")
    stdin = _PerJobName(sys, "stdin", "stdin")
    stdout = _PerJobName(sys, "stdout", "stdout")
    stderr = _PerJobName(sys, "stderr", "stderr")
    excepthook = _PerJobName(sys, "excepthook")


class _OsModule(types.ModuleType):
    environ = _PerJobName(os, "environ", "os.environ")


class _ThreadingModule(types.ModuleType):
    excepthook = _PerJobName(threading, "thread_excepthook", "threading.excepthook")


def _thread_excepthook(args) -> None:
    """threading's `excepthook` as its threads call it (the module's own global): the
    one the raising thread's job set, else the launcher's."""
    threading.excepthook(args)


# ---------------------------------------------------------------------------------
# Private sibling modules


class _SharedName(types.ModuleType):
    """`sys.modules[name]` for a module found in a job's own folder: each job sees its
    own copy, loaded at its first use, so two scripts that each `from model import Net`
    get their own `model`. A thread of no job, or of a job without such a module, sees
    an empty module (AttributeError), as introspection over `sys.modules` expects."""

    def _wwrun_target(self):
        job = current_job()
        if job is None:
            return None
        name = object.__getattribute__(self, "__name__")
        return job.modules.get(name) or _load_private(job, name)

    def __getattribute__(self, name):
        if name in ("_wwrun_target", "__class__"):
            return object.__getattribute__(self, name)
        target = self._wwrun_target()
        if target is None:
            if name.startswith("__") and name.endswith("__"):
                return object.__getattribute__(self, name)
            module = object.__getattribute__(self, "__name__")
            raise AttributeError(f"module {module!r} is private to the jobs whose folder holds it")
        try:
            return getattr(target, name)
        except AttributeError:
            # `import pkg.sub` by a second job: the first registered the submodule in
            # sys.modules; this job's copy is bound at first access.
            sub = sys.modules.get(f"{target.__name__}.{name}")
            if isinstance(sub, _SharedName):
                return sub
            raise

    def __setattr__(self, name, value):
        # The import machinery stamps __spec__, __loader__... on what create_module
        # returned: keep those on the proxy, the private copies have their own.
        if name in _IMPORT_ATTRS:
            object.__setattr__(self, name, value)
        else:
            setattr(self._wwrun_target(), name, value)

    def __delattr__(self, name):
        delattr(self._wwrun_target(), name)

    def __dir__(self):
        target = self._wwrun_target()
        return dir(target) if target is not None else []


_IMPORT_ATTRS = frozenset(
    {"__name__", "__spec__", "__loader__", "__package__", "__path__", "__file__", "__cached__"}
)


def _find_private_spec(job: JobContext, name: str):
    """The spec of `name` if it lives in the job's own folders (its script's, or one
    it added to its `sys.path`) or in one of its private packages, else None."""
    parent, _, _ = name.rpartition(".")
    if not parent:
        spec = importlib.machinery.PathFinder.find_spec(name, job.local_roots)
        if spec is not None and spec.loader is None and _found_elsewhere(job, name):
            spec = None
        return spec or _in_added_folder(job, name)
    package = job.modules.get(parent) or _load_private(job, parent)
    search = getattr(package, "__path__", None)
    return importlib.machinery.PathFinder.find_spec(name, list(search)) if search else None


def _found_elsewhere(job: JobContext, name: str) -> bool:
    """Whether `name`, a folder of the job's without `__init__.py` (a namespace portion:
    a `wandb/` run folder, a `datasets/` of data files), is found outside the job's own
    folders too. Under `python` a module or regular package further along the path wins
    over such a folder (the installed `wandb` is imported whatever sits beside the
    script), and namespace portions elsewhere join it in one shared package."""
    own = {os.path.realpath(root) for root in job.local_roots}
    elsewhere = [entry for entry in (job.path or sys.path) if os.path.realpath(entry or ".") not in own]
    return importlib.machinery.PathFinder.find_spec(name, elsewhere) is not None


def _in_added_folder(job: JobContext, name: str):
    """The spec of `name` where the job's `sys.path` finds it first, when that is a
    folder the job added (`sys.path.insert(0, "lib")`, `sys.path.append("../..")`),
    not one of the launcher's: a second job's `import models` from its own `lib/`
    got the first job's module of that name, which was then in `sys.modules`.
    Extension modules stay shared (a library loads once per process)."""
    launcher = set(sys.__dict__["path"])
    for entry in job.path or ():
        spec = importlib.machinery.PathFinder.find_spec(name, [entry])
        if spec is None:
            continue
        if entry in launcher or spec.origin is None or not spec.origin.endswith(".py"):
            return None  # where the launcher finds it too, a namespace package, or an extension module
        return spec
    return None


def _load_private(job: JobContext, name: str):
    """Load the job's own copy of `name`, or None if its folders hold no such module."""
    with job.load_lock:
        if name in job.modules:
            return job.modules[name]
        spec = _find_private_spec(job, name)
        if spec is None or (spec.loader is None and spec.submodule_search_locations is None):
            return None  # (a folder without __init__.py, a namespace package, loads as one)
        module = importlib.util.module_from_spec(spec)
        job.modules[name] = module  # before exec: circular imports find it
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del job.modules[name]
            raise
        parent, _, child = name.rpartition(".")
        if parent in job.modules:
            setattr(job.modules[parent], child, sys.modules.get(name, module))
        return module


class _JobLocalFinder(importlib.abc.MetaPathFinder):
    """First on `sys.meta_path`: a module in the importing job's own folders becomes a
    `_SharedName` in `sys.modules` with the job's private copy behind it."""

    def find_spec(self, fullname, path=None, target=None):
        job = current_job()
        if job is None:
            return None
        spec = _find_private_spec(job, fullname)
        if spec is None:
            return None
        return importlib.machinery.ModuleSpec(
            fullname,
            _JobLocalLoader(),
            origin=spec.origin,
            is_package=spec.submodule_search_locations is not None,
        )


class _JobLocalLoader(importlib.abc.Loader):
    def create_module(self, spec):
        # An import: the job's copy loads at most once, maybe already as the import
        # sets the shared name's attributes. `importlib.reload` calls exec_module alone.
        _importing().add(spec.name)
        job = current_job()
        if job is not None and spec.name in job.imported:
            # Imported before, and gone from sys.modules since (`del sys.modules[name]`):
            # under `python` the import runs its code afresh, in a new module.
            with job.load_lock:
                job.imported.discard(spec.name)
                job.modules.pop(spec.name, None)
        existing = sys.modules.get(spec.name)
        return existing if isinstance(existing, _SharedName) else _SharedName(spec.name)

    def exec_module(self, module):
        name = object.__getattribute__(module, "__name__")
        job = current_job()
        imported = name in _importing()
        _importing().discard(name)
        if job is not None and not imported and name in job.modules:
            _run_private_again(job, name)
        elif job is None or _load_private(job, name) is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        else:
            job.imported.add(name)


def _importing() -> set:
    """The job modules this thread is importing (not reloading)."""
    names = getattr(_local, "importing", None)
    if names is None:
        names = _local.importing = set()
    return names


def _run_private_again(job: JobContext, name: str) -> None:
    """`importlib.reload` of a module of the job's: its code runs again in its
    namespace, as under `python`. The job's copy was returned as it was, and a reload
    (or an import after `del sys.modules[name]`) changed nothing."""
    with job.load_lock:
        spec = _find_private_spec(job, name)
        if spec is None or spec.loader is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        spec.loader.exec_module(job.modules[name])


# ---------------------------------------------------------------------------------
# Patches of process-wide functions


def _atexit_register(func, *args, **kwargs):
    """Handlers registered by a job's own code run when that job ends; those registered
    by libraries it imports stay process-wide (e.g. logging's shutdown), and those a
    library registers from a job's thread also run at the run's end
    (`run_library_exit_handlers`)."""
    job = current_job()
    if job is not None and _called_from_job_code(job):
        job.atexit_handlers.append((func, args, kwargs))
        return func
    if job is not None:
        with _library_exit_lock:
            _library_exit_handlers.append((func, args, kwargs))
    return _originals["atexit.register"](func, *args, **kwargs)


def _atexit_unregister(func):
    job = current_job()
    if job is not None:
        job.atexit_handlers[:] = [h for h in job.atexit_handlers if h[0] != func]
    with _library_exit_lock:
        _library_exit_handlers[:] = [h for h in _library_exit_handlers if h[0] != func]
    _originals["atexit.unregister"](func)


def _threading_register_atexit(func, *args, **kwargs):
    """`threading._register_atexit`: the hooks Python calls at exit before it joins the
    non-daemon threads, with which libraries stop theirs (joblib's loky executor).
    Those a library registers from a job's thread also run at the run's end, first
    (`run_library_exit_handlers`): ended before them, loky's processes left "resource
    tracker: process died unexpectedly" and tracebacks after the summary.
    concurrent.futures' own is left to each job's end (`jobthread._shut_down_executors`):
    run, it would stop the process's executors for good."""
    with _library_exit_lock:  # every registration passes here: the entry it adds is the last
        _originals["threading._register_atexit"](func, *args, **kwargs)
        call = threading._threading_atexits[-1]  # a partial, or from Python 3.13 a lambda
        job = current_job()
        if (job is None or _called_from_job_code(job)
                or getattr(func, "__module__", "").startswith("concurrent.futures")):
            return
        _library_thread_exit_hooks.append((call, func))
        _stopped_at_exit_modules.add(getattr(func, "__module__", None))


def stopped_at_exit(thread: threading.Thread) -> bool:
    """`thread` is a library's that its `threading._register_atexit` hook stops at the
    process's exit (its class or target is of the hook's module): joblib's loky
    executor manager. A job's end does not wait for it (it waited for good, where
    `python` ends at once): it shuts the job's executor down (`jobthread.
    _shut_down_executors`) and the manager winds down on its own; the hook runs at the
    run's end."""
    target = getattr(thread, "_target", None)
    return (type(thread).__module__ in _stopped_at_exit_modules
            or getattr(target, "__module__", None) in _stopped_at_exit_modules)


_library_thread_exit_hooks: list = []
"""(entry in `threading._threading_atexits`, function) of the `threading._register_atexit`
calls libraries made from job threads."""
_stopped_at_exit_modules: set = set()
"""The modules of those hooks (kept: a library registers its hook once a process)."""
_library_exit_handlers: list = []
"""(func, args, kwargs) that libraries registered with atexit from the jobs' threads."""
_library_exit_lock = forksafe.Lock()
LIBRARY_EXIT_WAIT_S = 30.0
"""How long a run's end waits for the libraries' exit handlers (a service's teardown)."""


def run_library_exit_handlers(note: Callable[[str], None], wait_s: float = LIBRARY_EXIT_WAIT_S) -> None:
    """At a run's end, before the jobs' leftover processes are ended: the atexit handlers
    libraries registered from the jobs' threads, last first, once (taken off Python's
    list), as each job's process would run them at its exit.

    A library's service process is one of those leftovers: wandb's, whose teardown at
    exit finishes the runs a script left open. Ended first, its teardown at the
    launcher's exit met a closed connection, and a run without `wandb.finish()` lost
    its data. Bounded: a handler still running after `wait_s` is left to finish on its
    own, and the run's end goes on."""
    with _library_exit_lock:
        handlers = _library_exit_handlers[::-1]
        hooks, _library_thread_exit_hooks[:] = _library_thread_exit_hooks[::-1], []
    if not handlers and not hooks:
        return

    def run_all():
        for call, func in hooks:  # as at exit: before the threads are joined, and atexit's
            try:
                threading._threading_atexits.remove(call)  # once
            except ValueError:
                continue
            try:
                call()
            except BaseException:  # noqa: BLE001 - reported as Python reports it at exit
                print(f"Exception ignored in threading exit hook: {func!r}", file=sys.__stderr__)
                traceback.print_exc(file=sys.__stderr__)
        for handler in handlers:
            # Each still registered when its turn comes: a handler that unregisters
            # another (a telemetry provider's shutdown, called by a library's own
            # teardown) keeps it from running, as at a process's exit.
            with _library_exit_lock:
                if not any(h is handler for h in _library_exit_handlers):
                    continue
                _library_exit_handlers[:] = [h for h in _library_exit_handlers if h is not handler]
            func, args, kwargs = handler
            _originals["atexit.unregister"](func)
            try:
                func(*args, **kwargs)
            except BaseException:  # noqa: BLE001 - reported as Python reports it at exit
                print(f"Exception ignored in atexit callback: {func!r}", file=sys.__stderr__)
                traceback.print_exc(file=sys.__stderr__)

    runner = threading.Thread(target=run_all, name="wwrun-library-exit", daemon=True)
    runner.start()
    runner.join(wait_s)
    if runner.is_alive():
        note(f"libraries' exit handlers still run after {wait_s:.0f} s: going on without them")


def _called_from_job_code(job: JobContext) -> bool:
    caller = sys._getframe(2).f_globals
    if caller is job.main.__dict__:
        return True
    return any(caller is module.__dict__ for module in job.modules.values())


_IGNORED_AT_START = frozenset(
    sig for sig in (getattr(signal, name, None) for name in ("SIGHUP", "SIGUSR1", "SIGUSR2"))
    if sig is not None and signal.getsignal(sig) is signal.SIG_IGN)
"""Relayed signals this process was started with ignored (`nohup`'s SIGHUP): a `python`
process keeps them ignored. (An ignored Ctrl-C or SIGTERM gets no handler of the run's,
`host.handle_interrupts`; a scale-out engine ignores Ctrl-C itself, and relays the
driver's to its jobs.)"""


def _python_default(signalnum) -> object:
    """A signal's handler in a fresh `python` process: what a job has until it sets one
    (not the launcher's, which a handler chaining to it called: every job stopped)."""
    if signalnum in _IGNORED_AT_START:
        return signal.SIG_IGN
    if signalnum == signal.SIGINT:
        return signal.default_int_handler
    if signalnum in (getattr(signal, "SIGPIPE", None), getattr(signal, "SIGXFSZ", None)):
        return signal.SIG_IGN
    return signal.SIG_DFL


def _signal_signal(signalnum, handler):
    """From a job's thread, remember the handler for that job instead of raising
    ValueError ('signal only works in main thread'); the launcher owns real signals
    and hands each to every job (`deliver_signal`)."""
    job = current_job()
    if job is None:
        return _originals["signal.signal"](signalnum, handler)
    previous = job.signal_handlers.get(signalnum, _python_default(signalnum))
    job.signal_handlers[signalnum] = handler
    return previous


def _signal_getsignal(signalnum):
    job = current_job()
    if job is None:
        return _originals["signal.getsignal"](signalnum)
    return job.signal_handlers.get(signalnum, _python_default(signalnum))


def _start_timer(seconds: float, function, name: str) -> threading.Timer:
    """A daemon timer of wwrun's, not a thread of the job whose thread starts it."""
    timer = threading.Timer(seconds, function)
    timer.daemon, timer.name = True, name
    previous, _local.job = current_job(), None
    try:
        timer.start()
    finally:
        _local.job = previous
    return timer


class _Alarm:
    """A job's `signal.alarm` / `setitimer(ITIMER_REAL)`: the process has one such
    timer, and the SIGALRM it sends reached every job (a job without a handler for it
    ended the whole process, as did an alarm left set by a job already over). Each job
    has its own, and its SIGALRM goes to that job alone."""

    def __init__(self, job: JobContext, seconds: float, interval: float):
        self.job, self.interval = job, interval
        self.due = time.monotonic() + seconds
        self._timer: threading.Timer | None = None
        self._arm(seconds)

    def _arm(self, seconds: float) -> None:
        self._timer = _start_timer(seconds, self._fire, "wwrun-alarm")

    def _fire(self) -> None:
        if self.job.alarm is not self:
            return
        if self.interval > 0:
            self.due = time.monotonic() + self.interval
            self._arm(self.interval)
        else:
            self.job.alarm = None
        deliver_signal(self.job, signal.SIGALRM)

    def cancel(self) -> tuple[float, float]:
        """(seconds it had left, its interval), as setitimer returns for the old one."""
        self._timer.cancel()
        return max(0.0, self.due - time.monotonic()), self.interval


def _set_alarm(job: JobContext, seconds: float, interval: float = 0.0) -> tuple[float, float]:
    old, job.alarm = job.alarm, None
    left = old.cancel() if old is not None else (0.0, 0.0)
    if seconds > 0:
        job.alarm = _Alarm(job, seconds, interval)
    return left


def _signal_alarm(seconds):
    job = current_job()
    if job is None:
        return _originals["signal.alarm"](seconds)
    left, _ = _set_alarm(job, float(seconds))
    return int(left + 0.5) if left else 0  # as alarm(2) rounds what is left


def _signal_setitimer(which, seconds, interval=0.0):
    job = current_job()
    if job is None or which != signal.ITIMER_REAL:
        return _originals["signal.setitimer"](which, seconds, interval)
    return _set_alarm(job, float(seconds), float(interval))


def _signal_getitimer(which):
    job = current_job()
    if job is None or which != signal.ITIMER_REAL:
        return _originals["signal.getitimer"](which)
    alarm = job.alarm
    return (max(0.0, alarm.due - time.monotonic()), alarm.interval) if alarm is not None else (0.0, 0.0)


class _Builtin:
    """A patched built-in that, like the C function it stands for, does not bind as a
    method: `class C: opener = open` then `C().opener(path)` works as under `python`
    (a plain Python function there would receive the instance as `file`)."""

    def __init__(self, function):
        self.__wrapped__ = function
        self.__name__ = self.__qualname__ = function.__name__.lstrip("_").removeprefix("os_")
        self.__doc__ = function.__doc__

    def __call__(self, *args, **kwargs):
        return self.__wrapped__(*args, **kwargs)

    def __repr__(self):
        return f"<built-in function {self.__name__}>"


def _os_kill(pid, signalnum):
    """A job signalling its own process (`os.kill(os.getpid(), sig)`,
    `signal.raise_signal`) signals itself, as it would alone; the process is every
    job's. Its handler runs at once, or the signal's default action ends it."""
    job = current_job()
    if job is None or pid != _LAUNCHER_PID or os.getpid() != _LAUNCHER_PID or signalnum == 0:
        return _originals["os.kill"](pid, signalnum)
    deliver_signal(job, signalnum)


def _raise_signal(signalnum):
    if not _in_launcher_job():
        return _originals["signal.raise_signal"](signalnum)
    _os_kill(_LAUNCHER_PID, signalnum)


def _patch_gc() -> None:
    """`gc.disable()` in one job (for speed, before a collect of its own) turned the
    cyclic collector off for every job, and left it off after the job: another job's
    reference cycles, tensors among them, were never freed. A job's switch and
    thresholds are its own view; the collector keeps running for all."""
    _per_job_switch(gc, ("enable", "disable", "isenabled"), "gc_enabled")

    def set_threshold(*thresholds):
        job = current_job()
        if job is None:
            return _originals["gc.set_threshold"](*thresholds)
        current = job.gc_threshold or _originals["gc.get_threshold"]()
        job.gc_threshold = (*thresholds, *current[len(thresholds):])

    def get_threshold():
        job = current_job()
        threshold = job.gc_threshold if job is not None else None
        return threshold or _originals["gc.get_threshold"]()

    _patch_module(gc, set_threshold, get_threshold)


def _patch_module(module, *functions) -> None:
    """Put `functions` in place of `module`'s of the same names (the originals kept)."""
    for function in functions:
        _originals[f"{module.__name__}.{function.__name__}"] = getattr(module, function.__name__)
        setattr(module, function.__name__, _Builtin(function))


def _per_job_switch(module, names: tuple[str, str, str], field: str) -> None:
    """`module`'s enable, disable and is-enabled functions (`names`, in that order) as
    a view per job: in a job they set and read its context's `field`, and leave the
    process's switch as it is; elsewhere they are the module's own."""

    def setter(name: str, value: bool):
        def switch(*args, **kwargs):
            job = current_job()
            if job is None:
                return _originals[f"{module.__name__}.{name}"](*args, **kwargs)
            setattr(job, field, value)
            return None

        switch.__name__ = name
        return switch

    def query():
        job = current_job()
        return _originals[f"{module.__name__}.{names[2]}"]() if job is None else getattr(job, field)

    query.__name__ = names[2]
    _patch_module(module, setter(names[0], True), setter(names[1], False), query)


def _os_execv(path, args):
    return _exec_in_job(path, args, None) if _in_launcher_job() else _originals["os.execv"](path, args)


def _os_execve(path, args, env):
    return _exec_in_job(path, args, env) if _in_launcher_job() else _originals["os.execve"](path, args, env)


def _in_launcher_job() -> bool:
    return current_job() is not None and os.getpid() == _LAUNCHER_PID


def _exec_in_job(path, args, env) -> None:
    """`os.execv` and kin in a job (a script restarting itself, handing over to a
    tool): the program replaces the job, not the process, which every job shares (it
    replaced the whole run, ending every job without a word, exit code 0). It runs in
    the job's place, with its environment, folder and output, and the job ends with
    its exit code, running no atexit handler, as after an exec."""
    import subprocess

    args = list(args)
    if not args or not args[0]:
        raise ValueError("execv() arg 2 first element cannot be empty")
    code = subprocess.run(args, executable=path, env=env).returncode
    raise JobExit(code if code >= 0 else 128 - code)


class _Watchdog:
    """A job's `faulthandler.dump_traceback_later`: after `timeout` its threads'
    tracebacks go to `file`, and with `exit` the job ends with code 1 (the process's,
    shared, ended every job, even after the job that armed it had ended)."""

    def __init__(self, job: JobContext, timeout: float, repeat: bool, file, exit: bool):
        self.job, self.timeout, self.repeat, self.file, self.exit = job, timeout, repeat, file, exit
        self._timer = _start_timer(timeout, self._fire, "wwrun-watchdog")

    def _fire(self) -> None:
        if self.job.watchdog is not self:
            return
        threads = [self.job.main_thread, *self.job.threads]
        frames = sys._current_frames()
        seconds, micro = int(self.timeout), round(self.timeout % 1 * 1e6)
        text = [f"Timeout ({seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"
                f"{f'.{micro:06d}' if micro else ''})!\n"]  # faulthandler's own format
        blocks = []
        for thread in threads:
            frame = frames.get(getattr(thread, "ident", None))
            if frame is not None:
                blocks.append(f"Thread 0x{thread.ident:016x} (most recent call first):\n" + "".join(
                    f'  File "{f.f_code.co_filename}", line {f.f_lineno} in {f.f_code.co_name}\n'
                    for f in _script_frames(frame)))
        text.append("\n".join(blocks))
        try:
            if isinstance(self.file, int):
                os.write(self.file, "".join(text).encode())
            else:
                self.file.write("".join(text))
                self.file.flush()
        except (OSError, ValueError):
            pass
        if self.exit:
            self.job.watchdog = None
            interrupt(self.job.thread_id, _as_raisable(JobExit(1)), self.job)  # os._exit(1)
        elif self.repeat:
            self.job.watchdog = _Watchdog(self.job, self.timeout, self.repeat, self.file, self.exit)
        else:
            self.job.watchdog = None

    def cancel(self) -> None:
        self._timer.cancel()


def _script_frames(frame):
    """From `frame` outward, most recent first, up to wwrun's own frames (where the
    job's thread, or a thread it started, began)."""
    while frame is not None and not frame.f_code.co_filename.startswith(_WWRUN_DIR):
        yield frame
        frame = frame.f_back


def _patch_faulthandler() -> None:
    """A job's `faulthandler.enable()` took over the run's crash log for the process
    (a later crash of any job was written to that job's stderr, closed once it
    ended: lost), and its `dump_traceback_later(exit=True)` ended every job. In a job
    the run's crash log stays (`is_enabled()` says what the job asked), and the
    watchdog is the job's (`_Watchdog`)."""
    import faulthandler

    _per_job_switch(faulthandler, ("enable", "disable", "is_enabled"), "faulthandler_on")

    def dump_traceback_later(timeout, repeat=False, file=None, exit=False):
        job = current_job()
        if job is None:
            return _originals["faulthandler.dump_traceback_later"](
                timeout, repeat, *(() if file is None else (file,)), exit=exit)
        if timeout <= 0:
            raise ValueError("timeout must be greater than 0")
        cancel_dump_traceback_later()
        stderr = job.rebound.get("stderr") or job.stderr  # the job's own, not the view (the timer is no job's)
        job.watchdog = _Watchdog(job, float(timeout), repeat, stderr if file is None else file, exit)

    def cancel_dump_traceback_later():
        job = current_job()
        if job is None:
            return _originals["faulthandler.cancel_dump_traceback_later"]()
        watchdog, job.watchdog = job.watchdog, None
        if watchdog is not None:
            watchdog.cancel()

    _patch_module(faulthandler, dump_traceback_later, cancel_dump_traceback_later)


_job_loggers: "weakref.WeakSet" = weakref.WeakSet()


def _patch_logging() -> None:
    """`logging.getLogger(__name__)` is `getLogger("__main__")` in every script: one
    logger for all jobs, so each job's handler printed every job's records (twice, in
    two formats), and one job's `setLevel` hid the other's. Loggers named for the
    job's own modules (`__main__`, the modules private to it, and their children) are
    its own, children of the shared root as under `python`; the rest are shared."""
    import logging

    manager = logging.Logger.manager
    get, clear = type(manager).getLogger, type(manager)._clear_cache

    def get_logger(self, name):
        job = current_job()
        if job is None or self is not manager or not isinstance(name, str) or not _own_logger_name(job, name):
            return get(self, name)
        with job.load_lock:
            logger = job.loggers.get(name)
            if logger is None:
                logger = job.loggers[name] = (self.loggerClass or logging.getLoggerClass())(name)
                logger.manager = self
                parent = name.rpartition(".")[0]
                logger.parent = job.loggers.get(parent) or (get_logger(self, parent) if parent else self.root)
                _job_loggers.add(logger)
            return logger

    def clear_cache(self):  # a level changed: the jobs' loggers decide afresh too
        clear(self)
        for logger in list(_job_loggers):
            logger._cache.clear()

    type(manager).getLogger, type(manager)._clear_cache = get_logger, clear_cache
    if not isinstance(logging.root, _JobRootLogger):
        logging.root.__class__ = _JobRootLogger


class _JobRootLogger(logging.RootLogger):
    """The root logger, whose handlers are each job's own, as in a process of its own:
    a job's `logging.basicConfig(filename=...)` or Hydra's job logging
    (`logging.config.dictConfig`) configures the root handlers its records reach.
    Shared, the first job's configuration took every job's records (`basicConfig` is a
    no-op once the root has a handler) and a dictConfig replaced another job's. The
    root's level stays one for the process (loggers cache what it enables)."""

    @property
    def handlers(self):
        job = current_job()
        return job.root_handlers if job is not None else self.__dict__["handlers"]

    @handlers.setter
    def handlers(self, value):
        job = current_job()
        if job is not None:
            job.root_handlers = value
        else:
            self.__dict__["handlers"] = value


_JobRootLogger.__name__ = _JobRootLogger.__qualname__ = "RootLogger"  # its repr as Python's


def _own_logger_name(job: JobContext, name: str) -> bool:
    top = name.partition(".")[0]
    return top == "__main__" or top in job.modules


_process_jobs: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _patch_runpy() -> None:
    """`runpy.run_path(path, run_name="__main__")` (and `run_module`, as `-m` wrappers
    such as profilers use them) put a module of their own in `sys.modules["__main__"]`
    while the code runs: the `_MainModule` view went, and every other job's `__main__`
    was that module meanwhile (its classes no longer pickled). In a job, the job's
    main module is swapped instead."""
    import runpy

    temp_module = runpy._TempModule
    if getattr(temp_module, "_wwrun_per_job", False):
        return

    class JobTempModule(temp_module):
        _wwrun_per_job = True

        def __enter__(self):
            job = current_job()
            if self.mod_name != "__main__" or job is None:
                return super().__enter__()
            self._wwrun_job, self._wwrun_saved = job, job.main
            job.main = self.module
            return self

        def __exit__(self, *args):
            job = self.__dict__.pop("_wwrun_job", None)
            if job is None:
                return super().__exit__(*args)
            job.main = self.__dict__.pop("_wwrun_saved")
            return None

    runpy._TempModule = JobTempModule


def _tag_processes() -> None:
    """A `multiprocessing` process (a DataLoader worker) knows the job that started it
    (`end_daemon_processes`)."""
    import multiprocessing.process

    start = multiprocessing.process.BaseProcess.start

    @functools.wraps(start)
    def tagged_start(self):
        job = current_job()
        if job is not None and os.getpid() == _LAUNCHER_PID:
            _process_jobs[self] = job  # not on the process object, which spawn pickles
        return start(self)

    multiprocessing.process.BaseProcess.start = tagged_start


def end_daemon_processes(job: JobContext, wait_s: float = 5.0) -> None:
    """What Python does with a process's daemonic children at exit (multiprocessing's
    atexit hook): terminate them, then reap them. Left alive, a DataLoader's workers
    made the job's end wait 5 s each, in the iterator's finalizer, collected with the
    job's namespaces (its shutdown message never reached them)."""
    import multiprocessing

    ours = [p for p in multiprocessing.active_children() if p.daemon and _process_jobs.get(p) is job]
    for process in ours:
        with contextlib.suppress(Exception):
            process.terminate()
    deadline = time.monotonic() + wait_s
    for process in ours:
        process.join(max(0.0, deadline - time.monotonic()))


def in_forked_child() -> bool:
    """This process is a child the launcher's process forked (a job's `os.fork()`, a
    DataLoader worker), not the launcher."""
    return os.getpid() != _LAUNCHER_PID


def _os_exit(code):
    # Forked children (DataLoader workers) end with os._exit: only the launcher
    # process itself turns it into the end of one job.
    if os.getpid() == _LAUNCHER_PID and current_job() is not None:
        raise JobExit(int(code))
    _originals["os._exit"](code)


def _os_close(fd):
    """`os.close(1)` in a job closes that job's stdout, not the process's: the fd is the
    launcher's console (and the job's own pipe is the launcher's to close)."""
    job = current_job()
    name = _standard_stream(job, fd) if job is not None else None
    if name is None:
        return _originals["os.close"](fd)
    if isinstance(job.rebound.get(name), _ClosedStream):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    job.rebound[name] = _ClosedStream()
    return None


def _os_write(fd, data):
    """`os.write(1, ...)` (or 2) in a job writes to the job's own output, as `print`
    does: fds 1 and 2 are the launcher's console (the line went there, untagged, and
    into no log). Once the job closed the fd, it fails as a closed fd does."""
    if fd in (1, 2) and _in_launcher_job():
        job = current_job()
        if isinstance(job.rebound.get(_STREAMS[fd]), _ClosedStream):
            raise OSError(errno.EBADF, os.strerror(errno.EBADF))
        fd = job.stdout_fd if fd == 1 else job.stderr_fd
    return _originals["os.write"](fd, data)


def _os_system(command):
    """`os.system` in a job runs the command in the job's environment and folder with
    its output in the job's log (C's `system()` saw the launcher's environment and
    wrote to wwrun's console); the same wait status back."""
    if not _in_launcher_job():
        return _originals["os.system"](command)
    import subprocess

    code = subprocess.call(command, shell=True)
    return code << 8 if code >= 0 else -code


_FORK_WAIT_S = 60.0
_fork_lock = forksafe.RLock()


def _os_fork():
    """`os.fork`, one thread at a time. A script alone never forks from two threads at
    once; jobs do (two DataLoaders starting their workers), and filelock (4.3, which
    torch.compile, triton and the Hugging Face libraries import) refuses, from Python
    3.12, a fork begun while another thread is between its fork hooks: "os.fork is
    unsafe while filelock is changing descriptor ownership". Bounded: a fork held up
    past `_FORK_WAIT_S` (another's fork waiting on a stuck hook) goes ahead, saying so.
    A child that another thread left unable to register an exit function is made again
    (`_fork_whole`)."""
    held = _fork_lock.acquire(timeout=_FORK_WAIT_S)
    if not held:
        print(f"wwrun: a fork waited {_FORK_WAIT_S:g} s for another thread's fork to end; forking beside it",
              file=original_stderr(), flush=True)
    try:
        for _ in range(_FORK_TRIES - 1):
            pid = _fork_whole()
            if pid is not None:
                return pid
        return _originals["os.fork"]()
    finally:  # in the child too: the forking thread holds it there (forksafe keeps it so)
        if held:
            _fork_lock.release()


_FORK_TRIES = 5
_FORK_VERDICT_S = 10.0
_EXIT_LOCK_PROBE_S = 1


def _fork_whole() -> int | None:
    """A fork whose child can register an exit function, or None (that child gone).

    fork() copies only the forking thread, and glibc (2.36) does not free its lock of
    the exit functions in the child: a fork while another thread registers one (its
    first call of a torch op makes the op's static handle, whose destructor is
    registered) leaves it held there for good, and the child hangs at its own first
    call of an op (a DataLoader worker indexing its dataset; seen in the fork stress
    test). A script alone forks with no other thread running; under wwrun other jobs
    run. So the child first registers one (a no-op, `free(NULL)`) under an alarm that
    ends it if the lock is held, and says it is whole; the parent forks again if not.
    Bounded: past `_FORK_VERDICT_S` without a word the child is taken as it is."""
    if _libc() is None:
        return _originals["os.fork"]()
    verdict_r, verdict_w = os.pipe()
    pid = _originals["os.fork"]()
    if pid == 0:
        _originals["os.close"](verdict_r)
        _probe_exit_lock()  # returns only if the lock is free
        _originals["os.write"](verdict_w, b"1")
        _originals["os.close"](verdict_w)
        return 0
    _originals["os.close"](verdict_w)
    whole = False
    try:
        whole = not select.select([verdict_r], [], [], _FORK_VERDICT_S)[0] or os.read(verdict_r, 1) == b"1"
    finally:  # interrupted (a Ctrl-C): the caller never learns of the child, which ends
        _originals["os.close"](verdict_r)
        if not whole:
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                os.kill(pid, signal.SIGKILL)  # gone already when its alarm ended it
                os.waitpid(pid, 0)
    return pid if whole else None


def _probe_exit_lock() -> None:
    """In a forked child: registers a no-op exit function, or ends the child (SIGALRM)
    if the exit functions' lock stays held past `_EXIT_LOCK_PROBE_S`."""
    libc = _libc()  # loaded by the parent, which forks so only where it is
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGALRM})
    previous = libc.signal(signal.SIGALRM, 0)  # SIG_DFL: the alarm ends the process
    libc.alarm(_EXIT_LOCK_PROBE_S)
    libc.__cxa_atexit(libc.free_address, None, None)
    libc.alarm(0)
    libc.signal(signal.SIGALRM, previous)


@functools.cache
def _libc():
    """glibc's functions the probe calls, or None elsewhere."""
    try:
        libc = ctypes.CDLL(None)
        handler = ctypes.c_void_p
        libc.signal.restype, libc.signal.argtypes = handler, (ctypes.c_int, handler)
        libc.alarm.argtypes = (ctypes.c_uint,)
        libc.__cxa_atexit.argtypes = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p)
        libc.free_address = ctypes.cast(libc.free, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    return libc


def _standard_stream(job: JobContext, fd: int) -> str | None:
    """'stdin', 'stdout' or 'stderr' if `fd` is one of the job's standard streams."""
    if 0 <= fd <= 2:
        return _STREAMS[fd]
    if fd == job.stdout_fd:
        return "stdout"
    if fd == job.stderr_fd:
        return "stderr"
    return None


class _ClosedStream(io.TextIOBase):
    """What a job's sys.stdout/stderr/stdin become once it closed the fd: every use
    fails as on a closed descriptor under `python`."""

    def _fail(self, *args):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))

    write = writelines = flush = read = readline = fileno = isatty = _fail


def _thread_start(self):
    self._wwrun_job = job = current_job()
    if job is not None:
        job.threads.append(self)
    return _originals["Thread.start"](self)


def _thread_bootstrap_inner(self):
    _local.job = job = getattr(self, "_wwrun_job", None)
    for hook in job.thread_hooks if job is not None else ():
        try:
            hook()
        except Exception:  # noqa: BLE001 - Thread.start() waits for this thread: never fail here
            pass
    return _originals["Thread._bootstrap_inner"](self)


def _main_thread() -> threading.Thread:
    """The job's own thread in its threads (`if threading.current_thread() is
    threading.main_thread():` before a library sets signal handlers; a helper thread
    that stops once the main thread is gone), as in a process of its own."""
    job = current_job()
    if job is None or job.main_thread is None or os.getpid() != _LAUNCHER_PID:  # a forked child: Python's
        return _originals["threading.main_thread"]()
    return job.main_thread


class _PerJobStartMethod:
    """multiprocessing's default context's `_actual_context`, what `set_start_method`
    fixes and `get_start_method`, `Pool`, `Process` and DataLoader workers use: each
    job's own, as in a process of its own. Shared, a second job calling
    `mp.set_start_method("spawn")` (many scripts do, first thing) failed with "context
    has already been set", and a job's spawn made the other jobs' workers spawn too."""

    def __get__(self, context, owner=None):
        if context is None:
            return self
        job = current_job()
        return context.__dict__.get("_actual_context") if job is None else job.start_method_context

    def __set__(self, context, value):
        job = current_job()
        if job is None:
            context.__dict__["_actual_context"] = value
        else:
            job.start_method_context = value


def _patch_start_method() -> None:
    import multiprocessing.context

    default = multiprocessing.context._default_context
    kind = type(default)
    if not isinstance(kind.__dict__.get("_actual_context"), _PerJobStartMethod):
        default.__class__ = type(kind.__name__, (kind,), {"_actual_context": _PerJobStartMethod(),
                                                          "__module__": kind.__module__})


_FORKSERVER_CALLS = ("ensure_running", "get_inherited_fds", "connect_to_new_process", "set_forkserver_preload")


def _patch_forkserver() -> None:
    """multiprocessing's forkserver is one process per process, started with the env,
    folder and output of whoever first used it: the second job's workers ran in the
    first job's environment and printed into its log (and from Python 3.14 it is the
    default start method, DataLoader workers included). Each job gets its own."""
    import multiprocessing.forkserver as forkserver

    shared = forkserver._forkserver

    def own():
        job = current_job()
        if job is None or os.getpid() != _LAUNCHER_PID:  # the launcher, or a child: Python's
            return shared
        if job.forkserver is None:
            job.forkserver = forkserver.ForkServer()
        return job.forkserver

    for name in _FORKSERVER_CALLS:
        if getattr(getattr(forkserver, name), "__self__", None) is shared:
            setattr(forkserver, name, functools.wraps(getattr(shared, name))(
                lambda *args, _name=name: getattr(own(), _name)(*args)))


def _thread_name(name_template: str = "Thread-%d") -> str:
    job = current_job()
    return _originals["threading._newname"](name_template) if job is None else name_template % next(job.thread_numbers)


class _ThreadHook:
    """threading's `_trace_hook` (or `_profile_hook`), which each new thread installs
    with `sys.settrace` (`sys.setprofile`) before its `run`: the function its job gave
    `threading.settrace`, else the launcher's. Given one job's, the other jobs' threads
    ran its tracer, in their namespace (a NameError), and coverage or a profiler in one
    job saw the others' code. True only when the thread has one; installed, it puts the
    real one in its place at the first event it gets, so `sys.gettrace()` in the thread
    is that function, as under `python`."""

    def __init__(self, kind: str, launcher: Callable | None):
        self.kind = kind
        self.launcher = launcher
        self._install = sys.settrace if kind == "trace" else sys.setprofile

    def current(self) -> Callable | None:
        job = current_job()
        own = getattr(job, f"thread_{self.kind}") if job is not None else None
        return own if own is not None else self.launcher

    def set(self, func: Callable | None) -> None:
        job = current_job()
        if job is None:
            self.launcher = func
        else:
            setattr(job, f"thread_{self.kind}", func)

    def __bool__(self) -> bool:
        return self.current() is not None

    def __call__(self, frame, event, arg):
        hook = self.current()
        self._install(hook)
        return hook(frame, event, arg) if hook is not None else None


_thread_hooks: dict[str, _ThreadHook] = {}


def _patch_thread_hooks() -> None:
    for kind, hook_name in (("trace", "_trace_hook"), ("profile", "_profile_hook")):
        hook = _thread_hooks[kind] = _ThreadHook(kind, getattr(threading, hook_name))
        setattr(threading, hook_name, hook)
        setattr(threading, f"set{kind}", hook.set)
        if hasattr(threading, f"get{kind}"):  # Python 3.10+
            setattr(threading, f"get{kind}", hook.current)


class _FirstImportLock:
    """One job at a time runs first imports (module code not yet in sys.modules).

    Python's per-module import locks let two threads that import a package with
    circular imports from different ends deadlock; Python then hands one of them a
    partially initialized module or raises `_DeadlockError` ("cannot import name
    'IndentedBuffer' from partially initialized module 'torch._inductor.utils'").
    Alone, a script never meets this. Held per job, not per thread: a job whose import
    starts a thread that imports goes on as under `python`. After `_IMPORT_WAIT_S`
    a waiter gives up and imports under Python's own locks, so a module that blocks
    at import on another job (or forever) cannot stall every job's imports.
    """

    def __init__(self):
        self._cond = forksafe.Condition(threading.Lock())
        self._owner = None
        self._depth = 0
        self._forking = threading.local()  # .held: this thread's fork took the lock

    def acquire(self, owner, timeout: float) -> bool:
        with self._cond:
            if self._owner is not None and self._owner is not owner:
                if not self._cond.wait_for(lambda: self._owner is None, timeout):
                    return False
            self._owner = owner
            self._depth += 1
            return True

    def release(self) -> None:
        with self._cond:
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()


    def before_fork(self) -> None:
        """A job's fork waits for another job's first import to end, as a first import
        does: fork copies only the forking thread, so that import would never end in
        the child, whose own import of the module then waited for good (a `datasets`
        `map(num_proc=2)` pool worker unpickling its task). Bounded as imports are."""
        job = current_job()
        self._forking.held = job is not None and self.acquire(job, _IMPORT_WAIT_S)

    def after_fork_in_parent(self) -> None:
        if getattr(self._forking, "held", False):
            self._forking.held = False
            self.release()

    def after_fork_in_child(self) -> None:
        # Only the forking thread's job lives on in a child (a DataLoader worker): an
        # import another job was running will never end there.
        held, self._forking.held = getattr(self._forking, "held", False), False
        if self._owner is not None and self._owner is not current_job():
            self._owner, self._depth = None, 0
        elif held:
            self.release()


_IMPORT_WAIT_S = 60.0
_first_import_lock = _FirstImportLock()
os.register_at_fork(before=_first_import_lock.before_fork, after_in_parent=_first_import_lock.after_fork_in_parent)
forksafe.after_fork_in_child(_first_import_lock.after_fork_in_child)


@forksafe.after_fork_in_child
def _forget_imports_of_gone_threads() -> None:
    """What a fork could not wait for (`_FirstImportLock.before_fork`): an import
    another thread of the forking job, or of no job, was running, or one that outlasted
    the wait. It never ends in the child, where Python keeps its module lock held and
    its half-made module in sys.modules, so the child's import of it would wait for
    good. Every module lock but the forking thread's own is dropped (an import makes a
    fresh one), and the modules other threads were still making are forgotten: the
    child imports them afresh (a package whose submodules were already in may then
    fail to, with an error rather than a hang)."""
    me = threading.get_ident()
    locks = importlib._bootstrap._module_locks
    for name, ref in list(locks.items()):
        lock = ref()
        if lock is not None and getattr(lock, "owner", None) == me:
            continue
        locks.pop(name, None)
        module = sys.modules.get(name)
        spec = vars(module).get("__spec__") if isinstance(module, types.ModuleType) else None
        if lock is not None and lock.owner is not None and getattr(spec, "_initializing", False):
            del sys.modules[name]


def _find_and_load(name, import_):
    """importlib's `_find_and_load` (what every import not found in sys.modules runs),
    one job at a time."""
    find_and_load = _originals["_find_and_load"]
    job = current_job()
    if job is None or name in sys.modules:
        return find_and_load(name, import_)
    if not _first_import_lock.acquire(job, _IMPORT_WAIT_S):
        return find_and_load(name, import_)
    try:
        return find_and_load(name, import_)
    finally:
        _first_import_lock.release()


class _ReplacedModule(types.ModuleType):
    """A module that put another object in sys.modules as its import ended (transformers'
    `_LazyModule`), as a thread that waited for that import holds it: the names it lacks
    are the replacement's."""

    def __getattr__(self, name):
        module = vars(self).get("__name__")
        replacement = sys.modules.get(module)
        if replacement is None or replacement is self:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return getattr(replacement, name)


def _lock_unlock_module(name):
    """importlib's wait for a module another thread is importing. Python then hands the
    waiter the module object it found before it waited: for a package that replaces
    itself in sys.modules, the first object, without the replacement's names. `from
    transformers import GPT2Config` failed so ("cannot import name") in each job but the
    first of several that imported it at once; alone, a script never waits here."""
    found = sys.modules.get(name)
    _originals["_lock_unlock_module"](name)
    if type(found) is types.ModuleType and sys.modules.get(name) not in (None, found):
        found.__class__ = _ReplacedModule


_IMPORT_CODES = frozenset({_find_and_load.__code__, _FirstImportLock.acquire.__code__,
                           _FirstImportLock.release.__code__, _lock_unlock_module.__code__})


# _posixsubprocess.fork_exec's leading positional parameters (stable since 3.2).
_ENV, _C2PWRITE, _ERRWRITE = 5, 9, 11


def _fork_exec(*args):
    """Every child process (subprocess, multiprocessing spawn) of a job gets the job's
    environment and, unless redirected, writes into the job's output pipes."""
    job = current_job()
    if job is not None:
        args = list(args)
        if args[_ENV] is None:
            args[_ENV] = [f"{k}={v}".encode() for k, v in job.environ.items()]
        if args[_C2PWRITE] == -1:
            args[_C2PWRITE] = job.stdout_fd
        if args[_ERRWRITE] == -1:
            args[_ERRWRITE] = job.stderr_fd
    return _originals["fork_exec"](*args)


def _get_preparation_data(name):
    """multiprocessing spawn: the child must find the job's sibling modules."""
    data = _originals["get_preparation_data"](name)
    job = current_job()
    if job is not None:
        data["sys_path"] = [*job.local_roots, *data["sys_path"]]
    return data


# ---------------------------------------------------------------------------------
# Files two jobs write


class WriteWatch:
    """Which job of a run first opened each path for writing; says when another job
    opens the same path for writing too: a sweep whose points all `--save ckpt.pt`
    in one folder would otherwise leave one point's file and no word about it.

    One per run, on every job's context (`JobContext.writes`). Counted: `open`
    (`io.open`, hence pathlib's `write_*`, `numpy.save`, pickle into an `open`ed
    file), `os.open` and `torch.save` to a path (which torch opens from C++), in a
    mode that writes in place or truncates ('w', 'x', '+'; O_WRONLY/O_RDWR).
    Appends are left out (jobs appending to one results file is deliberate), and so
    are what libraries keep in caches or lock (see `_shared_by_design`). A job's
    retries are one job; forked children (DataLoader workers) are not counted.
    """

    def __init__(self, on_collision: Callable[[str, list[str]], None] | None = None):
        self._lock = threading.Lock()
        self._first: dict[str, str] = {}  # path -> the first job that wrote it
        self.collisions: dict[str, list[str]] = {}
        """Each path more than one job wrote -> those jobs, in the order they wrote it."""
        self.on_collision = on_collision
        """Called with (path, [first job, second job]) when a path gets its second job."""

    def note(self, job: str, path: str) -> None:
        with self._lock:
            first = self._first.setdefault(path, job)
            if first == job:
                return
            jobs = self.collisions.setdefault(path, [first])
            if job in jobs:
                return
            jobs.append(job)
            if len(jobs) > 2:
                return
            jobs = list(jobs)
        if self.on_collision is not None:
            self.on_collision(path, jobs)


def _note_write(path) -> None:
    """Note `path` (as given to an open) for the calling job, if it is watched.

    Called inside whatever opens the file, maybe under that library's own lock
    (`tempfile.gettempdir` probes with `os.open` holding one): this calls nothing
    that could open a file or take a lock but the watch's own."""
    job = current_job()
    if job is None or job.writes is None or os.getpid() != _LAUNCHER_PID:
        return
    try:
        path = os.path.abspath(os.fsdecode(path))  # the job's own folder (unshare)
    except (TypeError, ValueError):  # an fd, or a name no file can have
        return
    if not _shared_by_design(path):
        job.writes.note(job.name, path)


def _shared_by_design(path: str) -> bool:
    """Files every job may write by design: devices and /proc, lock files, and the
    caches libraries keep for the whole machine (~/.cache, torch's compiled kernels)."""
    if path.startswith(("/dev/", "/proc/", "/sys/")) or path.endswith(".lock"):
        return True
    return path.startswith(_cache_folders)


def _find_cache_folders() -> tuple[str, ...]:
    """Found once, at install, from the launcher: finding the temporary folder opens
    files under tempfile's lock, which an open noted from a job must never take."""
    import getpass
    import tempfile

    env = process_environ()
    home_cache = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = "unknown"
    folders = [home_cache, os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")]
    folders += [env[name] for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR") if env.get(name)]
    return tuple(os.path.join(os.path.abspath(f), "") for f in folders)


_cache_folders: tuple[str, ...] = ()


def _writes(mode: str) -> bool:
    return ("w" in mode or "x" in mode or "+" in mode) and "a" not in mode


def _open(file, mode="r", *args, **kwargs):
    """`open`/`io.open`: the job's writes are noted (`WriteWatch`); not with an
    `opener`, which decides what is opened (`tempfile.TemporaryFile` passes its
    folder and opens an unnamed file in it: two jobs "both wrote /tmp")."""
    if isinstance(mode, str) and _writes(mode) and not isinstance(file, int) and kwargs.get("opener") is None:
        _note_write(file)
    return _originals["open"](file, mode, *args, **kwargs)


_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR


_O_TMPFILE = getattr(os, "O_TMPFILE", 0) & ~os.O_DIRECTORY  # its own bit (it includes O_DIRECTORY)


def _os_open(path, flags, mode=0o777, *, dir_fd=None):
    """`os.open`: the job's writes are noted (`WriteWatch`); not an unnamed file
    (`O_TMPFILE`, `tempfile.TemporaryFile`), whose path is only its folder."""
    if flags & _WRITE_FLAGS and not flags & (os.O_APPEND | _O_TMPFILE) and dir_fd is None:
        _note_write(path)
    return _originals["os.open"](path, flags, mode, dir_fd=dir_fd)


def _watch_torch_save() -> None:
    """torch.save to a path opens the file from C++ (its zip writer): note it here."""
    serialization = sys.modules.get("torch.serialization")
    if serialization is None or getattr(serialization._open_zipfile_writer, "_wwrun_watched", False):
        return
    original = serialization._open_zipfile_writer

    def open_zipfile_writer(name_or_buffer, *args, **kwargs):
        if serialization._is_path(name_or_buffer):
            _note_write(name_or_buffer)
        return original(name_or_buffer, *args, **kwargs)

    open_zipfile_writer._wwrun_watched = True
    serialization._open_zipfile_writer = open_zipfile_writer


# ---------------------------------------------------------------------------------
# Process-wide settings no per-job view can hold


class _SettingsWatch:
    """Says once, per setting, which jobs' own code set different values of a
    process-wide setting (a torch flag, the default dtype, logging's level, warning
    filters): they then all run with one of them (the last set), not each with its own.

    Per job already: `torch.set_default_device` (thread-local in torch), grad mode,
    autocast. The rest is read by C++ kernels from one global and cannot be per job.
    """

    def __init__(self):
        self._lock = forksafe.Lock()
        self._values: dict[str, weakref.WeakKeyDictionary] = {}
        self._warned: set[str] = set()

    def note(self, setting: str, value) -> None:
        job = current_job()
        if job is None:
            return
        with self._lock:
            by_job = self._values.setdefault(setting, weakref.WeakKeyDictionary())
            by_job[job] = repr(value)
            if setting in self._warned or len(set(by_job.values())) < 2:
                return
            self._warned.add(setting)
            jobs = ", ".join(f"{j.name}={v}" for j, v in by_job.items())
        print(
            f"wwrun: warning: {setting} is process-wide and jobs set it differently ({jobs}): "
            "they share one value, not each its own",
            file=original_stderr(),
            flush=True,
        )


settings_watch = _SettingsWatch()


def _watch_call(owner, name: str, setting: str, value_of=lambda args, kwargs: args[0] if args else kwargs):
    original = getattr(owner, name)
    if getattr(original, "_wwrun_watched", False):
        return

    def watched(*args, **kwargs):
        job = current_job()
        if job is not None and _called_from_job_code(job):  # not a library's own filters
            settings_watch.note(setting, value_of(args, kwargs))
        return original(*args, **kwargs)

    watched._wwrun_watched = True
    watched.__wrapped__ = original
    setattr(owner, name, watched)


def _watch_flags(module, prefix: str, names: tuple[str, ...]) -> None:
    """Watch `module.<name> = value` for flag modules of torch.backends."""
    cls = type(module)
    original = cls.__setattr__
    if getattr(original, "_wwrun_watched", False):
        return

    def watched_setattr(self, name, value):
        job = current_job()
        if name in names and job is not None and _called_from_job_code(job):
            settings_watch.note(f"{prefix}.{name}", value)
        return original(self, name, value)

    watched_setattr._wwrun_watched = True
    cls.__setattr__ = watched_setattr


def _watch_settings() -> None:
    import logging
    import warnings

    _watch_call(logging, "basicConfig", "logging.basicConfig(level=...)", lambda a, k: k.get("level"))
    _watch_call(warnings, "simplefilter", "warnings filters", lambda a, k: (a, k))
    _watch_call(warnings, "filterwarnings", "warnings filters", lambda a, k: (a, k))
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for name in ("set_default_dtype", "set_float32_matmul_precision", "set_num_threads",
                 "use_deterministic_algorithms"):
        _watch_call(torch, name, f"torch.{name}")
    import torch.backends.cuda
    import torch.backends.cudnn

    _watch_flags(torch.backends.cudnn, "torch.backends.cudnn", ("benchmark", "deterministic", "allow_tf32"))
    _watch_flags(torch.backends.cuda.matmul, "torch.backends.cuda.matmul", ("allow_tf32",))
    _once_per_process(torch, "set_num_interop_threads")


def _once_per_process(owner, name: str) -> None:
    """torch takes `set_num_interop_threads` once per process, before any parallel
    work: the second job to call it failed ("cannot set number of interop threads
    after parallel work has started"), though its own process would have taken it.
    A job after the first keeps the value in force; a different one is warned about."""
    original = getattr(owner, name)
    if getattr(original, "_wwrun_watched", False):
        return

    @functools.wraps(original)
    def once(*args, **kwargs):
        if current_job() is not None:
            settings_watch.note(f"torch.{name}", args[0] if args else kwargs)
        try:
            return original(*args, **kwargs)
        except RuntimeError as err:
            if current_job() is None or "cannot set" not in str(err):
                raise
            return None

    once._wwrun_watched = True
    setattr(owner, name, once)


_originals: dict = {}
_install_lock = forksafe.Lock()


def install() -> None:
    """Put the thread-dispatching views in place. Threads that belong to no job keep
    seeing the original objects, so installing changes nothing for the launcher.

    Idempotent; called at every launch, it also re-wraps whatever replaced a view in
    the meantime (pytest's capture, a notebook's streams).
    """
    with _install_lock:
        if not _originals:
            _patch_functions()
        main = sys.modules["__main__"]
        if not isinstance(main, _MainModule):
            sys.modules["__main__"] = _MainModule(main)
        if not isinstance(os.__dict__["environ"], _ThreadEnviron):
            _originals["os.environ"] = os.__dict__["environ"]
            os.__dict__["environ"] = _ThreadEnviron()
        for name in _STREAMS:
            stream = sys.__dict__[name]
            if not isinstance(stream, _ThreadStream):
                _originals[name] = stream
                sys.__dict__[name] = _ThreadStream(name)
        # Last: from here on `sys.stdout` etc. in Python code go through _PerJobName.
        # importlib makes new modules with `type(sys)(name)`: keep those plain.
        importlib._bootstrap._new_module = types.ModuleType
        if threading.__dict__["excepthook"] is not _thread_excepthook:
            _originals["threading.excepthook"] = threading.__dict__["excepthook"]
            threading.__dict__["excepthook"] = _thread_excepthook
        sys.__class__ = _SysModule
        os.__class__ = _OsModule
        threading.__class__ = _ThreadingModule
        if not any(isinstance(f, _JobLocalFinder) for f in sys.meta_path):
            sys.meta_path.insert(0, _JobLocalFinder())


def _patch_functions() -> None:
    # Import what registers process-wide atexit handlers or spawns helpers now, from
    # the launcher, so that a job's first import does not claim them.
    import _posixsubprocess
    import logging  # noqa: F401
    import multiprocessing.spawn
    import multiprocessing.util  # noqa: F401
    import subprocess

    import importlib._bootstrap

    _originals.update({
        "unraisablehook": sys.unraisablehook,
        "_find_and_load": importlib._bootstrap._find_and_load,
        "_lock_unlock_module": importlib._bootstrap._lock_unlock_module,
        "atexit.register": atexit.register,
        "atexit.unregister": atexit.unregister,
        "threading._register_atexit": threading._register_atexit,
        "signal.signal": signal.signal,
        "signal.getsignal": signal.getsignal,
        "signal.alarm": signal.alarm,
        "signal.setitimer": signal.setitimer,
        "signal.getitimer": signal.getitimer,
        "os._exit": os._exit,
        "os.close": os.close,
        "os.kill": os.kill,
        "os.write": os.write,
        "os.system": os.system,
        "os.execv": os.execv,
        "os.execve": os.execve,
        "os.fork": os.fork,
        "signal.raise_signal": signal.raise_signal,
        "open": io.open,
        "os.open": os.open,
        "Thread.start": threading.Thread.start,
        "Thread._bootstrap_inner": threading.Thread._bootstrap_inner,
        "threading._newname": threading._newname,
        "threading.main_thread": threading.main_thread,
        "fork_exec": _posixsubprocess.fork_exec,
        "get_preparation_data": multiprocessing.spawn.get_preparation_data,
    })
    atexit.register = _atexit_register
    sys.unraisablehook = _unraisable_hook
    atexit.unregister = _atexit_unregister
    threading._register_atexit = _threading_register_atexit
    signal.signal = _signal_signal
    signal.getsignal = _signal_getsignal
    signal.alarm = _signal_alarm
    signal.setitimer = _signal_setitimer
    signal.getitimer = _signal_getitimer
    os._exit = _Builtin(_os_exit)
    os.close = _Builtin(_os_close)
    os.kill = _Builtin(_os_kill)
    os.write = _Builtin(_os_write)
    os.system = _Builtin(_os_system)
    os.execv = _Builtin(_os_execv)
    os.execve = _Builtin(_os_execve)
    os.fork = _Builtin(_os_fork)
    signal.raise_signal = _raise_signal
    global _cache_folders
    _cache_folders = _find_cache_folders()
    builtins.open = io.open = _Builtin(_open)
    os.open = _Builtin(_os_open)
    importlib._bootstrap._find_and_load = _find_and_load
    importlib._bootstrap._lock_unlock_module = _lock_unlock_module
    threading.Thread.start = _thread_start
    threading.Thread._bootstrap_inner = _thread_bootstrap_inner
    threading._newname = _thread_name
    threading.main_thread = _main_thread
    _patch_start_method()
    _patch_forkserver()
    _patch_gc()
    _patch_faulthandler()
    _patch_logging()
    _tag_processes()
    _patch_runpy()
    _patch_thread_hooks()
    _patch_getpass()
    _posixsubprocess.fork_exec = _fork_exec
    # subprocess binds fork_exec at import; its posix_spawn path would bypass it.
    subprocess._fork_exec = _fork_exec
    subprocess._USE_POSIX_SPAWN = False
    multiprocessing.spawn.get_preparation_data = _get_preparation_data


def _patch_getpass() -> None:
    import getpass

    _originals["getpass.getpass"] = getpass.getpass
    getpass.getpass = _getpass


def original_stdout():
    """The process's own stdout/stderr, for the launcher's output."""
    return _originals.get("stdout", sys.stdout)


def original_stderr():
    return _originals.get("stderr", sys.stderr)
