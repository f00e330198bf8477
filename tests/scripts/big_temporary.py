"""A job whose forward makes one large temporary that backward does not keep: a
scratch buffer of MIB MiB, reduced to a scale and dropped inside the forward.

    python big_temporary.py STEPS MIB

Three copies under a limit that holds one temporary at a time must take turns."""
import sys

import torch
from torch import nn

steps, mib = int(sys.argv[1]), int(sys.argv[2])


class Scratch(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)

    def forward(self, x):
        with torch.no_grad():
            scratch = torch.ones(mib << 18)  # MIB MiB of float32, gone when forward returns
            scale = scratch[:1024].mean()
            del scratch
        return torch.relu(self.lin(x)) * scale


torch.manual_seed(0)
model = nn.Sequential(Scratch(), nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(256, 64), torch.randn(256, 1)
for step in range(steps):
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.6f}")
