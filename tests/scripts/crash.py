"""A C-level crash (a null pointer read) after a short delay, as a buggy extension would."""
import ctypes
import sys
import time

time.sleep(float(sys.argv[1]) if len(sys.argv) > 1 else 0)
print("about to crash", flush=True)
ctypes.string_at(0)
