"""Ends once FILE exists (bounded: fails after 60 s)."""

import os
import sys
import time

deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]):
    if time.monotonic() > deadline:
        sys.exit("never saw " + sys.argv[1])
    time.sleep(0.01)
print("done")
