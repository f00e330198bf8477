"""Which engine a job goes to: pure logic over figures, no processes, no torch.

Placement rules, in order (`choose`):

  1. Only a live engine with a free slot (fewer running jobs than `slots`) takes a job.
  2. A job whose peak is known (its `memory` hint, else the largest peak measured for
     a sibling: the same script or module) goes to an engine where it fits now:
         need <= capacity - max(committed, live)
     `committed` is what the driver counts on for the jobs it placed there (their
     known peaks), `live` what the engine last reported in use. Among those, the one
     with the fewest running jobs (compute is shared too), then the least room left
     (best fit: a large engine stays free for a job only it can hold). Engines the
     job already failed on come last.
  3. A known peak that fits no engine now but fits one's capacity waits for room.
     One that exceeds every capacity goes to the largest engine once that engine is
     idle: the engine then decides (it fails the job with JobTooLarge, or the
     figure was too high).
  4. A job whose peak is unknown goes where the most room is, to an engine that
     profiles no other unknown job; it is profiled there, and its figure serves its
     siblings, which wait for it (`Estimates.scouting`).
  5. Engines without a memory budget (the CPU without --memory-limit) have
     unlimited room: jobs then go by running count alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class EngineView:
    """What the driver knows of one engine."""

    index: int
    capacity: int | None
    """Bytes the engine may use; None: no budget."""
    slots: int
    """Jobs it may run at once (the run's max_concurrent, per engine)."""
    running: int = 0
    committed: int = 0
    """Bytes counted on for the jobs placed there: known peaks, else their peak so far."""
    live: int = 0
    """Bytes the engine last reported in use."""
    profiling: int = 0
    """Jobs there whose peak is not yet known."""
    alive: bool = True

    @property
    def room(self) -> float:
        if self.capacity is None:
            return math.inf
        return self.capacity - max(self.committed, self.live)

    def need(self, estimate: int | float) -> int:
        """Bytes of `estimate` here: a fraction is of this engine's capacity."""
        if isinstance(estimate, float) and estimate <= 1:
            return int(estimate * self.capacity) if self.capacity is not None else 0
        return int(estimate)


def choose(estimate: int | float | None, engines: list[EngineView], avoid: frozenset[int] = frozenset()) -> int | None:
    """The index of the engine the job goes to now, or None to wait (see the rules above)."""
    open_ = [e for e in engines if e.alive and e.running < e.slots]
    if not open_:
        return None
    if estimate is None:
        candidates = [e for e in open_ if e.capacity is None or e.profiling == 0 and (e.room > 0 or e.running == 0)]
        if not candidates:
            return None
        return max(candidates, key=lambda e: (e.index not in avoid, e.room, -e.running, -e.index)).index
    fits = [e for e in open_ if e.need(estimate) <= e.room]
    if fits:
        return min(fits, key=lambda e: (e.index in avoid, e.running, e.room - e.need(estimate), e.index)).index
    alive = [e for e in engines if e.alive]
    if any(e.capacity is None or e.need(estimate) <= e.capacity for e in alive):
        return None  # it fits somewhere once jobs there end
    largest = max(alive, key=lambda e: (e.capacity, -e.index))
    return largest.index if largest.running == 0 and largest in open_ else None


@dataclass
class Estimates:
    """Peaks measured per sibling key (the script's path or the module's name): the
    largest seen, as siblings of a sweep differ only in their arguments."""

    peaks: dict[str, int] = field(default_factory=dict)
    scouting: dict[str, str] = field(default_factory=dict)
    """key -> the job profiling it now; its siblings wait for its figure."""

    def of(self, key: str, declared: int | float | None) -> int | float | None:
        return declared if declared is not None else self.peaks.get(key)

    def record(self, key: str, peak: int) -> None:
        self.peaks[key] = max(peak, self.peaks.get(key, 0))
