"""Imports a name of `replaced` (imports/shared/replaced.py): first, or once the other
job's import of it has begun.

usage: import_replaced.py first|second MARKER_FILE"""

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared"))
role, marker = sys.argv[1], sys.argv[2]
if role == "first":
    os.environ["REPLACED_MARKER"] = marker
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(marker):
        if time.monotonic() > deadline:
            sys.exit(f"never saw {marker}")
        time.sleep(0.005)

from replaced import VALUE  # noqa: E402

print(f"{role}: VALUE {VALUE}")
