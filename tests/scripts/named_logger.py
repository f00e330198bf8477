"""logging.getLogger(__name__) with a handler and level of its own, as scripts do.

    named_logger.py NAME LEVEL MINE OTHERS   configures, creates MINE, waits for OTHERS, logs
"""

import logging
import os
import sys
import time

name, level, mine, others = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
logger = logging.getLogger(__name__)
logger.setLevel(level)
handler = logging.StreamHandler(sys.stdout)
handler.setFormatter(logging.Formatter(f"{name}: %(levelname)s %(message)s"))
logger.addHandler(handler)
open(mine, "w").close()
deadline = time.monotonic() + 60
while not os.path.exists(others) and time.monotonic() < deadline:  # both configured before either logs
    time.sleep(0.01)
logger.info("info")
logger.warning("warning")
print("handlers:", len(logger.handlers), "child's parent is mine:", logger.getChild("x").parent is logger)
