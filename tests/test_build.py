"""wwrun.build: C++ parts are built once per source, under a lock a dead builder
cannot keep, with a line while they build and a hard error when they cannot be.

The extensions here are tiny (Python's C API only): each builds in about a second.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from wwrun import build

ROOT = Path(__file__).resolve().parent.parent
TINY = textwrap.dedent("""\
    #include <Python.h>
    static PyObject* answer(PyObject*, PyObject*) { return PyLong_FromLong(ANSWER); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, nullptr}, {nullptr}};
    static PyModuleDef def = {PyModuleDef_HEAD_INIT, "tiny", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit_tiny(void) { return PyModule_Create(&def); }
""")
LOAD = "from wwrun import build; print(build.load('tiny', [{src!r}], what='the tiny part').answer())"


def tiny_tree(where: Path, answer: int = 42) -> Path:
    where.mkdir(parents=True)
    source = where / "tiny.cpp"
    source.write_text(f"#define ANSWER {answer}\n" + TINY)
    return source


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(root))
    return root


def load_in_child(source: Path, timeout: float = 180, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", LOAD.format(src=str(source))],
        capture_output=True, text=True, timeout=timeout, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **env},
    )


def test_identical_sources_share_one_build_and_different_ones_do_not(tmp_path, extensions):
    first, second = tiny_tree(tmp_path / "checkout_a"), tiny_tree(tmp_path / "checkout_b")
    other = tiny_tree(tmp_path / "checkout_c", answer=7)
    folder = build.build_directory("tiny", [first])
    assert build.build_directory("tiny", [second]) == folder
    assert build.build_directory("tiny", [other]) != folder
    assert build.build_directory("tiny", [first], extra_cflags=["-O0"]) != folder
    assert folder.parent == extensions

    built = load_in_child(first)
    assert built.returncode == 0, built.stderr
    assert built.stdout.split() == ["42"]
    assert "wwrun: building the tiny part (first run only) ..." in built.stderr

    reused = load_in_child(second)  # another checkout, same sources: nothing rebuilt
    assert reused.returncode == 0, reused.stderr
    assert reused.stdout.split() == ["42"]
    assert "building" not in reused.stderr

    different = load_in_child(other)
    assert different.returncode == 0, different.stderr
    assert different.stdout.split() == ["7"]
    assert "building the tiny part" in different.stderr
    assert load_in_child(first).stdout.split() == ["42"]  # the first build is still there


def test_a_build_leaves_the_next_part_s_folder_where_it_was(tmp_path, extensions):
    """torch appends its libraries to the link flags it is given: a build that handed
    it wwrun's own list moved every later part's folder (its key holds the flags), so
    `wwrun build` built where no run looked."""
    first, second = tiny_tree(tmp_path / "a"), tiny_tree(tmp_path / "b", answer=7)
    folder = build.build_directory("tiny", [second])
    build.load("tiny", [first], what="the tiny part")
    assert build.build_directory("tiny", [second]) == folder


def test_a_lock_file_left_by_a_killed_build_does_not_block_the_next(tmp_path, extensions):
    source = tiny_tree(tmp_path / "src")
    folder = build.build_directory("tiny", [source])
    folder.mkdir(parents=True)
    (folder / "lock").touch()  # torch's own lock file, as a killed build leaves it
    done = load_in_child(source, timeout=120)  # torch alone would wait forever
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["42"]


def test_a_builder_killed_mid_build_does_not_block_the_next(tmp_path, extensions):
    source = tiny_tree(tmp_path / "src")
    folder = build.build_directory("tiny", [source])
    started = tmp_path / "compiler-started"
    stuck_compiler = tmp_path / "stuck-c++"
    stuck_compiler.write_text(f"#!/bin/sh\ntouch {started}\nexec sleep 600\n")
    stuck_compiler.chmod(0o755)
    builder = subprocess.Popen(
        [sys.executable, "-c", LOAD.format(src=str(source))],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT), "CXX": str(stuck_compiler)},
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert builder.poll() is None, builder.stderr.read()
            assert time.monotonic() < deadline, "the builder never reached its compiler"
            time.sleep(0.1)
        assert (folder / "lock").exists()  # torch's lock file, held mid-build

        waiter = load_in_child(source, timeout=60, WWRUN_BUILD_WAIT_S="1")
        assert waiter.returncode != 0
        assert f"process {builder.pid} still builds the tiny part" in waiter.stderr
        assert "BuildError" in waiter.stderr
    finally:
        os.killpg(builder.pid, signal.SIGKILL)
        builder.wait(timeout=30)
        builder.stderr.close()

    assert (folder / "lock").exists()  # left behind, as by a double Ctrl-C
    done = load_in_child(source, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["42"]


def test_a_part_that_does_not_compile_is_a_clear_error(tmp_path, extensions):
    source = tmp_path / "broken.cpp"
    source.write_text("#include <Python.h>\nint broken( {\n")
    with pytest.raises(build.BuildError) as failure:
        build.load("broken", [source], what="the broken part")
    message = str(failure.value)
    assert message.startswith("wwrun: could not build the broken part in ")
    assert "error" in message.split(": ", 2)[2]  # the compiler's own line
    assert "WWRUN_BUILD_VERBOSE=1" in message


NUMBERS = textwrap.dedent("""\
    #include <Python.h>
    #include <sstream>
    #include <string>
    // What every out-of-memory message of the allocator does: numbers into a stream.
    static PyObject* formatted(PyObject*, PyObject* arg) {
      std::ostringstream out;
      out << PyLong_AsUnsignedLong(arg) << " bytes";
      const std::string text = out.str();
      return PyUnicode_FromStringAndSize(text.data(), static_cast<Py_ssize_t>(text.size()));
    }
    static PyMethodDef methods[] = {{"formatted", formatted, METH_O, nullptr}, {nullptr}};
    static PyModuleDef def = {PyModuleDef_HEAD_INIT, "numbers_probe", nullptr, -1, methods};
    PyMODINIT_FUNC PyInit_numbers_probe(void) { return PyModule_Create(&def); }
""")


def test_a_part_built_by_a_toolchain_that_links_libstdcxx_statically_formats_numbers(tmp_path, extensions):
    """A CUDA image's CXX (a g++ wrapper adding -static-libstdc++) gave the allocator
    a copy of libstdc++ beside the one torch loaded: on an H200 every out-of-memory
    message crashed the process, and here the same build formats numbers as ''."""
    static_archive = subprocess.run(["g++", "-print-file-name=libstdc++.a"], capture_output=True, text=True)
    if not os.path.isabs(static_archive.stdout.strip()):
        pytest.skip("this g++ cannot link libstdc++ statically")
    wrapper = tmp_path / "g++"
    wrapper.write_text('#!/bin/sh\nexec g++ "$@" -static-libstdc++\n')
    wrapper.chmod(0o755)
    source = tmp_path / "probe" / "numbers_probe.cpp"
    source.parent.mkdir()
    source.write_text(NUMBERS)
    done = subprocess.run(
        [sys.executable, "-c", "from wwrun import build; print(repr(build.load("
                               f"'numbers_probe', [{str(source)!r}], what='the probe').formatted(12345)))"],
        capture_output=True, text=True, timeout=180, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "CXX": str(wrapper)},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.splitlines()[-1] == "'12345 bytes'"


def test_a_linker_that_cannot_find_libstdcxx_by_its_soname_gets_the_compiler_s_default(tmp_path, extensions):
    wrapper = tmp_path / "g++"
    wrapper.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-l:libstdc++.so.6" ] && '
                       '{ echo "ld: cannot find -l:libstdc++.so.6" >&2; exit 1; }; done\nexec g++ "$@"\n')
    wrapper.chmod(0o755)
    source = tmp_path / "checkout" / "tiny.cpp"
    source.parent.mkdir()
    # Named by TORCH_EXTENSION_NAME, as wwrun's parts are: torch names a second build
    # of one name in a process `<name>_v1`.
    source.write_text("#define ANSWER 42\n" + TINY.replace('"tiny"', "NAME_OF(TORCH_EXTENSION_NAME)")
                      .replace("PyInit_tiny", "INIT_OF(TORCH_EXTENSION_NAME)")
                      .replace("#include <Python.h>", "#include <Python.h>\n#define STR(x) #x\n"
                               "#define NAME_OF(x) STR(x)\n#define INIT(x) PyInit_##x\n#define INIT_OF(x) INIT(x)"))
    done = load_in_child(source, CXX=str(wrapper))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["42"]


def test_rng_refuses_to_run_without_its_extension(tmp_path, extensions, monkeypatch):
    from wwrun import rng

    broken = tmp_path / "rng"
    broken.mkdir()
    (broken / "job_generators.cpp").write_text("#error not today\n")
    monkeypatch.setattr(rng, "source_dir", lambda: broken)
    monkeypatch.setattr(rng, "_extension", None)
    with pytest.raises(build.BuildError, match="per-job random generators.*not today"):
        rng._build_extension()
    assert rng._extension is None


def test_the_extensions_root_is_torch_s_and_finding_it_imports_no_cpp_extension(tmp_path):
    # cpp_extension logs "No CUDA runtime is found" as it is imported on a machine with
    # a CUDA build of torch, nvcc and no GPU: a run that builds nothing must not.
    probe = textwrap.dedent("""\
        import sys
        from wwrun import build
        root = build.extensions_root()
        print("imported" if "torch.utils.cpp_extension" in sys.modules else "not imported")
        from torch.utils import cpp_extension
        print(root.parent == __import__("pathlib").Path(cpp_extension.get_default_build_root()))
    """)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env.update(PYTHONPATH=str(ROOT), XDG_CACHE_HOME=str(tmp_path / "cache"))
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["not", "imported", "True"]


def test_a_cuda_build_on_a_machine_with_no_gpu_names_torch_s_architectures(monkeypatch):
    # torch derives TORCH_CUDA_ARCH_LIST from the visible GPUs: with none, its build
    # failed ("list index out of range"), so `wwrun build` could not make an image on
    # a builder without a GPU (test_cli's `wwrun build` test runs it on a CUDA torch).
    import torch

    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_90a", "sm_120", "compute_120"])
    assert build._cuda_arch_list() == "7.5;9.0a;12.0+PTX"
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert build._cuda_arch_list() is None  # torch's own choice: the GPU it sees
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "8.0")
    assert build._cuda_arch_list() is None  # the user's word stands
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "native")  # the visible GPUs: none
    assert build._cuda_arch_list() == "7.5;9.0a;12.0+PTX"
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: [])  # a CPU build of torch
    assert build._cuda_arch_list() is None


def test_cuda_home_falls_back_to_the_toolkit_when_nvcc_is_a_wrapper(tmp_path, monkeypatch):
    from torch.utils import cpp_extension

    toolkit = tmp_path / "cuda"
    (toolkit / "include").mkdir(parents=True)
    (toolkit / "include" / "cuda_runtime_api.h").touch()
    wrapper_home = tmp_path / "usr"  # /usr/bin/nvcc, a wrapper: /usr has no CUDA headers
    (wrapper_home / "include").mkdir(parents=True)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setattr(build, "TOOLKIT_DEFAULT", toolkit)
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(wrapper_home))
    home, how = build.cuda_home()
    assert home == str(toolkit)
    assert str(wrapper_home) in how and "no CUDA headers" in how

    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(toolkit))
    assert build.cuda_home() == (str(toolkit), "found by torch")
    monkeypatch.setenv("CUDA_HOME", str(wrapper_home))  # the user's word stands
    monkeypatch.setattr(cpp_extension, "CUDA_HOME", str(wrapper_home))
    assert build.cuda_home() == (str(wrapper_home), "from the environment")


def test_a_run_whose_allocator_cannot_be_built_stops_saying_why(tmp_path, extensions, monkeypatch, capsys):
    """The allocator is the run's memory truth: a run never goes on silently on
    PyTorch's instead (every figure and the isolation would differ from what was asked)."""
    from wwrun import cli
    from wwrun.memory import allocator

    broken = tmp_path / "allocator"
    broken.mkdir()
    for name in allocator._CORE_SOURCES + allocator._CPU_SOURCES:
        (broken / name).write_text("#error not today\n")
    monkeypatch.setattr(allocator, "source_dir", lambda: broken)
    monkeypatch.setattr(allocator, "_modules", {})
    script = tmp_path / "job.py"
    script.write_text("print('trained')\n")

    code = cli.main(["--device", "cpu", "--quiet", "--log-dir", str(tmp_path / "logs"), str(script)])
    err = capsys.readouterr().err
    assert code == 1
    assert "could not build wwrun's allocator" in err and "not today" in err, err
    assert "using PyTorch's" not in err
    assert not any("trained" in log.read_text() for log in tmp_path.rglob("stdout.log"))  # no job ran
