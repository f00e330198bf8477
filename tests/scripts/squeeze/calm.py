"""Enters its first parallel region while the other job holds all it could get."""
import os
import time

import torch

ready, full, done = (os.environ["SQUEEZE_DIR"] + "/" + name for name in ("ready", "full", "done"))
x, one = torch.empty(1 << 24), torch.empty(1 << 24)  # no parallel region yet
open(ready, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(full) and time.monotonic() < deadline:
    time.sleep(0.01)
x.add_(one)  # OpenMP creates its threads here (and allocates nothing)
print("threads", torch.get_num_threads(), "done", flush=True)
open(done, "w").close()
