"""Trains in a threading.Thread and returns at once; the thread writes the result."""
import sys
import threading
import time


def train(path):
    time.sleep(0.5)  # the work
    with open(path, "w") as f:
        f.write("trained\n")
    print("result written", flush=True)


threading.Thread(target=train, args=(sys.argv[1],)).start()
print("main returns", flush=True)
