"""Starts a non-daemon thread that never ends, then returns."""
import threading
import time


def spin():
    while True:
        time.sleep(0.05)


threading.Thread(target=spin).start()
print("ready", flush=True)
