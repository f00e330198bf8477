"""Imports its sibling `model`, saves the whole model and loads it back."""
import sys
import time

import torch
from model import WHO, Net

time.sleep(0.2)  # overlap with the other job
net = Net()
torch.save(net, sys.argv[1])
loaded = torch.load(sys.argv[1], weights_only=False)
print(f"who={WHO} in_features={loaded.layer.in_features} module={type(loaded).__module__}")
