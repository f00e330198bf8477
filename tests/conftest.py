"""Shared test set-up.

Triton kernels run on the CPU through Triton's interpreter when no CUDA device is
present; the variable must be set before triton is first imported. Tests marked
`gpu` are skipped without a CUDA device.

Tests marked `fresh_process` run in an interpreter of their own (a `python -m
pytest` child for that test alone; the session reports its result): wwrun's CUDA
allocator can only be installed before CUDA is initialised, which any earlier GPU
test of the session may have done, and a launch there would fall back to PyTorch's
allocator. So `pytest -m gpu` gives each of them a fresh CUDA context, and such a
test asserts the allocator it ran on rather than falling back.
"""

import os
import subprocess
import sys

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

FRESH_PROCESS_ENV = "WWRUN_TEST_FRESH_PROCESS"  # the node id a child runs in place
FRESH_PROCESS_LIMIT_S = 600


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem):
    """A `fresh_process` test runs in a child interpreter (unless this is it)."""
    if "fresh_process" not in pyfuncitem.keywords or os.environ.get(FRESH_PROCESS_ENV) == pyfuncitem.nodeid:
        return None
    argv = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(pyfuncitem.config.rootpath),
            pyfuncitem.nodeid]  # relative to the root folder, the child's working folder
    env = dict(os.environ, **{FRESH_PROCESS_ENV: pyfuncitem.nodeid, "WWRUN_TEST_SESSION_PID": str(os.getpid())})
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=FRESH_PROCESS_LIMIT_S,
                              cwd=pyfuncitem.config.rootpath, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"its fresh process did not end within {FRESH_PROCESS_LIMIT_S} s")
    if done.returncode != 0:
        pytest.fail(f"in its fresh process (exit code {done.returncode}):\n{done.stdout[-6000:]}{done.stderr[-2000:]}",
                    pytrace=False)
    if " passed" not in done.stdout and " skipped" not in done.stdout:
        pytest.fail(f"its fresh process ran no test:\n{done.stdout[-2000:]}", pytrace=False)
    if " skipped" in done.stdout and " passed" not in done.stdout:
        pytest.skip(f"skipped in its fresh process: {done.stdout.strip().splitlines()[-1]}")
    return True
