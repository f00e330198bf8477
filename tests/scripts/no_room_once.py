"""The first time it runs, ends as the engine ends a job whose model turns out not to
fit beside the running ones (NoRoomYet); the next time, trains.

Usage: no_room_once.py MARKER
"""

import os
import sys

from wwrun.memory.engine import NoRoomYet

print("starting")
if not os.path.exists(sys.argv[1]):
    open(sys.argv[1], "w").close()
    raise NoRoomYet("job 'late' does not fit beside the running jobs")
print("trained")
