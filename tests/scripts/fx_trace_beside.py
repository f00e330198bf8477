"""`trace DIR` traces a module with torch.fx and, mid-trace, waits for DIR/checked;
`eager DIR` compiles a function, writes DIR/compiled, waits until the other job is
mid-trace (DIR/tracing), then calls a module and its compiled function and says what
it saw, and writes DIR/checked."""

import os
import sys
import time

import torch
import torch.fx._symbolic_trace as symbolic_trace

role, folder = sys.argv[1], sys.argv[2]


def wait_for(name: str) -> None:
    deadline = time.monotonic() + 60
    while not os.path.exists(os.path.join(folder, name)):
        if time.monotonic() > deadline:
            sys.exit(f"waited 60 s for {name}")
        time.sleep(0.01)


def touch(name: str) -> None:
    open(os.path.join(folder, name), "w").close()


class WaitsMidTrace(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        touch("tracing")
        wait_for("checked")
        return self.linear(x).relu()


if role == "trace":
    wait_for("compiled")  # the other job's compile is done: a compile waits for a trace
    graph = torch.fx.symbolic_trace(WaitsMidTrace()).graph
    print("traced", [node.op for node in graph.nodes])
else:
    linear = torch.nn.Linear(4, 4)
    double = torch.compile(lambda x: x * 2 + 1, backend="eager")
    double(torch.ones(2))
    touch("compiled")
    wait_for("tracing")
    try:
        print("fx tracing here:", symbolic_trace.is_fx_tracing(), symbolic_trace.is_fx_symbolic_tracing())
        print("module gives", type(linear(torch.ones(2, 4))).__name__)
        print("compiled function gives", double(torch.ones(2)).tolist())
    finally:
        touch("checked")
