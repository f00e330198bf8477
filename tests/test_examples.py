"""The bundled example trainings (recipes/examples/): each trains alone under plain
`python`, its loss falls, and it draws nothing from the global RNG, which every job
of a wwrun process shares."""

import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

EXAMPLES = Path(__file__).resolve().parent.parent / "recipes" / "examples"

# Small enough for about a second of training each on a busy CPU.
TINY = {
    "mlp.py": ["--steps", "60", "--samples", "1024"],
    "char_transformer.py": ["--steps", "30", "--block", "32", "--batch-size", "16", "--sample", "20"],
    "cnn.py": ["--epochs", "2", "--samples", "512"],
}
SUMMARY = re.compile(r"^done: .*, loss (\d+\.\d+) -> (\d+\.\d+)", re.MULTILINE)
PROGRESS = re.compile(r"^(step|epoch) +\d+/\d+ +loss \d+\.\d+", re.MULTILINE)


@pytest.fixture
def one_thread():
    """One intra-op thread: on a busy 2-core machine, OpenMP's spin-waits made the
    transformer 4x slower (11 s against 3 s for 50 steps). Speed is not tested here."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield {**os.environ, "OMP_NUM_THREADS": "1"}
    torch.set_num_threads(threads)


@pytest.mark.parametrize("script", TINY)
def test_example_trains_alone_and_its_loss_falls(script, tmp_path, one_thread):
    command = [sys.executable, str(EXAMPLES / script), *TINY[script], "--device", "cpu"]
    result = subprocess.run(
        [*command, "--save", "weights.pt"],
        cwd=tmp_path, env=one_thread, capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert len(PROGRESS.findall(result.stdout)) >= 2, result.stdout
    first, last = map(float, SUMMARY.search(result.stdout).groups())
    assert last < first, result.stdout
    # Relative paths are the working directory's, as for any script.
    weights = torch.load(tmp_path / "weights.pt", weights_only=True)
    assert all(torch.isfinite(tensor).all() for tensor in weights.values())


@pytest.mark.parametrize("script", TINY)
def test_example_repeats_exactly_and_leaves_the_global_rng_alone(script, capsys, one_thread):
    main = runpy.run_path(str(EXAMPLES / script), run_name="wwrun_test_example")["main"]
    global_state = torch.random.get_rng_state()
    outputs = []
    for _ in range(2):
        main([*TINY[script], "--device", "cpu"])
        outputs.append(re.sub(r"in \d+\.\d+s", "", capsys.readouterr().out))  # all but timings
    assert torch.equal(torch.random.get_rng_state(), global_state)
    assert outputs[0] == outputs[1]
    assert SUMMARY.search(outputs[0])
