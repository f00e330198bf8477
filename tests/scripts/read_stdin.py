"""Reads its standard input to the end and says what it got."""

import sys

data = sys.stdin.read()
print(f"read {data.strip()!r}")
try:
    input()
except EOFError:
    print("then end of file")
