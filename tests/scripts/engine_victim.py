"""Writes its process's id (its engine's) to MARK and waits to be killed with it
(bounded: fails after 60 s). Run again once MARK exists (a retry), it just succeeds."""

import os
import sys
import time

mark = sys.argv[1]
if os.path.exists(mark):
    print("again, elsewhere", flush=True)
    sys.exit(0)
with open(mark + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.replace(mark + ".tmp", mark)
print("waiting to be killed", flush=True)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    time.sleep(0.05)
sys.exit("never killed")
