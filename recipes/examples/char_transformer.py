"""Train a small character-level transformer (a tiny GPT) on Shakespeare's sonnets.

    python char_transformer.py --steps 200 --lr 3e-3 --batch-size 32

A wwrun example: an ordinary training script that finishes in a few seconds on a
CPU and runs unchanged under `wwrun`. The model follows nanoGPT's decoder blocks
(pre-norm causal self-attention and an MLP); the text, a few of the sonnets
(1609, public domain), lies next to this file in data/sonnets.txt. Every random
draw comes from one `torch.Generator` seeded by --seed, never from the global RNG,
which all jobs of a wwrun process share.
"""

import argparse
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

DEFAULT_TEXT = Path(__file__).resolve().parent / "data" / "sonnets.txt"


class CharDataset(Dataset):
    """Every window of `block` characters, with the same window shifted by one as target."""

    def __init__(self, text: str, block: int):
        self.alphabet = sorted(set(text))
        self.index_of = {char: i for i, char in enumerate(self.alphabet)}
        self.data = torch.tensor([self.index_of[char] for char in text])  # (len(text),)
        self.block = block

    def __len__(self):
        return len(self.data) - self.block

    def __getitem__(self, start):
        window = self.data[start : start + self.block + 1]
        return window[:-1], window[1:]  # (T,), (T,)

    def decode(self, indices) -> str:
        return "".join(self.alphabet[i] for i in indices)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        batch, time_, width = x.shape  # (B, T, C)
        q, k, v = self.qkv(x).split(width, dim=2)
        # (B, T, C) -> (B, heads, T, C / heads)
        q, k, v = (t.view(batch, time_, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(batch, time_, width))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = CausalSelfAttention(width, heads)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x):
        x = x + self.attention(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class CharTransformer(nn.Module):
    def __init__(self, vocab: int, block: int, width: int, heads: int, layers: int):
        super().__init__()
        self.block = block
        self.token = nn.Embedding(vocab, width)
        self.position = nn.Embedding(block, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(layers)))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens):  # (B, T) -> logits (B, T, vocab)
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.token(tokens) + self.position(positions)
        return self.head(self.norm(self.blocks(x)))

    @torch.no_grad()
    def generate(self, tokens, count: int, generator: torch.Generator):
        """Extend `tokens` (1, T) by `count` sampled characters."""
        for _ in range(count):
            logits = self(tokens[:, -self.block :])[:, -1]  # (1, vocab)
            probabilities = F.softmax(logits.float().cpu(), dim=-1)
            following = torch.multinomial(probabilities, 1, generator=generator).to(tokens.device)
            tokens = torch.cat([tokens, following], dim=1)
        return tokens


def init_weights(module: nn.Module, generator: torch.Generator) -> None:
    """GPT-2's initialization, drawn from `generator`."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02, generator=generator)
    if isinstance(module, nn.Linear):
        nn.init.zeros_(module.bias)
    if isinstance(module, nn.LayerNorm):
        module.reset_parameters()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps")
    parser.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW, cosine decay)")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--block", type=int, default=64, help="context length in characters")
    parser.add_argument("--width", type=int, default=64, help="embedding width")
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--text", default=str(DEFAULT_TEXT), help="a UTF-8 text file to learn")
    parser.add_argument("--sample", type=int, default=120, help="characters to generate at the end")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu or cuda")
    parser.add_argument("--log-every", type=int, default=0, help="steps between progress lines (0: 10 lines)")
    parser.add_argument("--save", default=None, help="write the trained weights to this file")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    device = pick_device(args.device)
    generator = torch.Generator().manual_seed(args.seed)

    data = CharDataset(Path(args.text).read_text(encoding="utf-8"), args.block)
    loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, drop_last=True,
                        generator=generator)
    print(f"{len(data.data)} characters, alphabet of {len(data.alphabet)}", flush=True)

    # Built on the meta device (no memory, no random draws), then initialized from
    # our generator: the global RNG would be shared with the other jobs.
    with torch.device("meta"):
        model = CharTransformer(len(data.alphabet), args.block, args.width, args.heads, args.layers)
    model = model.to_empty(device="cpu")
    model.apply(lambda module: init_weights(module, generator))
    model = model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * step / args.steps))
    )

    log_every = args.log_every or max(1, args.steps // 10)
    step, first_loss, window = 0, None, []
    start = time.perf_counter()
    model.train()
    while step < args.steps:
        for inputs, targets in loader:
            inputs, targets = inputs.to(device), targets.to(device)  # (B, T) each
            logits = model(inputs)  # (B, T, vocab)
            loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            schedule.step()

            step += 1
            window.append(loss.item())
            first_loss = window[0] if first_loss is None else first_loss
            if step % log_every == 0 or step == args.steps:
                last_loss, window = sum(window) / len(window), []
                print(f"step {step:5d}/{args.steps}  loss {last_loss:.4f}  "
                      f"lr {schedule.get_last_lr()[0]:.2e}", flush=True)
            if step == args.steps:
                break

    model.eval()
    if args.sample > 0:
        prompt = torch.tensor([[data.index_of[char] for char in "Shall"]], device=device)
        print("sample:", repr(data.decode(model.generate(prompt, args.sample, generator)[0].tolist())))
    if args.save:
        torch.save(model.state_dict(), args.save)
    print(f"done: {args.steps} steps in {time.perf_counter() - start:.1f}s, "
          f"loss {first_loss:.4f} -> {last_loss:.4f}", flush=True)


if __name__ == "__main__":
    main()
