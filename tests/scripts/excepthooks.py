"""sys.excepthook and threading.excepthook, as rich.traceback.install() sets them.

    excepthooks.py hooks FLAG   sets both, then creates FLAG
    excepthooks.py plain FLAG   once FLAG exists

Then each fails in a thread of its own and, uncaught, in its main code.
"""

import os
import sys
import threading
import time

mode, flag = sys.argv[1], sys.argv[2]
if mode == "hooks":
    sys.excepthook = lambda kind, value, tb: print(f"own hook: {kind.__name__}: {value}", file=sys.stderr)
    threading.excepthook = lambda args: print(f"own thread hook: {args.exc_type.__name__} in {args.thread.name}",
                                              file=sys.stderr)
    open(flag, "w").close()
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)


def fail():
    raise KeyError(mode)


thread = threading.Thread(target=fail)
thread.start()
thread.join()
raise ValueError(mode)
