"""The benchmarks name the allocator each figure measured, from what each run
recorded (benchmarks/measured.py), and measure what they claim. The benchmarks
themselves run for minutes: these run their parts that decide what they record,
on the CPU. benchmarks/fragmentation.py's mixes are also in tests/test_admission.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CHECKOUT = Path(__file__).resolve().parents[1]
BENCHMARKS = CHECKOUT / "benchmarks"
SCRIPTS = Path(__file__).resolve().parent / "scripts"


def in_benchmarks(code: str, timeout: float = 300) -> dict:
    """`code` run as the benchmarks run (their folder first on sys.path, the checkout
    importable, one intra-op thread); the JSON object it prints last."""
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, (str(CHECKOUT), os.environ.get("PYTHONPATH")))))
    done = subprocess.run([sys.executable, "-c", f"import sys; sys.path.insert(0, {str(BENCHMARKS)!r})\n{code}"],
                          capture_output=True, text=True, env=env, timeout=timeout, cwd=CHECKOUT)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def wwrun_report(tmp_path: Path, name: str, *args: str) -> Path:
    """The report of a `wwrun --device cpu` run of `args`."""
    report = tmp_path / f"{name}.json"
    done = subprocess.run([sys.executable, "-m", "wwrun", "--quiet", "--device", "cpu", "--log-dir",
                           str(tmp_path / "logs"), "--report", str(report), *args],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode == 0, done.stderr[-3000:]
    return report


def test_a_run_on_another_allocator_than_claimed_stops_the_benchmark():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        from measured import WWRUN, measured_on
    finally:
        sys.path.remove(str(BENCHMARKS))
    assert measured_on("waterwave", WWRUN, "a run") == "waterwave"
    for other in ("native", "cudaMallocAsync", None):
        with pytest.raises(RuntimeError, match=f"ran on the {other!r} allocator, not 'waterwave'"):
            measured_on(other, WWRUN, "wwrun --policy waterwave")


def test_fragmentation_records_the_allocator_each_run_reported():
    figures = in_benchmarks(
        "import json, fragmentation\n"
        "print(json.dumps(fragmentation.run_mix(32 << 20, 0.25, 0, sequential=False)))")
    assert figures["allocator"] == "waterwave" and figures["jobs"] >= 2


def test_fragmentation_runs_a_mix_as_processes_on_torch_s_allocator_with_expandable_segments():
    figures = in_benchmarks(
        "import json, fragmentation\n"
        "print(json.dumps(fragmentation.run_mix(32 << 20, 0.25, 0, sequential=False, processes=True)))")
    apart = figures["processes"]
    assert (apart["allocator"], apart["alloc_conf"]) == ("native", "expandable_segments:True")
    # On the CPU nothing holds processes to one budget: every job process trains.
    assert apart["budget_enforced"] is False and apart["lost"] == 0 and apart["wall_s"] > 0, apart


@pytest.mark.gpu
def test_fragmentation_s_filler_leaves_processes_the_limit_beside_their_contexts():
    """A process that needs more than the limit fails beside the filler; one within it
    trains: the processes' baseline shares the limit, as wwrun's jobs do."""
    figures = in_benchmarks(
        "import json, subprocess, sys, fragmentation as f\n"
        "f.DEVICE = 'cuda'\n"
        "context = f.context_bytes()\n"
        "filler, _ = f._holding(f.FILLER, str((256 << 20) + context))\n"
        "take = 'import sys, torch; torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device=\"cuda\")'\n"
        "codes = {mib: subprocess.run([sys.executable, '-c', take, str(mib)], capture_output=True).returncode\n"
        "         for mib in (128, 512)}\n"
        "f._release(filler)\n"
        "print(json.dumps({'context': context, 'codes': codes}))")
    assert figures["context"] > 0
    assert figures["codes"] == {"128": 0, "512": 1}, figures


def test_fragmentation_writes_its_figures_with_the_device_to_out(tmp_path):
    out = tmp_path / "fragmentation.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "fragmentation.py"), "--limits", "32", "--seeds", "1",
                           "--no-sequential", "--device", "cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())
    assert figures == json.loads(done.stdout.splitlines()[-1])
    assert (figures["device"], figures["allocator"], figures["runs"]) == ("cpu", "waterwave", 3)
    assert figures["complete"] is True
    assert [run["errors"] for run in figures["per_run"]] == [[], [], []]  # each lost job's whole error
    assert figures["jobs_lost"] == 0, figures


def test_offload_writes_the_allocator_its_runs_recorded_to_out(tmp_path):
    out = tmp_path / "offload.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, str(BENCHMARKS / "offload.py"), "--repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(out.read_text())["allocator"] == json.loads(done.stdout.splitlines()[-1])["allocator"] == \
        "waterwave"


def test_parking_moves_a_job_s_bytes_to_host_memory_and_back_intact(tmp_path):
    out = tmp_path / "parking.json"
    done = subprocess.run([sys.executable, str(BENCHMARKS / "parking.py"), "--mib", "128", "--repeats", "2",
                           "--out", str(out)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(done.stdout.splitlines()[-1])
    assert figures == json.loads(out.read_text())
    assert figures["parked_bytes"] == 128 << 20 and figures["intact"] and figures["park_gb_per_s"] > 0
    assert figures["allocator"] == "waterwave" and figures["backend"] == "host"


def test_launcher_overhead_and_scale_out_read_the_allocator_each_run_and_engine_recorded(tmp_path):
    job = str(SCRIPTS / "ending.py")
    one = wwrun_report(tmp_path, "one", job, "ok")
    two = wwrun_report(tmp_path, "two", "--engines", "2", job, "ok", ":", job, "ok")
    read = in_benchmarks(
        "import json, launcher_overhead, scale_out\n"
        "from pathlib import Path\n"
        f"one, two = Path({str(one)!r}), Path({str(two)!r})\n"
        "print(json.dumps({'overhead': launcher_overhead.report_allocator(one),\n"
        "                  'one_engine': scale_out.run_allocators(json.loads(one.read_text())),\n"
        "                  'two_engines': scale_out.run_allocators(json.loads(two.read_text()))}))")
    assert read == {"overhead": "waterwave", "one_engine": ["waterwave"], "two_engines": ["waterwave", "waterwave"]}


def test_waterwave_part_a_plans_for_every_job_at_once():
    """Its Memory stands in for the launcher's, which plans for each job at once (on
    CUDA each one's stream workspaces and thread headroom): with 3 jobs, 3."""
    seen = in_benchmarks(
        "import json, waterwave\n"
        "seen = []\n"
        "class Recorded(waterwave.Memory):\n"
        "    def __init__(self, *args, **options):\n"
        "        super().__init__(*args, **options)\n"
        "        seen.append(self.jobs_at_once)\n"
        "waterwave.Memory = Recorded\n"
        "jobs = [dict(width=16, batch=8, steps=2, seed=i) for i in range(3)]\n"
        "waterwave.trains(jobs, 32 << 20, 'waterwave')\n"
        "print(json.dumps({'seen': seen, 'baseline': waterwave.drop_idle_reserve()}))")
    assert seen == {"seen": [3], "baseline": 0}  # on the CPU the allocator starts afresh for each run


def test_waterwave_parts_takes_only_letters_of_its_parts():
    """`benchmarks/waterwave.py --parts de` runs (d) and (e) alone; anything else is
    refused before a run starts, in one line."""
    done = subprocess.run([sys.executable, str(BENCHMARKS / "waterwave.py"), "--parts", "dx"],
                          capture_output=True, text=True, timeout=300, cwd=CHECKOUT,
                          env=dict(os.environ, PYTHONPATH=str(CHECKOUT)))
    assert done.returncode == 2, done.stderr[-2000:]
    assert "--parts takes letters of abcde, got 'dx'" in done.stderr
    assert "(a) budget" not in done.stdout
