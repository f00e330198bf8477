"""Forks while half_made_importer.py's job is half-way through importing half_made,
and imports half_made in the child, as a pool worker unpickling its task does.

usage: fork_during_import.py RENDEZVOUS"""

import os
import signal
import sys
import time

folder = sys.argv[1]
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(folder, "importing")) and time.monotonic() < deadline:
    time.sleep(0.01)
open(os.path.join(folder, "forking"), "w").close()
pid = os.fork()
if pid == 0:
    try:
        import half_made
        os._exit(0 if half_made.VALUE == 42 else 1)
    finally:
        os._exit(2)
deadline = time.monotonic() + 30
while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
    time.sleep(0.05)
if done[0] == 0:
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    print("child still waiting after 30 s")
else:
    print("child exit", os.waitstatus_to_exitcode(done[1]))
