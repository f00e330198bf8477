"""`logging.basicConfig(filename=...)`, as training scripts log, once every job has
configured (a rendezvous: each job's file, then a wait for all of them, bounded).

usage: basic_config.py LOGFILE NAME RENDEZVOUS_DIR JOBS"""

import logging
import os
import sys
import time

logfile, name, rendezvous, jobs = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
logging.basicConfig(filename=logfile, level=logging.INFO, format="%(name)s %(message)s")
open(os.path.join(rendezvous, name), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(rendezvous)) < jobs and time.monotonic() < deadline:
    time.sleep(0.01)
for step in range(2):
    logging.info("%s step %d", name, step)
    logging.getLogger("library").warning("%s from a shared logger", name)
print("handlers", len(logging.getLogger().handlers))
