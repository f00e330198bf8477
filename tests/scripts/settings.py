"""Sets process-wide torch and logging settings to values of its own.

usage: settings.py PRECISION BENCHMARK LEVEL"""

import logging
import sys

import torch

torch.set_float32_matmul_precision(sys.argv[1])
torch.backends.cudnn.benchmark = sys.argv[2] == "on"
logging.basicConfig(level=sys.argv[3])
print("set")
