"""A job that trains on small batches and evaluates once, late, on a whole held-out
set in one batch under no_grad (makemore evaluates at step 500): the evaluation's
temporaries (two hidden activations of EVAL_MIB MiB each) are far larger than
anything its training iterations took, and come after the job is sized by them.
With AFTER, it evaluates only once that file exists (another job wrote it). A
KeyboardInterrupt in the evaluation is said, with the functions it came through
from the model's forward on.

    python late_evaluation.py STEPS EVAL_AT EVAL_MIB [AFTER]"""
import os
import sys
import time
import traceback

import torch
from torch import nn

steps, evaluate_at, mib = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
after = sys.argv[4] if len(sys.argv) > 4 else None
WIDTH = 1024
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 16), torch.randn(64, 1)
held_out = torch.randn((mib << 20) // (4 * WIDTH), 16)  # its hidden activation is MIB MiB
score = None
for step in range(steps):
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step == evaluate_at:
        deadline = time.monotonic() + 60
        while after is not None and not os.path.exists(after):
            if time.monotonic() > deadline:
                sys.exit(f"{after} never appeared")
            time.sleep(0.01)
        try:
            with torch.no_grad():
                score = model(held_out).mean().item()
        except KeyboardInterrupt as interrupt:
            names = [frame.name for frame in traceback.extract_tb(interrupt.__traceback__)]
            print(f"KeyboardInterrupt in the evaluation, through {' '.join(names[names.index('forward'):])}")
            raise
print(f"loss {loss.item():.6f} score {score:.6f}")
