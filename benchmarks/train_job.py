"""One benchmark job: an MLP trained on synthetic data, an ordinary script for `wwrun`.

    python benchmarks/train_job.py --width 128 --batch 2048 --steps 40 --seed 0

Run unchanged by `benchmarks/waterwave.py` under the launcher (`wwrun --policy ...`)
and as a plain `python` process. Every random draw comes from its own
torch.Generator, never the global RNG that all jobs of a wwrun process share.
Prints, last, one JSON line with the wall-clock start and end of the training loop
(time.time(), comparable across processes), after --warmup untimed steps, so that
interpreter start-up, imports and first-step costs, which differ between a thread of
a warm launcher and a fresh process, stay out of the comparison.
"""

import argparse
import json
import os
import sys
import tempfile
import time

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--width", type=int, default=128)
parser.add_argument("--batch", type=int, default=2048)
parser.add_argument("--steps", type=int, default=40)
parser.add_argument("--seed", type=int, default=0)
parser.add_argument("--device", default="cpu")
parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (lazy inits, allocator warm-up)")
parser.add_argument("--start-together", metavar="DIR:N",
                    help="after the warm-up, leave a file in DIR and wait until N jobs have: a common "
                         "start of the timed loops, for processes and for threads of one wwrun run alike")
args = parser.parse_args()

INPUTS, CLASSES = 32, 10
generator = torch.Generator().manual_seed(args.seed)
model = nn.Sequential(
    nn.Linear(INPUTS, args.width), nn.ReLU(), nn.Linear(args.width, args.width), nn.ReLU(),
    nn.Linear(args.width, args.width), nn.ReLU(), nn.Linear(args.width, CLASSES),
)
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
model.to(args.device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)



def step():
    x = torch.randn(args.batch, INPUTS, generator=generator).to(args.device)
    y = torch.randint(0, CLASSES, (args.batch,), generator=generator).to(args.device)
    loss = nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss


for _ in range(args.warmup):
    step()
if args.start_together:
    folder, parties = args.start_together.rsplit(":", 1)
    os.close(tempfile.mkstemp(dir=folder)[0])
    deadline = time.monotonic() + 300
    while len(os.listdir(folder)) < int(parties):
        if time.monotonic() > deadline:
            sys.exit(f"--start-together: {len(os.listdir(folder))} of {parties} jobs ready after 300 s")
        time.sleep(0.005)
start = time.time()
for _ in range(args.steps):
    loss = step()
final = loss.item()  # waits for the device
print(json.dumps({"start": start, "end": time.time(), "loss": final, "threads": torch.get_num_threads()}))
