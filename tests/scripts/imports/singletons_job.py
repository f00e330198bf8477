"""Prints the serial numbers of the `GlobalHydra` and `ConfigStore` it gets (see
imports/shared/singletons.py), twice: a singleton is one object within a job."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared"))
from singletons import ConfigStore, GlobalHydra  # noqa: E402

assert GlobalHydra() is GlobalHydra() and ConfigStore() is ConfigStore()
print(f"run {GlobalHydra().serial} registry {ConfigStore().serial}")
