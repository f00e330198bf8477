"""Spends most of its time in finalizers, as a training step under the engine spends
some in freeing saved activations. Ctrl-C must still reach the loop, and the
`finally:` checkpoint must be written.

Usage: finalizers.py READY_FILE CHECKPOINT_FILE
"""

import sys

ready, checkpoint = sys.argv[1], sys.argv[2]


class Heavy:
    def __del__(self):
        total = 0
        for i in range(20000):  # a finalizer long enough to be where the interrupt lands
            total += i


open(ready, "w").close()
try:
    while True:
        Heavy()
finally:
    with open(checkpoint, "w") as f:
        f.write("saved")
