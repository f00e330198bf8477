"""The cyclic collector, switched off by one job, still collects another's cycles.

    gc_switch.py off FLAG      gc.disable() (and thresholds), creates FLAG, enables it again at FLAG.done
    gc_switch.py cycles FLAG   once FLAG exists: 4000 reference cycles, never collected by hand; FLAG.done
"""

import gc
import os
import sys
import time
import weakref

mode, flag = sys.argv[1], sys.argv[2]
if mode == "off":
    gc.disable()
    gc.set_threshold(10_000)
    print("enabled:", gc.isenabled(), "threshold:", gc.get_threshold()[0])
    open(flag, "w").close()
    deadline = time.monotonic() + 60
    while not os.path.exists(flag + ".done") and time.monotonic() < deadline:  # off while the other runs
        time.sleep(0.01)
    gc.enable()
    print("enabled again:", gc.isenabled())
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)

    class Node:
        pass

    alive = []
    for _ in range(4000):
        node = Node()
        node.me = node  # a cycle: only the collector frees it
        node.payload = bytearray(1 << 10)
        alive.append(weakref.ref(node))
        del node
    print("enabled:", gc.isenabled(), "mostly collected:", sum(ref() is not None for ref in alive) < 2000)
    open(flag + ".done", "w").close()
