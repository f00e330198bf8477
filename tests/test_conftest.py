"""tests/conftest.py: a `fresh_process` test runs in an interpreter of its own (a
fresh CUDA context on a GPU), and its failure there is the session's."""

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

CONFTEST = Path(__file__).with_name("conftest.py")


@pytest.mark.fresh_process
def test_a_fresh_process_test_runs_in_an_interpreter_of_its_own():
    import torch

    assert int(os.environ["WWRUN_TEST_SESSION_PID"]) != os.getpid()
    assert not torch.cuda.is_initialized()


def test_a_fresh_process_test_fails_or_passes_as_it_did_in_its_child(tmp_path):
    shutil.copy(CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    fresh_process: x\n    gpu: x\n")
    (tmp_path / "test_child.py").write_text(textwrap.dedent("""
        import os
        import pytest

        @pytest.mark.fresh_process
        def test_fails_there():
            assert os.environ["WWRUN_TEST_FRESH_PROCESS"].endswith("test_fails_there")
            assert 1 + 1 == 3, "the child's own message"

        @pytest.mark.fresh_process
        def test_passes_there():
            assert os.environ["WWRUN_TEST_FRESH_PROCESS"].endswith("test_passes_there")
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed, 1 passed" in done.stdout
    assert "in its fresh process" in done.stdout and "the child's own message" in done.stdout
