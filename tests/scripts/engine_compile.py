"""Trains a small model through torch.compile; prints its losses."""

import torch

g = torch.Generator().manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model)
x = torch.randn(8, 16, generator=g)
losses = []
for _ in range(4):
    loss = compiled(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())
print("losses", " ".join(f"{v:.8f}" for v in losses))
