"""Trains in a threading.Thread and returns at once; the thread writes the result, and
an atexit handler (run after the thread, as python does) reports it."""
import atexit
import os
import sys
import threading
import time


def train(path):
    time.sleep(0.5)  # the work
    with open(path, "w") as f:
        f.write("trained\n")
    print("result written", flush=True)


atexit.register(lambda: print("atexit sees the result:", os.path.exists(sys.argv[1]), flush=True))
threading.Thread(target=train, args=(sys.argv[1],)).start()
print("main returns", flush=True)
