"""The run's timeline: the Chrome/Perfetto trace and the memory plot."""

from __future__ import annotations

import json

import pytest

from wwrun.config import format_size
from wwrun.memory.trace import Timeline, _unit

MiB = 2**20


def _timeline() -> Timeline:
    """Two jobs: `a` runs at once, `b` is queued for 1 s then waits for memory once."""
    timeline = Timeline(origin=100.0, spans=True)
    timeline.track("a")
    timeline.track("b")
    timeline.sample(100.5, "a", 3 * MiB)
    timeline.span("a", "fwd MLP g0", 100.5, 100.75, bytes=MiB)
    timeline.span("b", "queued", 100.0, 101.0)
    timeline.sample(101.0, "b", 1 * MiB)
    timeline.span("b", "wait g1", 101.5, 102.0)
    timeline.sample(102.0, "a", 0)
    timeline.sample(103.0, "b", 0)
    return timeline


def test_trace_has_a_track_per_job_spans_and_memory_counters(tmp_path):
    path = tmp_path / "trace.json"
    _timeline().write_trace(str(path), limit=8 * MiB)
    trace = json.loads(path.read_text())
    assert trace["displayTimeUnit"] == "ms"
    events = trace["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert names == {"a": 1, "b": 2}
    assert {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": "wwrun"}} in events
    spans = [e for e in events if e["ph"] == "X"]
    forward = next(e for e in spans if e["name"] == "fwd MLP g0")
    assert (forward["tid"], forward["ts"], forward["dur"], forward["args"]) == (1, 0.5e6, 0.25e6, {"bytes": MiB})
    assert {e["name"] for e in spans if e["tid"] == 2} == {"queued", "wait g1"}
    totals = [(e["ts"], e["args"]["bytes"]) for e in events if e["name"] == "memory total"]
    assert totals == [(0.5e6, 3 * MiB), (1.0e6, 4 * MiB), (2.0e6, 1 * MiB), (3.0e6, 0)]
    assert {e["args"]["bytes"] for e in events if e["name"] == "memory limit"} == {8 * MiB}
    assert [e["args"]["bytes"] for e in events if e["name"] == "memory b"] == [MiB, 0]
    assert all(e["ph"] == "C" for e in events if e["name"].startswith("memory"))


def test_trace_without_a_limit_or_spans(tmp_path):
    timeline = Timeline(origin=0.0, spans=False)
    timeline.span("a", "fwd", 0.0, 1.0)  # not recorded
    timeline.sample(0.5, "a", MiB)
    path = tmp_path / "trace.json"
    timeline.write_trace(str(path), limit=None)
    events = json.loads(path.read_text())["traceEvents"]
    assert not [e for e in events if e["ph"] == "X" or e["name"] == "memory limit"]
    assert [e["name"] for e in events if e["ph"] == "C"] == ["memory total", "memory a"]


def test_waits_are_the_queued_and_wait_spans_per_job():
    assert _timeline()._waits() == {"b": [(0.0, 1.0), (1.5, 2.0)]}


def test_plot_unit_follows_the_largest_figure():
    assert _unit(512) == (2**10, "KiB")
    assert _unit(64 * MiB) == (MiB, "MiB")
    assert _unit(3 * 2**30) == (2**30, "GiB")


@pytest.mark.parametrize("limit", [8 * MiB, None])
def test_memory_plot_is_written(tmp_path, limit):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    _timeline().write_memory_plot(str(path), limit, run_id="20260101-000000-abcd", device="cpu")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_plot_of_an_empty_run(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    Timeline(origin=0.0, spans=True).write_memory_plot(str(path), 8 * MiB)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_memory_plot_without_matplotlib_says_how_to_get_it(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import fails as if not installed
    with pytest.raises(RuntimeError, match="--memory-plot needs matplotlib"):
        _timeline().write_memory_plot(str(tmp_path / "memory.png"), 8 * MiB)
    assert not (tmp_path / "memory.png").exists()


def _labels(path) -> dict:
    """The labels a memory plot drew, from the PNG's "wwrun" text entry."""
    from PIL import Image

    with Image.open(path) as image:
        return json.loads(image.text["wwrun"])


def test_memory_plot_labels_name_the_peak_they_show(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    shown = _timeline().write_memory_plot(str(path), 8 * MiB, peaks={"a": 5 * MiB, "b": None}, peak_total=6 * MiB)
    assert shown == _labels(path)
    assert shown["peaks"] == {"a": "peak allocated 5.0MiB", "b": "sampled peak 1.0MiB"}
    assert shown["title"].endswith("limit 8.0MiB · peak allocated 6.0MiB")
    without = _timeline().write_memory_plot(str(path), None)
    assert without["peaks"] == {"a": "sampled peak 3.0MiB", "b": "sampled peak 1.0MiB"}
    assert without["title"].endswith("sampled peak 4.0MiB")


def test_the_report_the_plot_and_the_summary_show_one_peak(tmp_path):
    """Each job's peak is the report's `peak_memory_bytes` (allocated bytes) in the
    summary's "peak allocated" column and on the memory plot (issue 21)."""
    pytest.importorskip("matplotlib")
    from pathlib import Path

    from wwrun import JobSpec, LaunchConfig, launch
    from wwrun.display import summary_lines

    script = str(Path(__file__).parent / "scripts" / "train_mlp.py")
    jobs = [JobSpec(name="wide", script=script, args=["--width", "384", "--steps", "4"]),
            JobSpec(name="narrow", script=script, args=["--width", "64", "--steps", "4"])]
    plot = tmp_path / "memory.png"
    result = launch(LaunchConfig(jobs=jobs, log_dir=str(tmp_path / "logs"), quiet=True, device="cpu",
                                 memory_plot=str(plot)))
    assert not result.is_failed(), result.to_dict()
    report = json.loads((Path(result.log_dir) / "report.json").read_text())
    peaks = {job["name"]: job["peak_memory_bytes"] for job in report["jobs"]}
    assert peaks["wide"] > peaks["narrow"] > 0
    labels = _labels(plot)
    lines = summary_lines(result, width=200)
    header = lines[1].split("  ")
    column = [cell.strip() for cell in header if cell.strip()].index("peak allocated")
    for name, peak in peaks.items():
        assert labels["peaks"][name] == f"peak allocated {format_size(peak)}"
        row = next(line for line in lines[2:] if line.startswith(name + " "))
        assert row.split()[column] == format_size(peak)
    assert labels["title"].endswith(f"peak allocated {format_size(report['run']['peak_memory_bytes'])}")
    assert report["run"]["peak_reserved_bytes"] >= report["run"]["peak_memory_bytes"]
