"""What a job's os.environ is: Python's own mapping type (vars(), _data, isinstance),
holding the job's variables; setting one leaves C's environment as it is."""

import ctypes
import os

getenv = ctypes.CDLL(None).getenv
getenv.restype = ctypes.c_char_p
os.environ["SET_BY_JOB"] = "yes"
os.environ.setdefault("ALSO_SET", "1")
del os.environ["ALSO_SET"]
print(isinstance(os.environ, os._Environ), type(vars(os.environ)).__name__, type(os.environ._data).__name__,
      os.environ["SET_BY_JOB"], os.getenv("SET_BY_JOB"), "ALSO_SET" in os.environ, getenv(b"SET_BY_JOB"))
try:
    os.environ["NOT_A_STR"] = 1
except TypeError as error:
    print("TypeError:", error)
