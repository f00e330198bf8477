"""A loop under torch.profiler; prints which of two ops its profile saw.

    profiled.py mm|sin
"""

import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

x = torch.randn(64, 64)
with profile(activities=[ProfilerActivity.CPU]) as prof:
    for _ in range(20):
        y = x @ x if sys.argv[1] == "mm" else torch.sin(x)
        time.sleep(0.01)
names = {event.key for event in prof.key_averages()}
print(sys.argv[1], "saw aten::mm", "aten::mm" in names, "aten::sin", "aten::sin" in names)
