"""Imports a module at the same moment as the other jobs.

usage: import_race.py MODULE RENDEZVOUS_DIR JOBS
The `shared/` folder is put on sys.path: its modules are shared by every job when the
launcher's sys.path has it too (a folder only the job adds holds modules of its own).
"""

import importlib
import os
import sys
import time

module, rendezvous, jobs = sys.argv[1], sys.argv[2], int(sys.argv[3])
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared"))
sys.setswitchinterval(1e-6)  # process-wide: switch threads as often as possible

open(os.path.join(rendezvous, os.environ.get("WWRUN_JOB_NAME", "solo")), "w").close()
deadline = time.monotonic() + 120
while len(os.listdir(rendezvous)) < jobs and time.monotonic() < deadline:
    pass
imported = importlib.import_module(module)
late = [name for name in ("A_LATE", "B_LATE") if hasattr(imported, name)]
print(f"imported {module} late={late}")
