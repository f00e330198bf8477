"""Threads, logging and child processes all carry the job's identity."""
import logging
import os
import subprocess
import sys
import threading

from tqdm import tqdm

logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
os.environ["SET_BY_JOB"] = os.environ["WWRUN_JOB_NAME"]


def worker():
    print(f"thread job={os.environ['WWRUN_JOB_NAME']} cwd={os.getcwd()}")
    logging.getLogger("demo").info("logged from %s", os.environ["WWRUN_JOB_NAME"])


thread = threading.Thread(target=worker)
thread.start()
thread.join()
sys.stdout.write("progress 1/2\rprogress 2/2\n")
for _ in tqdm(range(3), desc=f"bar-{os.environ['WWRUN_JOB_NAME']}"):
    pass
code = "import os; print('child', os.environ['SET_BY_JOB'], os.getcwd())"
subprocess.run([sys.executable, "-c", code], check=True)
