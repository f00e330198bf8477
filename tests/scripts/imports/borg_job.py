"""Sets the Borg state's accumulation steps (see imports/shared/borg.py), waits until
every job has, then prints what a fresh instance sees.

usage: borg_job.py STEPS RENDEZVOUS_DIR JOBS  (the wait is bounded: 60 s)"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared"))
from borg import GradientState  # noqa: E402

steps, rendezvous, jobs = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
GradientState(steps)
open(os.path.join(rendezvous, str(steps)), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(rendezvous)) < jobs and time.monotonic() < deadline:
    time.sleep(0.01)
print("accumulation steps", GradientState().accumulation_steps, "shared", GradientState._shared_state)
