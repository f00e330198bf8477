"""Holds a large tensor in a module global, as a training script holds its model and
data, and registers a weak reference to it where the watcher can look."""

import sys
import types
import weakref

import torch

MIB = int(sys.argv[1]) if len(sys.argv) > 1 else 64
hoard = torch.ones(MIB << 20, dtype=torch.uint8)


def checksum():  # a function: its __globals__ is this module's namespace (a cycle)
    return int(hoard[:10].sum())


registry = sys.modules.setdefault("_wwrun_test_hogs", types.ModuleType("_wwrun_test_hogs"))
registry.refs = [*getattr(registry, "refs", []), weakref.ref(hoard)]
print(f"hog holds {MIB} MiB checksum={checksum()}")
