"""Sets the run in progress in a wandb-shaped module's globals (see
imports/shared/run_globals.py), waits until every job has, then prints what it sees.

usage: run_globals_job.py NAME RENDEZVOUS_DIR JOBS  (the wait is bounded: 60 s)"""

import os
import sys
import time

import run_globals

name, rendezvous, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
run_globals.set_global(run=name, config={"name": name})
open(os.path.join(rendezvous, name), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(rendezvous)) < jobs and time.monotonic() < deadline:
    time.sleep(0.01)
print(run_globals.run, run_globals.config)
