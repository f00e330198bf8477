"""Holds N MiB on the GPU and reports what torch.cuda says this job uses."""
import sys
import time

import torch

mib = int(sys.argv[1])
held = torch.empty(mib * 2**20, dtype=torch.uint8, device="cuda")
time.sleep(1.0)  # both jobs hold their memory now
print(f"allocated={torch.cuda.memory_allocated()} max={torch.cuda.max_memory_allocated()}", flush=True)
