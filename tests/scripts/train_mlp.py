"""A small training loop whose activation memory is set by --width and --batch."""
import argparse

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--steps", type=int, default=20)
args = parser.parse_args()

generator = torch.Generator().manual_seed(0)
layers = []
for _ in range(4):
    layers += [torch.nn.Linear(args.width, args.width), torch.nn.ReLU()]
model = torch.nn.Sequential(*layers)
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(args.batch, args.width, generator=generator)
for step in range(args.steps):
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"final loss {loss.item():.6f}")
