"""Patched built-ins kept as class attributes, as some libraries do: under `python`
they do not bind as methods (`self` is not passed)."""
import io
import os
import sys


class Files:
    opener = open
    io_opener = io.open
    raw_opener = os.open
    closer = os.close


files = Files()
path = sys.argv[1]
with files.opener(path, "w") as f:
    f.write("one")
with files.io_opener(path) as f:
    print("read", f.read())
files.closer(files.raw_opener(path, os.O_RDONLY))
print("builtin-like", type(open).__name__, open.__name__, os.close.__name__)
