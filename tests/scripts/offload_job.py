"""A seeded MLP whose saved activations are set by --width, --depth and --batch; prints
every step's loss exactly (hex), so that runs with and without offload can be compared.

--checkpoint  the middle blocks run under torch.utils.checkpoint
--eval        a no_grad pass after every step
--shapes      the batch alternates between --batch and half of it
--thread      the training loop runs in a thread the script starts
--time        last, the median step time after two warm-up steps (benchmarks/offload.py)
--adam        Adam rather than SGD: optimizer state, twice the parameters, from the first step
"""
import argparse
import statistics
import threading
import time

import torch
from torch.utils.checkpoint import checkpoint

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--depth", type=int, default=8)
parser.add_argument("--batch", type=int, default=64)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--checkpoint", action="store_true")
parser.add_argument("--eval", action="store_true")
parser.add_argument("--shapes", action="store_true")
parser.add_argument("--thread", action="store_true")
parser.add_argument("--time", action="store_true")
parser.add_argument("--adam", action="store_true")
args = parser.parse_args()


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.linear = torch.nn.Linear(width, width)
        self.act = torch.nn.GELU()

    def forward(self, x):
        return self.act(self.linear(x)) + x


class Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(args.width) for _ in range(args.depth))

    def forward(self, x):
        middle = range(args.depth // 4, args.depth // 2) if args.checkpoint else ()
        for i, block in enumerate(self.blocks):
            x = checkpoint(block, x, use_reentrant=False) if i in middle else block(x)
        return x


generator = torch.Generator().manual_seed(0)
model = Model()
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
optimizer = (torch.optim.Adam(model.parameters(), lr=1e-3) if args.adam
             else torch.optim.SGD(model.parameters(), lr=0.01))
data = torch.randn(args.batch, args.width, generator=generator)


def train():
    times = []
    for step in range(args.steps):
        began = time.perf_counter()
        x = data[: args.batch // 2] if args.shapes and step % 2 else data
        loss = model(x).square().mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - began)
        print(f"step {step} loss {loss.item().hex()}", flush=True)
        if args.eval:
            with torch.no_grad():
                print(f"step {step} eval {model(data).square().mean().item().hex()}", flush=True)
    if args.time:
        print(f"step_s {statistics.median(times[2:] or times)}")


if args.thread:
    worker = threading.Thread(target=train)
    worker.start()
    worker.join()
else:
    train()
