"""Prints how many intra-op threads torch gives this job's ops."""
import torch

print(f"torch threads {torch.get_num_threads()}")
