"""Prints through sys.__stdout__ / sys.__stderr__, and restores sys.stdout after a
redirect the usual way.  usage: restore_stdout.py FILE"""

import sys

print("to __stdout__", file=sys.__stdout__, flush=True)
print("to __stderr__", file=sys.__stderr__, flush=True)
sys.stdout = open(sys.argv[1], "w")
print("redirected")
sys.stdout.close()
sys.stdout = sys.__stdout__
print("restored via __stdout__")
