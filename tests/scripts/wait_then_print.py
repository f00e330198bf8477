"""Waits until a file exists, then prints.  usage: wait_then_print.py FILE TEXT"""

import os
import sys
import time

deadline = time.monotonic() + 120
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.01)
print(sys.argv[2], flush=True)
