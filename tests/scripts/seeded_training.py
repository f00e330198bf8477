"""A tiny seeded training run that draws from every default random source: torch's
generator (init, randn, dropout, DataLoader shuffling, random_split), Python's
`random` and numpy's global state. Writes its losses, as exact float reprs, to a file.

    python seeded_training.py SEED {mlp,conv} OUT.json
"""

import json
import random
import sys

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset, random_split

seed, variant, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
torch.set_num_threads(1)
torch.manual_seed(seed)
random.seed(seed)
np.random.seed(seed)

x = torch.randn(96, 1, 4, 4)
y = torch.randn(96, 1)
train, _ = random_split(TensorDataset(x, y), [64, 32])
loader = DataLoader(train, batch_size=16, shuffle=True)
if variant == "mlp":
    model = nn.Sequential(nn.Flatten(), nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.3), nn.Linear(32, 1))
else:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Dropout2d(0.2), nn.Flatten(), nn.Linear(16, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
losses = []
for epoch in range(4):
    for xb, yb in loader:
        jitter = random.gauss(0, 1e-3) + float(np.random.normal(0, 1e-3))
        loss = ((model(xb + jitter) - yb) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
with open(out, "w") as f:
    json.dump({"losses": [repr(v) for v in losses], "initial_seed": torch.initial_seed()}, f)
