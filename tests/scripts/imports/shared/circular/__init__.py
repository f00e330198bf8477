"""A package with circular imports (a -> c -> a, b -> c): alone, any entry imports
fine. Each module notes which job ran it, so a test can see whether jobs' first
imports interleaved (two threads inside one cycle at once is what gives Python's
"partially initialized module" and `_DeadlockError`)."""

import os

events = []


def note(what, module):
    events.append((os.environ.get("WWRUN_JOB_NAME"), what, module))


def spin():
    # Bytecode, not sleep: the thread keeps the GIL only for the switch interval.
    total = 0
    for i in range(20000):
        total += i
    return total
