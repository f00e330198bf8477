"""Fails (as its first argument says) until it has run N times, counted in a file."""
import sys
from pathlib import Path

how, counter, succeed_at = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3])
runs = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(runs))
print(f"attempt {runs}", flush=True)
if runs < succeed_at:
    if how == "oom":
        raise MemoryError("out of memory (pretend)")
    raise RuntimeError(f"flaky failure {runs}")
print("done")
