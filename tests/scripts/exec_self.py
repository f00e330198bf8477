"""Ends by an exec (a script handing over to another program) or by os._exit; an
atexit handler that neither runs.

    exec_self.py exec    os.execv into a Python that reports its folder and TAG, and exits 5
    exec_self.py _exit   os._exit(3)
"""

import atexit
import os
import sys

atexit.register(lambda: print("atexit ran", flush=True))
print("before", flush=True)
if sys.argv[1] == "exec":
    os.execv(sys.executable, [sys.executable, "-c", "import os, sys; "
              "print('exec:', os.path.basename(os.getcwd()), os.environ.get('TAG')); sys.exit(5)"])
os._exit(3)
