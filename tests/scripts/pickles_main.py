"""Once FLAG exists, pickles a class of its own script (its __main__), then creates DONE.
usage: pickles_main.py FLAG DONE"""

import os
import pickle
import sys
import time


class Mine:
    pass


deadline = time.monotonic() + 60
while not os.path.exists(sys.argv[1]) and time.monotonic() < deadline:
    time.sleep(0.01)
import __main__  # noqa: E402

print("mine:", os.path.basename(__main__.__file__), type(pickle.loads(pickle.dumps(Mine()))).__name__)
open(sys.argv[2], "w").close()
