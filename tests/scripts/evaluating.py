"""A job that evaluates after every step on a whole held-out set in one batch, under
no_grad: the evaluation keeps nothing for backward but makes large temporaries (two
hidden activations of EVAL_MIB MiB each), larger than its training iterations. With `first`, it evaluates before each step, so
that its first pass is an evaluation (nanoGPT's estimate_loss at step 0).

    python evaluating.py STEPS EVAL_MIB [first]"""
import sys

import torch
from torch import nn

steps, mib, first = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:] == ["first"]
WIDTH = 1024
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, WIDTH), nn.ReLU(), nn.Linear(WIDTH, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(64, 16), torch.randn(64, 1)
held_out = torch.randn((mib << 20) // (4 * WIDTH), 16)  # its hidden activation is MIB MiB


def evaluate():
    with torch.no_grad():
        return model(held_out).mean().item()


for step in range(steps):
    if first:
        score = evaluate()
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if not first:
        score = evaluate()
print(f"loss {loss.item():.6f} score {score:.6f}")
