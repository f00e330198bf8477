"""A training script's progress bar (tqdm on stderr), then its last line; with
--control, that line carries cursor-moving control sequences."""

import sys
import time

from tqdm import tqdm

for _ in tqdm(range(30), desc="epoch 0", mininterval=0):
    time.sleep(0.01)
print("tick\x1b[7A\x1b[7A" if "--control" in sys.argv else "done", flush=True)
