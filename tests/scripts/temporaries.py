"""A job whose forward makes a large temporary that backward does not keep: a
gating scale computed without grad from each row's outer product (batch x width x
width floats), then dropped. Saved-tensor accounting does not see it; the
allocator does."""
import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--batch", type=int, default=256)
parser.add_argument("--steps", type=int, default=8)
args = parser.parse_args()


class Gated(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        with torch.no_grad():
            outer = x.unsqueeze(2) * x.unsqueeze(1)  # the large temporary
            scale = outer.abs().mean(dim=(1, 2)).unsqueeze(1)
            del outer
        return torch.relu(self.lin(x)) * scale


torch.manual_seed(0)
model = nn.Sequential(Gated(args.width), Gated(args.width), nn.Linear(args.width, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
x, y = torch.randn(args.batch, args.width), torch.randn(args.batch, 1)
for step in range(args.steps):
    loss = ((model(x) - y) ** 2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"loss {loss.item():.6f}")
