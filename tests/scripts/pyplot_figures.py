"""Draws into pyplot's current figure while other jobs draw into theirs.

Usage: pyplot_figures.py RENDEZVOUS_DIR N_JOBS NAME. Each job makes its figure, then
waits until every job has made one, so all figures exist at once before anyone checks.
"""

import os
import sys
import time

import matplotlib.pyplot as plt

folder, jobs, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
fig = plt.figure()
plt.scatter([1, 2, 3], [3, 1, 2])  # sets the current image in the current axes
open(os.path.join(folder, name), "w").close()
deadline = time.monotonic() + 60
while len(os.listdir(folder)) < jobs:
    if time.monotonic() > deadline:
        sys.exit("the other jobs never drew")
    time.sleep(0.01)
plt.scatter([1, 2], [2, 1])
print(f"fignums={plt.get_fignums()} own={plt.gcf() is fig}")
plt.savefig(os.path.join(folder, f"{name}.png"))
plt.close(fig)
print(f"after_close={plt.get_fignums()}")
