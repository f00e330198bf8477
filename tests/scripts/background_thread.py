"""Trains in a thread and returns at once, as `python` would wait for the thread.

usage: background_thread.py RESULT_FILE"""

import sys
import threading
import time

import torch


def train(path):
    time.sleep(0.5)  # still running when the script's last line has run
    weight = torch.ones(3).sum().item()
    with open(path, "w") as f:
        f.write(f"trained {weight}")
    print("thread done")


worker = threading.Thread(target=train, args=(sys.argv[1],))
helper = threading.Thread(target=time.sleep, args=(0,), daemon=True)
print(f"daemon worker={worker.daemon} helper={helper.daemon}")
worker.start()
helper.start()
