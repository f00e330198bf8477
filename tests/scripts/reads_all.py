"""Reads its standard input to the end, as `sys.stdin.read()` in a script does."""

import sys

print("type lines, then Ctrl-D", flush=True)
print(f"got {sys.stdin.read()!r}")
