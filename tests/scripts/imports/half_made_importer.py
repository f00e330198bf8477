"""Imports imports/shared/half_made (a library on the launcher's path), which waits
half-way for fork_during_import.py's fork.

usage: half_made_importer.py RENDEZVOUS [UNTIL [MODULE...]]
  UNTIL: the file whose making ends the wait; MODULE: imported first"""

import importlib
import os
import sys

os.environ["HALF_MADE_RENDEZVOUS"] = sys.argv[1]
os.environ["HALF_MADE_UNTIL"] = (sys.argv[2:] or ["forking"])[0]
for name in sys.argv[3:]:
    importlib.import_module(name)
import half_made  # noqa: E402

print("imported", half_made.VALUE)
