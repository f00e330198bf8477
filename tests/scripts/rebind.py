"""Rebinds process-wide names, as research code does, then checks that another job
doing the same at the same moment changed nothing of what this one sees.

usage: rebind.py WHO RENDEZVOUS_DIR JOBS OUT_DIR
"""

import io
import json
import os
import pickle
import sys
import time

import torch

who, rendezvous, jobs, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]


class Tee:
    def __init__(self, stream, path):
        self.terminal = stream
        self.file = open(path, "w")

    def write(self, text):
        self.terminal.write(text)
        self.file.write(text)

    def flush(self):
        self.terminal.flush()
        self.file.flush()


sys.argv = ["prog", f"--who={who}"]
os.environ = {**os.environ, "WHO": who}
os.environ.update(WHO2=who)
sys.path.insert(0, f"/nonexistent/{who}")
sys.stdout = Tee(sys.stdout, os.path.join(out, f"{who}.tee"))

# Wait until every job has rebound its names.
open(os.path.join(rendezvous, who), "w").close()
deadline = time.monotonic() + 120
while len(os.listdir(rendezvous)) < jobs:
    if time.monotonic() > deadline:
        sys.exit(3)
    time.sleep(0.01)

print(f"argv={sys.argv} json={json.dumps(sys.argv)}")
print(f"environ={os.environ['WHO']} {os.getenv('WHO2')} merged={(os.environ | {'X': '1'})['WHO']}")
types = ",".join(type(value).__name__ for value in (sys.argv, sys.path, os.environ))
print(f"path0={sys.path[0]} types={types}")
saved = io.BytesIO()
torch.save({"argv": sys.argv, "path": sys.path, "env": os.environ}, saved)
blobs = (saved.getvalue(), pickle.dumps([sys.argv, sys.path, os.environ]))
plain = all(b"wwrun.isolation" not in blob for blob in blobs)
print(f"plain={plain}")
tee = sys.stdout
sys.stdout = tee.terminal
print(f"restored {who}")
tee.file.close()
