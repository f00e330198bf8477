"""Reads batches from 2 forked DataLoader workers until interrupted; with --tqdm,
through a progress bar (its iteration is on the stack the whole time)."""
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.full((4,), float(i))


loader = DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context="fork")
if "--tqdm" in sys.argv:
    from tqdm import tqdm

    loader = tqdm(loader)
for number, batch in enumerate(loader):
    if number == 2:
        print("ready", flush=True)
