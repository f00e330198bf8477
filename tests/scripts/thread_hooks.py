"""threading.settrace/setprofile, as coverage or a profiler uses them.

    thread_hooks.py set FLAG    sets both, starts a thread, then creates FLAG
    thread_hooks.py none FLAG   once FLAG exists, starts a thread of its own

Each prints what its thread found installed and what the hooks saw.
"""

import os
import sys
import threading
import time

mode, flag = sys.argv[1], sys.argv[2]
calls, profiled = [], []


def tracer(frame, event, arg):
    if event == "call":
        calls.append(frame.f_code.co_name)
    return None


def profiler(frame, event, arg):
    if event == "call":
        profiled.append(frame.f_code.co_name)


def step():
    return 1


def work(found):
    found += [sys.gettrace(), sys.getprofile()]
    step()
    step()


if mode == "set":
    threading.settrace(tracer)
    threading.setprofile(profiler)
else:
    deadline = time.monotonic() + 60
    while not os.path.exists(flag) and time.monotonic() < deadline:
        time.sleep(0.01)
found = []
thread = threading.Thread(target=work, args=(found,))
thread.start()
thread.join()
if mode == "set":
    open(flag, "w").close()
names = [getattr(f, "__name__", None) for f in found]
print(f"{mode}: thread has trace={names[0]} profile={names[1]}; threading has "
      f"{getattr(threading.gettrace(), '__name__', None)}, {getattr(threading.getprofile(), '__name__', None)}; "
      f"traced step {calls.count('step')}, profiled step {profiled.count('step')}")
