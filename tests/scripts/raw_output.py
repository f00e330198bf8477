"""Output that bypasses sys.stdout: os.write to fds 1 and 2, and os.system's command
(which sees an environment variable the script set)."""

import os

os.environ["MINE"] = "set by the script"
os.write(1, b"raw stdout\n")
os.write(2, b"raw stderr\n")
status = os.system('echo "system: $MINE"; exit 3')
print("status", status, os.waitstatus_to_exitcode(status), flush=True)
