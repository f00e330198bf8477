"""One fault, as its first argument says, for the fault matrix (tests/test_faults.py)."""
import os
import sys
import threading
import time

how = sys.argv[1]
print("fault", how, flush=True)
if how == "raise":
    raise RuntimeError("boom")
elif how == "exit3":
    sys.exit(3)
elif how == "os_exit":
    os._exit(5)
elif how == "keyboard_interrupt":
    raise KeyboardInterrupt
elif how == "memory_error":
    hog = bytearray(1 << 62)  # more than any machine has: MemoryError
elif how == "recursion":
    def down(n):
        return down(n + 1)
    down(0)
elif how == "chdir":
    os.chdir("/")
    print("moved to", os.getcwd())
elif how == "background_thread":  # its thread fails after the main body returned
    def work():
        time.sleep(0.2)
        raise RuntimeError("failed in the job's own thread")
    threading.Thread(target=work).start()
elif how == "hang":  # for a timeout
    while True:
        time.sleep(0.01)
