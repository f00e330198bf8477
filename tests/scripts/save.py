"""Saves a checkpoint to the path given (relative to its working folder)."""

import sys

import torch

torch.save({"job": sys.argv[2]}, sys.argv[1])
print("saved", sys.argv[1])
