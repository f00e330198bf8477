"""Uses a model the engine adopted the ways scripts do: pickle, torch.save, deepcopy,
TorchScript, tracing and export. Prints one line per use: `<use> ok` or the error."""

import copy
import io
import pickle

import torch

g = torch.Generator().manual_seed(0)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 32)
        self.b = torch.nn.Linear(32, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(8, 16, generator=g)
for _ in range(3):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()


def no_hooks(m):
    left = [name for name, sub in m.named_modules() if sub._forward_pre_hooks or sub._forward_hooks]
    assert not left, f"hooks on {left}"


uses = {
    "pickle": lambda: pickle.loads(pickle.dumps(model))(x),
    "torch.save": lambda: torch.load(io.BytesIO(_saved()), weights_only=False)(x),
    "deepcopy": lambda: no_hooks(copy.deepcopy(model)),
    "hooks": lambda: no_hooks(model),
    "state_dict": lambda: Net().load_state_dict(model.state_dict()),
    "jit.script": lambda: torch.jit.script(model)(x),
    "jit.trace": lambda: torch.jit.trace(model, x)(x),
    "export": lambda: torch.export.export(model, (x,)).module()(x),
}


def _saved():
    buffer = io.BytesIO()
    torch.save(model, buffer)
    return buffer.getvalue()


for name, use in uses.items():
    try:
        use()
        print(f"{name} ok")
    except Exception as error:  # noqa: BLE001 - the line names what failed
        print(f"{name} failed: {type(error).__name__}: {error}")
