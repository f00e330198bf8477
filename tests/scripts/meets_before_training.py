"""Setup that waits for the other jobs' setup, then a small training loop.

    meets_before_training.py FOLDER COUNT NAME

Before any tensor exists, writes FOLDER/NAME and waits until COUNT such files are
there (bounded: exits with an error after 60 s), as a job's data loading would run
beside the others' under `python`; then trains and prints its loss."""
import os
import sys
import time

folder, count, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
with open(os.path.join(folder, name), "w"):
    pass
deadline = time.monotonic() + 60
while len(os.listdir(folder)) < count:
    if time.monotonic() > deadline:
        sys.exit(f"{name}: only {sorted(os.listdir(folder))} of {count} jobs set up within 60 s")
    time.sleep(0.01)

import torch  # noqa: E402

torch.manual_seed(0)
generator = torch.Generator().manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(128, 64, generator=generator)
for step in range(5):
    loss = model(x).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print(f"final loss {loss.item():.6f}")
