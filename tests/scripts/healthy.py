"""A seeded training run whose output is exact (hex floats and a parameter checksum)."""
import torch

torch.set_num_threads(1)  # the same reductions alone and beside other jobs
generator = torch.Generator().manual_seed(1234)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
with torch.no_grad():
    for p in model.parameters():
        p.copy_(torch.randn(p.shape, generator=generator) * 0.1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
x = torch.randn(64, 32, generator=generator)
y = torch.randn(64, 1, generator=generator)
for step in range(30):
    loss = (model(x) - y).square().mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    print(step, loss.item().hex())
print("checksum", sum(p.double().sum().item() for p in model.parameters()).hex())
