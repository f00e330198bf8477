"""Timeline of a run: Chrome/Perfetto trace events and the memory plot.

The trace is the Chrome Trace Event format (JSON object form, `traceEvents`), which
ui.perfetto.dev and chrome://tracing open: one thread track per job with complete
("X") events for NodeGroup forward/backward spans and waits, and counter ("C")
tracks for each job's memory, the total and the limit. Reference: "Trace Event
Format", Google, https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
"""

from __future__ import annotations

import json

from wwrun import forksafe

from wwrun.config import format_size

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
        self._lock = forksafe.Lock()

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

    def write_memory_plot(self, path: str, limit: int | None, *, run_id: str | None = None,
                          device: str | None = None, peaks: dict[str, int | None] | None = None,
                          peak_total: int | None = None) -> dict:
        """A PNG readable at a glance: on top every job's allocated memory stacked
        under the limit (the total is what the limit bounds); below, one row per job
        on its own scale, so that a small job stays visible beside a large one, with
        its waits for memory shaded.

        Memory here is allocated bytes (what tensors hold), never reserved. `peaks`
        (per job) and `peak_total` (the run) are the report's `peak_memory_bytes`,
        the allocator's exact peaks, and the labels show them; without them a label
        shows the highest sample ("sampled peak"), which can miss a peak between two
        samples. Returns the labels drawn (title, each job's peak), which the PNG
        also carries as its "wwrun" text entry."""
        plt = _pyplot()
        from matplotlib.patches import Patch
        from matplotlib.ticker import MaxNLocator
        from matplotlib.transforms import blended_transform_factory

        jobs = list(self.tracks) or list(dict.fromkeys(job for _, job, _ in self.samples))
        jobs += [job for job in dict.fromkeys(job for _, job, _ in self.samples) if job not in jobs]
        peak_total_sampled = max((total for _, _, total in self.totals()), default=0)
        scale, unit = _unit(max(peak_total_sampled, limit or 0))
        end = max([t for t, _, _ in self.samples] + [self._end_of(e) for e in self.events] + [1e-3])
        colors = plt.get_cmap("tab10" if len(jobs) <= 10 else "tab20").colors
        color = {job: colors[i % len(colors)] for i, job in enumerate(jobs)}

        fig, axes = plt.subplots(
            1 + len(jobs), 1, sharex=True, squeeze=False, layout="constrained",
            figsize=(11, 3.6 + 0.75 * len(jobs)), gridspec_kw={"height_ratios": [4] + [1] * len(jobs)},
        )
        top, rows = axes[0][0], [row[0] for row in axes[1:]]
        peaks = peaks or {}
        title = " · ".join(filter(None, [
            f"wwrun run {run_id}" if run_id else "wwrun memory", device,
            f"limit {format_size(limit)}" if limit is not None else "no memory limit",
            _peak_label(peak_total if peak_total is not None else peak_total_sampled, peak_total is None),
        ]))
        shown = {"title": title, "peaks": {}}
        fig.suptitle(title, fontsize=12)

        # All jobs stacked: the height is the total the limit bounds.
        times, current, columns = [0.0], dict.fromkeys(jobs, 0), [[0.0] for _ in jobs]
        for t, job, nbytes in self.samples:
            current[job] = nbytes
            times.append(t)
            for column, name in zip(columns, jobs):
                column.append(current[name] / scale)
        times.append(end)
        for column in columns:
            column.append(column[-1])
        if jobs:
            top.stackplot(times, *columns, labels=jobs, colors=[color[j] for j in jobs], step="post", alpha=0.85)
        handles, labels = top.get_legend_handles_labels()
        if limit is not None:
            top.axhline(limit / scale, color="red", linestyle="--", linewidth=1.5)
            # Labelled on the line itself: no legend can hide it.
            top.text(0.995, limit / scale, f"limit {format_size(limit)}", color="red", ha="right",
                     va="bottom", transform=blended_transform_factory(top.transAxes, top.transData))
        top.set_ylim(0, max(peak_total_sampled, limit or 0, 1) / scale * 1.12)
        top.set_ylabel(f"allocated, all jobs stacked ({unit})")
        top.grid(axis="y", alpha=0.3)
        waits = self._waits()
        if any(waits.values()):
            handles.append(Patch(color="0.85"))
            labels.append("queued or waiting\nfor memory")
        if handles:
            top.legend(handles, labels, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)

        # One row per job, on its own scale, over the whole run.
        for ax, job in zip(rows, jobs):
            points = [(t, nbytes / scale) for t, name, nbytes in self.samples if name == job]
            peak = max((value for _, value in points), default=0.0)
            if points:
                xs = [t for t, _ in points] + [end]
                ys = [value for _, value in points] + [points[-1][1]]
                ax.fill_between(xs, ys, step="post", color=color[job], alpha=0.6, linewidth=0)
                ax.step(xs, ys, where="post", color=color[job], linewidth=0.8)
            for start, stop in waits.get(job, []):
                ax.axvspan(start, stop, color="0.85", zorder=0, linewidth=0)
            exact = peaks.get(job)
            if exact is not None:  # the allocator's peak, which samples can miss: a dotted line
                ax.axhline(exact / scale, color=color[job], linestyle=":", linewidth=1)
                peak = max(peak, exact / scale)
            ax.set_ylim(0, peak * 1.3 if peak > 0 else 1)
            ax.yaxis.set_major_locator(MaxNLocator(2))
            ax.set_ylabel(job, rotation=0, ha="right", va="center", color=color[job], fontweight="bold")
            sampled = max((nbytes for _, name, nbytes in self.samples if name == job), default=0)
            shown["peaks"][job] = _peak_label(sampled if exact is None else exact, exact is None)
            ax.text(1.01, 0.5, shown["peaks"][job], transform=ax.transAxes, ha="left", va="center", fontsize=9)
            ax.grid(axis="y", alpha=0.3)
        bottom = rows[-1] if rows else top
        bottom.set_xlim(0, end)
        bottom.set_xlabel("time since the run started (s)")
        if rows:
            rows[0].set_title(f"each job's allocated memory on its own scale ({unit})", loc="left", fontsize=9)
        fig.savefig(path, dpi=110, metadata={"wwrun": json.dumps(shown)})
        plt.close(fig)
        return shown

    def _waits(self) -> dict[str, list[tuple[float, float]]]:
        """Each job's waits for memory (admission and NodeGroups), in seconds."""
        jobs = {tid: job for job, tid in self.tracks.items()}
        waits: dict[str, list[tuple[float, float]]] = {}
        for event in self.events:
            if event["name"] == "queued" or event["name"].startswith("wait "):
                start = event["ts"] / 1e6
                waits.setdefault(jobs[event["tid"]], []).append((start, start + event["dur"] / 1e6))
        return waits

    @staticmethod
    def _end_of(event: dict) -> float:
        return (event["ts"] + event.get("dur", 0.0)) / 1e6


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise RuntimeError(
            "--memory-plot needs matplotlib: pip install 'wwrun[plot]' (or matplotlib)"
        ) from None
    return plt


def _unit(nbytes: float) -> tuple[int, str]:
    """The unit the plot's axes use: the largest that keeps the figures above 1."""
    for scale, unit in ((2**30, "GiB"), (2**20, "MiB")):
        if nbytes >= scale:
            return scale, unit
    return 2**10, "KiB"


def _peak_label(nbytes: int, sampled: bool) -> str:
    """'peak allocated 24.8MiB', as the summary's column and the report name it."""
    return f"{'sampled peak' if sampled else 'peak allocated'} {format_size(nbytes)}"
