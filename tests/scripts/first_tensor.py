"""Two roles around a job's first tensor.

    first_tensor.py hold FOLDER     takes memory, writes FOLDER/held, never steps (up to 60 s)
    first_tensor.py guarded FOLDER  once FOLDER/held exists, makes its first tensor,
                                    saying if a KeyboardInterrupt reached it there"""
import os
import sys
import time

import torch

role, held = sys.argv[1], os.path.join(sys.argv[2], "held")
deadline = time.monotonic() + 60
if role == "hold":
    hoard = torch.ones(1 << 20)
    open(held, "w").close()
    while time.monotonic() < deadline:
        time.sleep(0.02)
    sys.exit("never interrupted")
while not os.path.exists(held):
    if time.monotonic() > deadline:
        sys.exit("the holder never held")
    time.sleep(0.01)
try:
    first = torch.ones(1 << 20)
except KeyboardInterrupt:
    print("KeyboardInterrupt at the first tensor", flush=True)
    raise
print("made its first tensor")
