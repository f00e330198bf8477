"""Two patterns of real training scripts (pytorch/examples): LBFGS, whose step runs
its closure's forward and backward several times (time_sequence_prediction), and
weights updated by hand with no optimizer (word_language_model). Prints each pass's
loss.

    python steps_by_closure_or_hand.py lbfgs|by_hand [--width W] [--batch B] [--steps N]
"""

import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("kind", choices=["lbfgs", "by_hand"])
parser.add_argument("--width", type=int, default=256)
parser.add_argument("--batch", type=int, default=2048)
parser.add_argument("--steps", type=int, default=3)
args = parser.parse_args()

g = torch.Generator().manual_seed(7)
model = nn.Sequential(nn.Linear(32, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
                      nn.Linear(args.width, 10))
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=g) * 0.05)
x = torch.randn(args.batch, 32, generator=g)
y = torch.randint(0, 10, (args.batch,), generator=g)


def loss_and_backward():
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    print(f"loss {loss.item():.8f}")
    return loss


if args.kind == "lbfgs":
    optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4, history_size=3)

    def closure():
        optimizer.zero_grad()
        return loss_and_backward()

    for _ in range(args.steps):
        optimizer.step(closure)
else:
    for _ in range(args.steps):
        model.zero_grad()
        loss_and_backward()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-0.1)
