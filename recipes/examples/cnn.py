"""Train a small CNN to tell the direction of stripes in synthetic noisy images.

    python cnn.py --epochs 2 --lr 0.05 --batch-size 64

A wwrun example: an ordinary training script that finishes in a few seconds on a
CPU and runs unchanged under `wwrun`. Each image is a sine grating (horizontal,
vertical or one of the two diagonals, random frequency and phase) under Gaussian
noise; the label is its direction. Every random draw comes from one
`torch.Generator` seeded by --seed, never from the global RNG, which all jobs of a
wwrun process share.
"""

import argparse
import math
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

DIRECTIONS = ("horizontal", "vertical", "diagonal", "antidiagonal")


class StripesDataset(Dataset):
    """`size` grayscale images (1, side, side) of sine gratings, labelled by direction."""

    def __init__(self, size: int, side: int, noise: float, generator: torch.Generator):
        rows, cols = torch.meshgrid(torch.arange(side), torch.arange(side), indexing="ij")
        # The coordinate each direction's stripes vary along, one map per label.
        along = torch.stack([rows, cols, rows + cols, rows - cols]).float()  # (4, H, W)
        self.labels = torch.randint(len(DIRECTIONS), (size,), generator=generator)  # (N,)
        frequency = 0.6 + 0.8 * torch.rand(size, 1, 1, generator=generator)  # radians per pixel
        phase = 2 * math.pi * torch.rand(size, 1, 1, generator=generator)
        images = torch.sin(frequency * along[self.labels] + phase)  # (N, H, W)
        images += noise * torch.randn(images.shape, generator=generator)
        self.images = images.unsqueeze(1)  # (N, 1, H, W)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        return self.images[index], self.labels[index]


class SmallCNN(nn.Module):
    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU(),
            nn.MaxPool2d(2),  # (B, C, H/2, W/2)
            nn.Conv2d(channels, 2 * channels, 3, padding=1), nn.BatchNorm2d(2 * channels), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),  # (B, 2C, 1, 1)
        )
        self.classifier = nn.Linear(2 * channels, classes)

    def forward(self, images):  # (B, 1, H, W) -> logits (B, classes)
        return self.classifier(self.features(images).flatten(1))


def init_weights(module: nn.Module, generator: torch.Generator) -> None:
    if isinstance(module, (nn.Conv2d, nn.Linear)):
        nn.init.kaiming_uniform_(module.weight, nonlinearity="relu", generator=generator)
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.BatchNorm2d):
        module.reset_parameters()  # also resets the running statistics


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3, help="passes over the training set")
    parser.add_argument("--lr", type=float, default=0.05, help="learning rate (SGD with momentum)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--channels", type=int, default=16, help="channels of the first convolution")
    parser.add_argument("--samples", type=int, default=2048, help="training images")
    parser.add_argument("--side", type=int, default=16, help="image height and width in pixels")
    parser.add_argument("--noise", type=float, default=2.0, help="standard deviation of the pixel noise")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--save", default=None, help="write the trained weights to this file")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    generator = torch.Generator().manual_seed(args.seed)

    train_set = StripesDataset(args.samples, args.side, args.noise, generator)
    eval_set = StripesDataset(max(256, args.samples // 4), args.side, args.noise, generator)
    loader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True, generator=generator)

    # Built on the meta device (no memory, no random draws), then initialized from
    # our generator: the global RNG would be shared with the other jobs.
    with torch.device("meta"):
        model = SmallCNN(args.channels, len(DIRECTIONS))
    model = model.to_empty(device="cpu")
    model.apply(lambda module: init_weights(module, generator))
    model = model.to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)

    first_loss = None
    start = time.perf_counter()
    for epoch in range(1, args.epochs + 1):
        model.train()
        losses = []
        for images, labels in loader:
            images, labels = images.to(device), labels.to(device)
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
            first_loss = losses[0] if first_loss is None else first_loss
        last_loss = sum(losses) / len(losses)

        model.eval()
        with torch.no_grad():
            predictions = model(eval_set.images.to(device)).argmax(dim=1)
            accuracy = (predictions == eval_set.labels.to(device)).float().mean().item()
        print(f"epoch {epoch}/{args.epochs}  loss {last_loss:.4f}  eval accuracy {accuracy:.1%}", flush=True)

    if args.save:
        torch.save(model.state_dict(), args.save)
    print(f"done: {args.epochs} epochs in {time.perf_counter() - start:.1f}s, "
          f"loss {first_loss:.4f} -> {last_loss:.4f}, eval accuracy {accuracy:.1%}", flush=True)


if __name__ == "__main__":
    main()
