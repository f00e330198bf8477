"""Signals a script handles itself (or not).

    signals.py handler FLAG   its SIGUSR1 handler, then creates FLAG and waits for SIGUSR1
    signals.py default FLAG   creates FLAG and works on: SIGUSR1's default action ends it
    signals.py self           SIGUSR1 to its own process, with a handler
    signals.py alarm          a step timeout: alarm(1) with a handler that raises
"""

import os
import signal
import sys
import time

mode = sys.argv[1]
print("fresh:", signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT) is signal.default_int_handler,
      flush=True)
deadline = time.monotonic() + 60
got = []
if mode in ("handler", "self"):
    signal.signal(signal.SIGUSR1, lambda signum, frame: got.append(signum))
if mode == "self":
    os.kill(os.getpid(), signal.SIGUSR1)
if mode in ("handler", "default"):
    open(sys.argv[2], "w").close()
if mode == "alarm":
    def too_long(signum, frame):
        raise TimeoutError("step took too long")

    signal.signal(signal.SIGALRM, too_long)
    signal.alarm(1)
    try:
        while time.monotonic() < deadline:  # a step's work
            time.sleep(0.01)
    except TimeoutError as err:
        print("timed out:", err, "alarm left:", signal.alarm(0))
    signal.alarm(30)  # left set at the end: it ends with the script
else:
    while not got and time.monotonic() < deadline:  # a training loop's steps
        time.sleep(0.01)
    print("handled", got)
