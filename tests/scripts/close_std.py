"""Closes its standard output and error at the file-descriptor level, then reports
what its prints did into a file.  usage: close_std.py REPORT_FILE"""

import os
import sys

report = sys.argv[1]
print("closer before", flush=True)
os.close(1)
os.close(2)
try:
    print("closer after", flush=True)
    outcome = "print worked"
except OSError as err:
    outcome = f"print raised errno {err.errno}"
with open(report + ".tmp", "w") as f:
    f.write(outcome)
os.rename(report + ".tmp", report)
