"""faulthandler, as training scripts use it.

    watchdog.py enable     faulthandler.enable() first thing, then disable()
    watchdog.py hang       a hang watchdog (dump_traceback_later(exit=True)) that fires
    watchdog.py armed      arms one for 1 s and ends first, as a short run does
    watchdog.py outlive    runs on for 2 s, past the other job's watchdog
"""

import faulthandler
import sys
import time

mode = sys.argv[1]
if mode == "enable":
    faulthandler.enable()
    print("enabled:", faulthandler.is_enabled())
    faulthandler.disable()
    print("disabled:", not faulthandler.is_enabled())
elif mode == "hang":
    faulthandler.dump_traceback_later(0.3, exit=True)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # stuck in a loop
        time.sleep(0.01)
    print("never reached")
elif mode == "armed":
    faulthandler.dump_traceback_later(1, exit=True)
    print("done before it fired")
else:
    deadline = time.monotonic() + 2
    while time.monotonic() < deadline:
        time.sleep(0.01)
    print("outlived it")
