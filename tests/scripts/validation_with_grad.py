"""A job that validates after every step without torch.no_grad(), as many scripts do:
each validation forward builds a graph that no backward frees; dropping its output
frees it, under `python` as under wwrun.

    python validation_with_grad.py STEPS VALIDATIONS"""
import sys

import torch
from torch import nn

steps, validations = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
# Sigmoid saves its output for backward: a node that keeps its own output.
model = nn.Sequential(nn.Linear(64, 1024), nn.ReLU(), nn.Linear(1024, 1024), nn.Sigmoid(), nn.Linear(1024, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(512, 64), torch.randn(512, 1)
for step in range(steps):
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    for _ in range(validations):
        score = ((model(x) - y) ** 2).mean().item()
print(f"loss {loss.item():.6f} score {score:.6f}")
