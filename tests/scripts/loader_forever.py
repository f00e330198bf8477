"""Reads batches from 2 forked DataLoader workers until interrupted."""
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __len__(self):
        return 1_000_000

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.full((4,), float(i))


for number, batch in enumerate(DataLoader(Slow(), batch_size=4, num_workers=2, multiprocessing_context="fork")):
    if number == 2:
        print("ready", flush=True)
