"""os.fork() directly: one child ends with sys.exit(3), the next by reaching the end
of the script; the parent waits for each and prints its exit code."""

import os
import sys

pid = os.fork()
if pid == 0:
    sys.exit(3)
print("first child:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), flush=True)
pid = os.fork()
if pid:
    print("second child:", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
