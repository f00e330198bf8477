"""Train a small MLP to classify synthetic points labelled by a random "teacher" network.

    python mlp.py --steps 300 --lr 0.05 --batch-size 64

A wwrun example: an ordinary training script (argparse, a model class, a Dataset
and a DataLoader, an optimizer, a train loop) that finishes in a few seconds on a
CPU and runs unchanged under `wwrun`. Every random draw comes from one
`torch.Generator` seeded by --seed, never from the global RNG, which all jobs of a
wwrun process share: a job's results do not depend on what runs beside it.
"""

import argparse
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, random_split


class TeacherDataset(Dataset):
    """Points x ~ N(0, I) labelled by a fixed random two-layer network: learnable,
    but not linearly separable."""

    def __init__(self, size: int, features: int, classes: int, generator: torch.Generator):
        self.inputs = torch.randn(size, features, generator=generator)  # (N, F)
        hidden = torch.randn(features, 8, generator=generator) / features**0.5
        readout = torch.randn(8, classes, generator=generator)
        self.labels = (torch.tanh(self.inputs @ hidden) @ readout).argmax(dim=1)  # (N,)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.inputs[index], self.labels[index]


class MLP(nn.Module):
    def __init__(self, features: int, hidden: int, classes: int, depth: int):
        super().__init__()
        layers, width = [], features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.ReLU()]
            width = hidden
        layers.append(nn.Linear(width, classes))
        self.net = nn.Sequential(*layers)

    def forward(self, x):
        return self.net(x)  # (B, F) -> (B, classes)


def init_weights(module: nn.Module, generator: torch.Generator) -> None:
    if isinstance(module, nn.Linear):
        nn.init.kaiming_uniform_(module.weight, nonlinearity="relu", generator=generator)
        nn.init.zeros_(module.bias)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (SGD with momentum)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--hidden", type=int, default=128, help="width of each hidden layer")
    parser.add_argument("--depth", type=int, default=2, help="number of hidden layers")
    parser.add_argument("--samples", type=int, default=4096, help="size of the synthetic data set")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--log-every", type=int, default=0, help="steps between progress lines (0: 10 lines)")
    parser.add_argument("--save", default=None, help="write the trained weights to this file")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    generator = torch.Generator().manual_seed(args.seed)
    features, classes = 16, 4

    data = TeacherDataset(args.samples, features, classes, generator)
    train_set, eval_set = random_split(data, [0.8, 0.2], generator=generator)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=generator)

    # Built on the meta device (no memory, no random draws), then initialized from
    # our generator: the global RNG would be shared with the other jobs.
    with torch.device("meta"):
        model = MLP(features, args.hidden, classes, args.depth)
    model = model.to_empty(device="cpu")
    model.apply(lambda module: init_weights(module, generator))
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    log_every = args.log_every or max(1, args.steps // 10)
    step, first_loss, window = 0, None, []
    start = time.perf_counter()
    model.train()
    while step < args.steps:
        for inputs, labels in loader:
            inputs, labels = inputs.to(device), labels.to(device)
            loss = F.cross_entropy(model(inputs), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()

            step += 1
            window.append(loss.item())
            first_loss = window[0] if first_loss is None else first_loss
            if step % log_every == 0 or step == args.steps:
                last_loss, window = sum(window) / len(window), []
                print(f"step {step:5d}/{args.steps}  loss {last_loss:.4f}", flush=True)
            if step == args.steps:
                break

    model.eval()
    with torch.no_grad():
        inputs, labels = (torch.stack(tensors).to(device) for tensors in zip(*eval_set))
        accuracy = (model(inputs).argmax(dim=1) == labels).float().mean().item()
    if args.save:
        torch.save(model.state_dict(), args.save)
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s, "
          f"loss {first_loss:.4f} -> {last_loss:.4f}, eval accuracy {accuracy:.1%}", flush=True)


if __name__ == "__main__":
    main()
