"""Building wwrun's C++ extensions (the allocator, the per-job generators) against
the installed torch, once per machine, safely.

`torch.utils.cpp_extension.load` alone guards its folder with a lock *file* that a
killed build leaves behind (every later load then waits on it, silently), and keys
the folder by name only (two checkouts rebuild each other's extension in turn).
`load` here wraps it:

- folder: `<torch's extensions root>/<name>-<key>` (the root honours
  TORCH_EXTENSIONS_DIR), where the key hashes the sources (every C++ file of their
  folders, headers included), the flags, torch's version and CUDA/HIP build, the
  Python ABI and, for CUDA builds, CUDA_HOME: identical sources share one build,
  different ones never collide;
- lock: `fcntl.flock` on `<folder>.lock`, released by the kernel when its holder
  dies; held around torch's build, so a lock file torch left in the folder is stale
  by construction and removed; a wait is bounded (WWRUN_BUILD_WAIT_S, default 900 s)
  and says whom it waits for;
- once built (`built` marker), later processes import the library directly: no
  lock, no compiler;
- a build prints one line on stderr while it runs, and a failure raises
  `BuildError` (the part cannot run without it);
- the library links the process's own C++ runtime (`libstdc++.so.6`, the one torch
  loaded), never a copy of its own: see `_LDFLAGS`.

Not built at install time: pip builds a package in an isolated environment without
the user's torch (`pip install -e .` builds nothing at all), and the library must
match the torch it is loaded into. `wwrun build` builds every part ahead
(for an image or a CI cache).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import os
import re
import sys
import time
from collections.abc import Sequence
from pathlib import Path

__all__ = ["BuildError", "build_directory", "cuda_home", "load"]

WAIT_ENV = "WWRUN_BUILD_WAIT_S"
DEFAULT_WAIT_S = 900.0  # a cold build takes about a minute, several on a loaded machine
_SOURCE_SUFFIXES = {".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}
_MARKER = "built"
_CUDA_RUNTIME_HEADER = Path("include") / "cuda_runtime_api.h"
TOOLKIT_DEFAULT = Path("/usr/local/cuda")
# Some toolchains link libstdc++ statically by default (a CUDA image's CXX wrapper
# does: `-static-libstdc++`). Such a library carries its own copy beside the shared
# one torch loaded, and the two disagree on locale facets: formatting a number into
# an ostringstream (every out-of-memory message) then writes nothing, or crashes.
# Naming the shared library before the driver's own libraries binds to it; a linker
# that cannot find it by that name gets the compiler's default (`_build`).
_LDFLAGS = ("-l:libstdc++.so.6",) if sys.platform.startswith("linux") else ()


class BuildError(RuntimeError):
    """A C++ part of wwrun could not be built (or loaded): the message says which,
    where, and the compiler's last line."""


def extensions_root() -> Path:
    """torch's extensions root: TORCH_EXTENSIONS_DIR as given, else its default
    folder per Python version and accelerator (as `cpp_extension.load` uses)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    if given:
        return Path(given)
    import torch

    if torch.version.hip is not None:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda is not None:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return _default_build_root() / f"{python}_{accelerator}"


def _default_build_root() -> Path:
    """`cpp_extension.get_default_build_root()`, without importing cpp_extension on
    every run: a CUDA build of torch on a machine with no GPU logs "No CUDA runtime
    is found" as that module is imported, which a run that builds nothing need not
    print."""
    try:
        from torch import _appdirs
    except ImportError:  # a torch without it: ask cpp_extension
        from torch.utils import cpp_extension

        return Path(cpp_extension.get_default_build_root())
    return Path(os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions")))


def cuda_home() -> tuple[str | None, str]:
    """(CUDA_HOME for CUDA builds, how it was found). torch guesses it from
    CUDA_HOME/CUDA_PATH, else from `nvcc` on PATH, else /usr/local/cuda; an `nvcc`
    that is a wrapper outside the toolkit (/usr/bin/nvcc) gives a folder without
    the CUDA headers: /usr/local/cuda is taken instead when it has them."""
    from torch.utils import cpp_extension

    found = cpp_extension.CUDA_HOME
    if os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH"):
        return found, "from the environment"
    if found and (Path(found) / _CUDA_RUNTIME_HEADER).is_file():
        return found, "found by torch"
    fallback = TOOLKIT_DEFAULT
    if (fallback / _CUDA_RUNTIME_HEADER).is_file():
        why = f"torch found {found}, which has no CUDA headers" if found else "torch found none"
        return str(fallback), why
    return found, "found by torch" if found else "none found"


def _use_cuda_home() -> str | None:
    """Points torch's build at `cuda_home()`; returns it."""
    from torch.utils import cpp_extension

    home, _how = cuda_home()
    if home and home != cpp_extension.CUDA_HOME:
        cpp_extension.CUDA_HOME = home  # read at build time by torch's include/library paths
    return home


def _key(sources: Sequence[Path], flags: Sequence[str], include_paths: Sequence[Path],
         with_cuda: bool) -> str:
    import torch

    digest = hashlib.sha256()
    folders = {source.parent for source in sources} | set(include_paths)
    files = set(sources) | {f for d in folders if d.is_dir() for f in d.iterdir() if f.suffix in _SOURCE_SUFFIXES}
    for path in sorted(files, key=lambda f: (f.parent.name, f.name)):  # not by where the checkout is
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    for part in (
        *[source.name for source in sources],  # which files are compiled, in order
        *flags,
        *_LDFLAGS,
        torch.__version__,
        str(torch.version.cuda),
        str(torch.version.hip),
        sys.version,
        str(with_cuda),
        str(_use_cuda_home() if with_cuda else None),
    ):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def build_directory(name: str, sources: Sequence[str | os.PathLike], *, extra_cflags=(),
                    extra_include_paths=(), with_cuda: bool = False) -> Path:
    """The folder `load` builds these sources in (not created here)."""
    paths = [Path(source).resolve() for source in sources]
    includes = [Path(p).resolve() for p in extra_include_paths]
    return extensions_root() / f"{name}-{_key(paths, list(extra_cflags), includes, with_cuda)}"


def load(name: str, sources: Sequence[str | os.PathLike], *, what: str, extra_cflags=(),
         extra_include_paths=(), with_cuda: bool = False):
    """The compiled module `name` (its PYBIND11_MODULE / PyInit_ name), built if no
    process built it before. `what` names the part for people ("wwrun's
    allocator"). Raises BuildError when it cannot be built or loaded."""
    folder = build_directory(name, sources, extra_cflags=extra_cflags,
                             extra_include_paths=extra_include_paths, with_cuda=with_cuda)
    module = _import_built(name, folder)
    if module is not None:
        return module
    folder.parent.mkdir(parents=True, exist_ok=True)
    with _BuildLock(folder.with_name(folder.name + ".lock"), what, folder):
        module = _import_built(name, folder)  # built meanwhile by the process we waited for
        if module is not None:
            return module
        return _build(name, sources, folder, what, extra_cflags, extra_include_paths, with_cuda)


def _import_built(name: str, folder: Path):
    """The module from a finished build in `folder`, or None."""
    marker = folder / _MARKER
    if not marker.is_file():
        return None
    library = folder / marker.read_text().strip()
    if not library.is_file():
        return None
    import torch  # noqa: F401 - the library links against torch's, which must be loaded first

    # Its own name: torch names a second build of one name in a process `<name>_v1`.
    spec = importlib.util.spec_from_file_location(library.stem, library)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except ImportError:  # a library for another torch, or damaged: build again
        marker.unlink(missing_ok=True)
        return None
    return module


def _build(name, sources, folder: Path, what: str, extra_cflags, extra_include_paths, with_cuda):
    from torch.utils import cpp_extension

    folder.mkdir(exist_ok=True)
    # Only a holder of our lock builds here: a lock file torch's build left behind
    # belongs to a process that died (it would make torch wait forever).
    (folder / "lock").unlink(missing_ok=True)
    verbose = os.environ.get("WWRUN_BUILD_VERBOSE") == "1"
    print(f"wwrun: building {what} (first run only) ...", file=sys.stderr, flush=True)
    started = time.monotonic()

    def compile_and_link(ldflags: list[str]):
        return cpp_extension.load(
            name=name,
            sources=[str(source) for source in sources],
            extra_cflags=list(extra_cflags),
            extra_include_paths=[str(p) for p in extra_include_paths],
            extra_ldflags=ldflags,  # a fresh list: torch appends its libraries to it
            build_directory=str(folder),
            with_cuda=with_cuda,
            verbose=verbose,
        )

    arch_list, given = None, os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        arch_list = _cuda_arch_list() if with_cuda else None
        if arch_list:
            os.environ["TORCH_CUDA_ARCH_LIST"] = arch_list
        try:
            module = compile_and_link(list(_LDFLAGS))
        except Exception as exc:  # noqa: BLE001
            if not _LDFLAGS or "libstdc++.so.6" not in str(exc):
                raise
            # A linker that does not find it by that name (a toolchain with its own
            # library folders): the compiler's default, relinking the objects built.
            module = compile_and_link([])
    except Exception as exc:  # noqa: BLE001 - a compiler error: its last lines say what failed
        raise BuildError(
            f"wwrun: could not build {what} in {folder}: {_summary(exc)} "
            "(needs a C++ compiler and ninja; WWRUN_BUILD_VERBOSE=1 shows the build)"
        ) from exc
    finally:
        if arch_list and given is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        elif arch_list:
            os.environ["TORCH_CUDA_ARCH_LIST"] = given
    library = Path(module.__file__)
    (folder / _MARKER).write_text(library.name + "\n")
    print(f"wwrun: built {what} in {time.monotonic() - started:.0f} s ({folder})",
          file=sys.stderr, flush=True)
    return module


def _cuda_arch_list() -> str | None:
    """TORCH_CUDA_ARCH_LIST for a CUDA build on a machine that shows no GPU (`wwrun
    build` on an image builder): torch derives the list from the visible GPUs (also
    for "native"), and with none its build failed ("list index out of range"). The
    parts hold no device code, so the architectures torch was built for do; None where
    torch's own choice stands."""
    import torch

    given = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if (given and given != "native") or torch.cuda.device_count() > 0:
        return None
    archs = [re.fullmatch(r"sm_(\d+)(\d)([a-z]?)", arch) for arch in torch.cuda.get_arch_list()]
    archs = [f"{m[1]}.{m[2]}{m[3]}" for m in archs if m]
    return ";".join(archs[:-1] + [archs[-1] + "+PTX"]) if archs else None


def _summary(exc: BaseException) -> str:
    """The compiler's first error line ("file:line:col: error: ..."), else the
    exception's last line."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    return errors[0] if errors else (lines or [type(exc).__name__])[-1]


class _BuildLock:
    """An exclusive `flock` on `path`: the kernel releases it when its holder dies
    (a killed build never blocks the next). The holder's pid is written in it, so
    that a waiter can say whom it waits for."""

    def __init__(self, path: Path, what: str, folder: Path):
        self.path, self.what, self.folder = path, what, folder
        self.file = None

    def __enter__(self):
        self.file = open(self.path, "a+")  # noqa: SIM115 - held until __exit__
        limit = float(os.environ.get(WAIT_ENV, DEFAULT_WAIT_S))
        deadline = time.monotonic() + limit
        said = False
        while True:
            try:
                fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                pass
            if not said:
                print(f"wwrun: waiting for {self._holder()} to finish building {self.what} "
                      f"in {self.folder} (up to {limit:g} s, {WAIT_ENV}) ...", file=sys.stderr, flush=True)
                said = True
            if time.monotonic() >= deadline:
                holder = self._holder()
                self.file.close()
                raise BuildError(
                    f"wwrun: {holder} still builds {self.what} in {self.folder} after {limit:g} s; "
                    f"wait for it or end it (its lock is {self.path}), or raise {WAIT_ENV}"
                )
            time.sleep(0.2)
        self.file.seek(0)
        self.file.truncate()
        self.file.write(f"{os.getpid()}\n")
        self.file.flush()
        return self

    def __exit__(self, *exc):
        self.file.seek(0)
        self.file.truncate()
        self.file.close()  # releases the lock
        return False

    def _holder(self) -> str:
        try:
            pid = Path(self.path).read_text().strip()
        except OSError:
            pid = ""
        return f"process {pid}" if pid.isdigit() else "another process"
