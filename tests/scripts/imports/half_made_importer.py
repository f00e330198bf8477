"""Imports imports/shared/half_made (a library on the launcher's path), which waits
half-way for fork_during_import.py's fork.

usage: half_made_importer.py RENDEZVOUS"""

import os
import sys

os.environ["HALF_MADE_RENDEZVOUS"] = sys.argv[1]
import half_made  # noqa: E402

print("imported", half_made.VALUE)
