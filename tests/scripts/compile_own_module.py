"""Trains its own module through torch.compile; its forward reads builtins, which
dynamo installs in this script's globals and deletes itself once the compiled code
is collected (at the job's end under wwrun)."""

import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(16, 16) for _ in range(2)])

    def forward(self, x):
        for i in range(len(self.layers)):
            x = torch.relu(self.layers[i](x))
        return x


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
compiled = torch.compile(model)
x = torch.randn(8, 16)
for _ in range(3):
    loss = compiled(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
print(f"loss {loss.item():.8f}")
