"""`compile DIR` holds a torch.compile session open (its backend waits for DIR/done);
`train DIR` runs three seeded AdamW steps (beside: once that session is open) and
writes DIR/done."""

import os
import sys
import time

import torch

role, folder = sys.argv[1], sys.argv[2]


def wait_for(name: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            sys.exit(f"waited 60 s for {name}")
        time.sleep(0.01)


if role == "compile":
    def backend(graph, example_inputs):
        print("compiling: is_compiling", torch.compiler.is_compiling(), flush=True)
        open(os.path.join(folder, "compiling"), "w").close()
        wait_for("done")
        return graph.forward

    torch.compile(lambda x: x * 2, backend=backend)(torch.ones(2))
else:
    if role == "train-beside":
        wait_for("compiling")
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(8, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
    print("training: is_compiling", torch.compiler.is_compiling())
    print("weights", [repr(w) for w in model.weight.flatten().tolist()])
    open(os.path.join(folder, "done"), "w").close()
