import time

import torch

time.sleep(0.2)
print(f"threads={torch.get_num_threads()}")
