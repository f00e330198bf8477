"""Timeline of a run: Chrome/Perfetto trace events and the memory plot.

The trace is the Chrome Trace Event format (JSON object form, `traceEvents`), which
ui.perfetto.dev and chrome://tracing open: one thread track per job with complete
("X") events for NodeGroup forward/backward spans and waits, and counter ("C")
tracks for each job's memory, the total and the limit. Reference: "Trace Event
Format", Google, https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json
import threading

MAX_SAMPLES = 500_000
"""Memory samples kept (about 40 MB); later samples are dropped, the peaks are not."""


class Timeline:
    """Spans and memory samples of one run, in seconds since `origin`."""

    def __init__(self, origin: float, spans: bool):
        self.origin = origin
        self.record_spans = spans
        self.tracks: dict[str, int] = {}
        self.events: list[dict] = []
        self.samples: list[tuple[float, str, int]] = []  # (t, job, bytes)
        self._lock = threading.Lock()

    def track(self, job: str) -> int:
        return self.tracks.setdefault(job, len(self.tracks) + 1)

    def span(self, job: str, name: str, start: float, end: float, **args) -> None:
        if not self.record_spans:
            return
        event = {
            "name": name, "ph": "X", "pid": 1, "tid": self.track(job),
            "ts": (start - self.origin) * 1e6, "dur": max(0.0, end - start) * 1e6,
        }
        if args:
            event["args"] = args
        with self._lock:
            self.events.append(event)

    def sample(self, t: float, job: str, nbytes: int) -> None:
        if len(self.samples) < MAX_SAMPLES:
            with self._lock:
                self.samples.append((t - self.origin, job, nbytes))

    def write_trace(self, path: str, limit: int | None) -> None:
        events = [
            {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "wwrun"}},
            *({"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": job}}
              for job, tid in self.tracks.items()),
        ]
        events += self.events
        for t, job, total in self.totals():
            ts = t * 1e6
            events.append({"name": "memory total", "ph": "C", "pid": 1, "ts": ts, "args": {"bytes": total}})
            if limit is not None:
                events.append({"name": "memory limit", "ph": "C", "pid": 1, "ts": ts, "args": {"bytes": limit}})
        for t, job, nbytes in self.samples:
            events.append({"name": f"memory {job}", "ph": "C", "pid": 1, "ts": t * 1e6, "args": {"bytes": nbytes}})
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)

    def totals(self) -> list[tuple[float, str, int]]:
        """(t, job that changed, total bytes of every job) after each sample."""
        current: dict[str, int] = {}
        result = []
        for t, job, nbytes in self.samples:
            current[job] = nbytes
            result.append((t, job, sum(current.values())))
        return result

    def write_memory_plot(self, path: str, limit: int | None) -> None:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            raise RuntimeError(
                "--memory-plot needs matplotlib: pip install 'wwrun[plot]' (or matplotlib)"
            ) from None
        jobs = list(dict.fromkeys(job for _, job, _ in self.samples))
        times, current, rows = [], dict.fromkeys(jobs, 0), []
        for t, job, nbytes in self.samples:
            current[job] = nbytes
            times.append(t)
            rows.append([current[j] / 2**20 for j in jobs])
        fig, ax = plt.subplots(figsize=(10, 4))
        if rows:
            columns = list(zip(*rows))
            ax.stackplot(times, *columns, labels=jobs, step="post")
        if limit is not None:
            ax.axhline(limit / 2**20, color="red", linestyle="--", label="limit")
        ax.set_xlabel("time (s)")
        ax.set_ylabel("memory (MiB)")
        ax.legend(loc="upper right")
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
