"""A job whose script ends while a thread it started still holds MIB MiB for SECONDS
(a writer thread flushing its last batch): the memory outlives the job's end for a
moment, as under `python` until the process exits. Writes FILE as its script ends.

    python leaves_memory_behind.py MIB SECONDS FILE"""
import sys
import threading
import time

import torch

mib, seconds, written = int(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
held = torch.ones((mib << 20) // 4)
threading.Thread(target=lambda tensor: time.sleep(seconds), args=(held,), daemon=True).start()
del held
open(written, "w").close()
print("done")
