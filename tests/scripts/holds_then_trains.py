"""A job whose parameters and gradients hold about 2 x MIB MiB: once its first step
is over it writes FILE, then trains STEPS more steps, then idles IDLE_S seconds
holding them (default 0).

    python holds_then_trains.py MIB STEPS FILE [IDLE_S]"""
import sys
import time

import torch

mib, steps, written = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
idle_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.0
WIDTH = 1024
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Linear(WIDTH, WIDTH) for _ in range(max(1, mib // 4))])
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x = torch.randn(64, WIDTH)
for step in range(steps + 1):
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    if step == 0:
        open(written, "w").close()
time.sleep(idle_s)
print(f"loss {loss.item():.6f}")
