"""One role of the fork stress test (tests/test_forksafe.py).

    fork_stress.py loader LOADERS FOLDER   forks 2 DataLoader workers LOADERS times
                                           (they index tensors, draw, print, import),
                                           then leaves FOLDER/done
    fork_stress.py ROLE FOLDER             allocate | draw | print | import, in a loop
                                           until FOLDER/done appears
"""
import importlib
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

role, folder = sys.argv[1], Path(sys.argv[-1])
modules = folder / f"modules_{role}"
modules.mkdir(exist_ok=True)
sys.path.insert(0, str(modules))


def fresh_import(tag: str) -> None:
    """A first import (its module written just now): the import machinery's locks."""
    name = f"m_{tag}_{os.getpid()}_{time.monotonic_ns()}"
    (modules / f"{name}.py").write_text("VALUE = 1\n")
    importlib.invalidate_caches()
    assert importlib.import_module(name).VALUE == 1


class Items(Dataset):
    def __init__(self):
        self.data = torch.arange(64, dtype=torch.float32).reshape(16, 4)

    def __len__(self):
        return 8

    def __getitem__(self, i):
        row = self.data[i]  # select: the op a deadlocked worker was stuck in
        if i == 0:
            print(f"worker {os.getpid()} item {i}", flush=True)
            fresh_import("worker")
        return row + torch.rand(4) + random.random() + float(np.random.rand())


def until_done(step) -> None:
    deadline = time.monotonic() + 600
    count = 0
    while not (folder / "done").exists() and time.monotonic() < deadline:
        step(count)
        count += 1
    print(f"{role}: {count} rounds", flush=True)


if role == "loader":
    loaders = int(sys.argv[2])
    for n in range(loaders):
        total = sum(float(batch.sum()) for batch in DataLoader(Items(), batch_size=4, num_workers=2))
        assert total > 0
    (folder / "done").touch()
    print(f"loader: {loaders} loaders, {2 * loaders} forks", flush=True)
elif role == "allocate":
    until_done(lambda n: [torch.empty(1 << (10 + n % 10)) for _ in range(8)])
elif role == "draw":
    until_done(lambda n: (torch.rand(256), torch.randn(4, 4), random.random(), np.random.rand()))
elif role == "print":
    until_done(lambda n: print(f"line {n}", flush=True) or time.sleep(0.001))
elif role == "import":
    until_done(lambda n: fresh_import("job") or time.sleep(0.005))
else:
    raise SystemExit(f"unknown role {role!r}")
print("finished", flush=True)
