"""Runs from its own folder: exec's a relative file, saves a relative checkpoint."""
import os

import torch

exec(open("config.py").read())
torch.save({"hidden": HIDDEN}, "ckpt.pt")
os.makedirs("out", exist_ok=True)
with open(os.path.join("out", "done.txt"), "w") as f:
    f.write(os.getcwd())
print("cwd", os.getcwd(), "hidden", torch.load("ckpt.pt")["hidden"])
