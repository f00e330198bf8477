"""Counts its own calls with a trace function, as a debugger or coverage would."""

import sys

calls = []


def tracer(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "step":
        calls.append(frame.f_lineno)
    return None


def step(x):
    return x + 1


sys.settrace(tracer)
total = sum(step(i) for i in range(3))
sys.settrace(None)
print(f"traced calls={len(calls)} total={total}")
