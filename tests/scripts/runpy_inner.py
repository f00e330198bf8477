"""Run by runpy_outer.py as __main__: pickles a class of its own, then creates FLAG
and waits for DONE (another job's check) before it ends."""

import os
import pickle
import sys
import time


class Inner:
    pass


print("inner:", os.path.basename(sys.modules["__main__"].__file__), type(pickle.loads(pickle.dumps(Inner()))).__name__)
open(sys.argv[1], "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[2]) and time.monotonic() < deadline:
    time.sleep(0.01)
