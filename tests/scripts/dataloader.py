"""A Dataset defined in the script, read by 2 DataLoader workers."""
import argparse
import os

import torch
from torch.utils.data import DataLoader, Dataset


class Squares(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor(float(i * i))


def report(worker_id):
    print(f"worker {worker_id} job={os.environ['WWRUN_JOB_NAME']} cwd={os.getcwd()}", flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--context", default="fork")
    args = parser.parse_args()
    loader = DataLoader(Squares(), batch_size=4, num_workers=2, worker_init_fn=report,
                        multiprocessing_context=args.context)
    total = sum(batch.sum().item() for batch in loader)
    print(f"total={total:.0f}")
