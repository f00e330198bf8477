"""Starts the service of imports/shared/exit_service.py (a library on the launcher's
path) and ends without stopping it, as a script that never calls `wandb.finish()`.

usage: exit_service_job.py PATH  (the file the service writes once torn down)"""

import sys

import exit_service

exit_service.start(sys.argv[1])
print("started")
