"""A seeded residual MLP for benchmarks/offload.py: its saved activations grow with
--batch. Prints each step's loss (hex, exact) and, last, the median step time after
two warm-up steps."""
import argparse
import statistics
import time

import torch

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--depth", type=int, default=12)
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--steps", type=int, default=6)
args = parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.act = torch.nn.GELU()

    def forward(self, x):
        return self.act(self.linear(x)) + x


generator = torch.Generator().manual_seed(0)
model = torch.nn.Sequential(*(Block(args.width) for _ in range(args.depth)))
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(args.batch, args.width, generator=generator)
times = []
for step in range(args.steps):
    began = time.perf_counter()
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    times.append(time.perf_counter() - began)
    print(f"step {step} loss {loss.item().hex()}", flush=True)
print(f"step_s {statistics.median(times[2:] or times)}")
