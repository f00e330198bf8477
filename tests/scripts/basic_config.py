"""Configures the root logger as training scripts do, then logs, once every job has
configured (a rendezvous: each job's file, then a wait for all of them, bounded).

usage: basic_config.py LOGFILE NAME RENDEZVOUS_DIR JOBS basic|dict
basic: `logging.basicConfig(filename=LOGFILE, filemode="w")`; dict:
`logging.config.dictConfig` (as Hydra's job logging), once the other jobs configured."""

import logging
import logging.config
import os
import sys
import time

logfile, name, rendezvous, jobs, how = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]


def wait_for(count):
    deadline = time.monotonic() + 60
    while len(os.listdir(rendezvous)) < count and time.monotonic() < deadline:
        time.sleep(0.01)


if how == "basic":
    logging.basicConfig(filename=logfile, filemode="w", level=logging.INFO, format="%(name)s %(message)s")
else:
    wait_for(jobs - 1)
    logging.config.dictConfig({
        "version": 1, "disable_existing_loggers": False,
        "formatters": {"plain": {"format": "%(name)s %(message)s"}},
        "handlers": {"file": {"class": "logging.FileHandler", "filename": logfile, "formatter": "plain"}},
        "root": {"level": "INFO", "handlers": ["file"]},
    })
open(os.path.join(rendezvous, name), "w").close()
wait_for(jobs)
for step in range(2):
    logging.info("%s step %d", name, step)
    logging.getLogger("library").warning("%s from a shared logger", name)
print("handlers", len(logging.getLogger().handlers))
