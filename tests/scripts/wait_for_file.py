"""Ends once every FILE exists (bounded: fails after 60 s), LINGER seconds later.

Usage: wait_for_file.py FILE... [--linger SECONDS]
"""

import os
import sys
import time

files, linger = sys.argv[1:], 0.0
if "--linger" in files:
    at = files.index("--linger")
    linger = float(files[at + 1])
    del files[at:at + 2]
deadline = time.monotonic() + 60
while not all(os.path.exists(path) for path in files):
    if time.monotonic() > deadline:
        sys.exit("never saw " + " and ".join(files))
    time.sleep(0.01)
time.sleep(linger)
print("done")
