"""A package whose import stops half-way, with a submodule already in, until the
forking job says it forks (fork_during_import.py; or the file HALF_MADE_UNTIL names):
what a fork in one job meets while another job imports transformers or datasets."""

import os
import time

import half_made.part

folder = os.environ["HALF_MADE_RENDEZVOUS"]
open(os.path.join(folder, "importing"), "w").close()
deadline = time.monotonic() + 60
until = os.environ.get("HALF_MADE_UNTIL", "forking")
while not os.path.exists(os.path.join(folder, until)) and time.monotonic() < deadline:
    time.sleep(0.01)
VALUE = half_made.part.VALUE * 2
