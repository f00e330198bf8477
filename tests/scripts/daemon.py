"""Starts a double-forked daemon, as `(setsid cmd &)` does, and returns once it runs."""
import subprocess
import sys
import time
from pathlib import Path

pidfile = Path(sys.argv[1])
subprocess.run(
    f"(setsid sh -c 'echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; exec sleep 1000'"
    " </dev/null >/dev/null 2>&1 &)",
    shell=True, check=True,
)
deadline = time.monotonic() + 10
while not pidfile.exists() and time.monotonic() < deadline:
    time.sleep(0.01)
print("daemon started", pidfile.read_text().strip(), flush=True)
