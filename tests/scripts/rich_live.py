"""One job holds a rich progress bar live while another reconfigures rich's console,
as Lightning's RichProgressBar does when it starts; each says whether the console it
sees was reconfigured.

usage: rich_live.py hold|reconfigure HELD_FILE DONE_FILE  (waits are bounded: 60 s)"""

import os
import sys
import time

import rich
from rich.progress import Progress

role, held, done = sys.argv[1:4]


def wait_for(path):
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"never saw {path}")
        time.sleep(0.01)


if role == "hold":
    with Progress() as progress:
        progress.add_task("hold", total=1)
        open(held, "w").close()
        wait_for(done)
else:
    wait_for(held)
    rich.reconfigure(width=123)
    with Progress() as progress:
        progress.add_task("reconfigure", total=1)
    open(done, "w").close()
print(f"{role}: reconfigured {rich.get_console().width == 123}")
