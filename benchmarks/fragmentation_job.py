"""One job of the fragmentation grid: a seeded MLP whose largest tensors are its wide
layers' activations (batch x width floats), narrow between them so that a large
tensor costs memory, not arithmetic.

    python benchmarks/fragmentation_job.py --width 256 --batch 4096 --depth 3 --steps 6 --seed 0

Run unchanged by `benchmarks/fragmentation.py` and tests/test_admission.py under
wwrun's launcher. Every random draw comes from its own torch.Generator.
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, required=True, help="the wide layers' width")
parser.add_argument("--batch", type=int, required=True)
parser.add_argument("--depth", type=int, default=1, help="wide layers")
parser.add_argument("--steps", type=int, default=6)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--device", default="cpu")
args = parser.parse_args()

NARROW, CLASSES = 8, 4
generator = torch.Generator().manual_seed(args.seed)
layers = []
for i in range(args.depth):
    layers += [nn.Linear(NARROW, args.width), nn.ReLU(), nn.Linear(args.width, NARROW)]
model = nn.Sequential(*layers, nn.Linear(NARROW, CLASSES))
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
model.to(args.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
for step in range(args.steps):
    x = torch.randn(args.batch, NARROW, generator=generator).to(args.device)
    y = torch.randint(0, CLASSES, (args.batch,), generator=generator).to(args.device)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.6f}")
