"""Counts the earlier hogs' tensors still alive (the jobs before it have ended)."""

import gc
import sys

import psutil

registry = sys.modules["_wwrun_test_hogs"]
gc.collect()
alive = sum(ref() is not None for ref in registry.refs)
rss = psutil.Process().memory_info().rss
print(f"hogs={len(registry.refs)} alive={alive} rss_mib={rss >> 20}")
