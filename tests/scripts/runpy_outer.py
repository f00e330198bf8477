"""Runs another script as __main__ with runpy, as `-m` wrappers (profilers) do; it
signals FLAG while the inner script runs.  usage: runpy_outer.py FLAG DONE"""

import os
import runpy
import sys

inner = os.path.join(os.path.dirname(os.path.abspath(__file__)), "runpy_inner.py")
sys.argv = [inner, *sys.argv[1:]]
runpy.run_path(inner, run_name="__main__")
print("outer's __main__ again:", os.path.basename(sys.modules["__main__"].__file__))
