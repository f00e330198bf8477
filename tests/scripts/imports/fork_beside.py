"""Forks once the file AFTER is made, saying so first with the file MARK; the child
exits 0. With filelock imported, as torch.compile, triton and the Hugging Face
libraries import it.

usage: fork_beside.py RENDEZVOUS AFTER MARK [DELAY_S]"""

import os
import sys
import time

import filelock  # noqa: F401 - its fork audit hook is what this meets

folder, after, mark = sys.argv[1:4]
deadline = time.monotonic() + 60
while not os.path.exists(os.path.join(folder, after)) and time.monotonic() < deadline:
    time.sleep(0.01)
time.sleep(float(sys.argv[4]) if len(sys.argv) > 4 else 0)  # the other fork is under way by then
open(os.path.join(folder, mark), "w").close()
pid = os.fork()
if pid == 0:
    os._exit(0)
print("child exit", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
