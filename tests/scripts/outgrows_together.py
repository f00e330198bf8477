"""A job that trains a few small steps, then, under no_grad and outside any module,
makes two MIB MiB temporaries, says so (writes MINE) and waits for OTHER before it
makes a third: two of these beside each other both outgrow their plans at once and
hold what the other needs (each fits alone in 3 x MIB, not both in 5 x MIB).

    python outgrows_together.py MIB MINE OTHER [DEVICE]"""
import os
import sys
import time

import torch
from torch import nn

mib, mine, other = int(sys.argv[1]), sys.argv[2], sys.argv[3]
device = sys.argv[4] if len(sys.argv) > 4 else "cpu"
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 1)).to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(32, 16).to(device), torch.randn(32, 1).to(device)
for step in range(3):
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
with torch.no_grad():
    a = torch.ones((mib << 20) // 4, device=device)
    b = a * 2
    open(mine, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(other):
        if time.monotonic() > deadline:
            sys.exit(f"{other} never appeared")
        time.sleep(0.01)
    total = (a + b).sum().item()
print(f"loss {loss.item():.6f} total {total:.0f}")
