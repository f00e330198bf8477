"""Ends in the way its first argument says, after an optional delay."""
import atexit
import os
import signal
import sys
import time

how = sys.argv[1]
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
atexit.register(print, "atexit ran")
signal.signal(signal.SIGUSR1, lambda *_: None)  # would raise ValueError in a plain thread
print("before", how, flush=True)
if how == "exit3":
    sys.exit(3)
elif how == "exit256":  # the process's status is the code's low byte: 0
    sys.exit(256)
elif how == "exit_minus1":  # 255
    sys.exit(-1)
elif how == "exit_builtin":
    exit(4)
elif how == "exit_text":
    sys.exit("fatal: bad thing")
elif how == "raise":
    raise RuntimeError("boom in job")
elif how == "os_exit":
    os._exit(5)
elif how == "loop":
    try:
        print("ready", flush=True)  # inside the try: an interrupt from now on is caught
        while True:
            time.sleep(0.01)
    except KeyboardInterrupt:
        print("got KeyboardInterrupt", flush=True)
        raise
elif how == "stubborn":  # ignores the first interrupt
    ready = False
    while True:
        try:
            if not ready:
                print("ready", flush=True)
                ready = True
            time.sleep(0.01)
        except KeyboardInterrupt:
            print("ignoring KeyboardInterrupt", flush=True)
elif how == "graceful":  # its own SIGTERM handler: finish the step, then stop
    stop = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    print("ready", flush=True)
    while not stop:
        time.sleep(0.01)
    print(f"saving checkpoint after signal {stop[0]}", flush=True)
elif how == "orphan":  # leaves a child process behind
    import subprocess

    child = subprocess.Popen(["sleep", "60"])
    print("child pid", child.pid, flush=True)
print("after", how)
