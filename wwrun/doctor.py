"""`wwrun doctor`: what wwrun will use on this machine, and whether each part works.

    wwrun doctor                     # quick (under a minute): versions, allocator build,
                                     # headroom (GPU), Triton kernels, a two-job memory-flow run
    wwrun doctor --full [--out DIR]  # the whole proof, one subprocess per step
    wwrun doctor --full --only kernels
    wwrun doctor --full --budget 540 --out DIR   # the steps that fit in 9 minutes
    wwrun doctor --resume DIR [--budget 540]     # then every step of DIR not yet passed

Quick checks run in this process, except what could take the process down (the
kernels, the launcher run, the headroom probe), which runs in a child. Full steps
each run in their own subprocess with a time limit, so that a crash or a hang in one
is reported and the rest go on; the figures each step prints last (one JSON object on
one line, as every benchmark does) are kept, with the allocator they measured: a
step whose figures name another allocator than the one it claims fails. The full
run first builds (or loads) wwrun's C++ parts in a child, timed, then writes
DIR/doctor.json after every step (a run killed later keeps the finished ones), its
steps' artefacts into DIR too, and prints each step's line as it ends. With
--budget, the build and the steps that fit (by the durations DIR's JSON measured,
else by estimates, with a margin) run and the rest are named for --resume, which
runs every step not yet passed (failed, hung, stopped or never run), so that a proof
longer than a machine's command limit is a few commands. Exit code 0 only if nothing
failed (skipped or remaining is not failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PASS, FAIL, SKIP = "pass", "fail", "skip"
_MARKS = {PASS: "✓", FAIL: "✗", SKIP: "–"}
STEP_LIMIT_S = 600
FULL_LIMIT_S = 25 * 60
_CHECKOUT = Path(__file__).resolve().parents[1]
OFFLINE_INSTALL = "pip install --no-index --no-build-isolation --no-deps -e ."
"""The install that needs no package index (a GPU machine without network): torch and
wwrun's other dependencies are there already, and the setuptools at hand builds it
(OFFLINE_INSTALL_NEEDS). Without any install, `python -m wwrun` from the checkout
works too."""
OFFLINE_INSTALL_NEEDS = "setuptools>=70.1, or wheel"
"""What OFFLINE_INSTALL needs besides torch: without build isolation pip builds the
editable wheel with the setuptools installed, whose `bdist_wheel` command is its own
from 70.1 and the `wheel` package's before (else: "invalid command 'bdist_wheel'")."""


@dataclasses.dataclass
class Check:
    """One line of the doctor's table."""

    name: str
    verdict: str
    detail: str = ""
    advice: str = ""
    seconds: float = 0.0
    figures: dict | list | None = None
    allocator: str | None = None
    """The allocator the check measured ('waterwave', 'native', 'cudaMallocAsync');
    MIXED for a test run whose tests use different ones (each asserts its own); None
    where it measured none."""


MIXED = "mixed"


# --- what a job of the memory-flow and sweep checks runs -----------------------------

# A small training job that also checks the memory it is given: it fills what it frees
# with its own marker words, and counts any other job's marker in what it receives.
JOB_SCRIPT = '''\
import json, sys
import torch

device, steps, index, batch = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
MAGIC = 0x5757_7275_6E00_0000          # a job's marker word is MAGIC + its index
torch.manual_seed(index)
model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 256)).to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
foreign = 0
for _ in range(steps):
    received = torch.empty(1 << 16, dtype=torch.int64, device=device)
    tags = received - MAGIC
    foreign += int(((tags >= 0) & (tags < 1 << 16) & (tags != index)).sum())
    received.fill_(MAGIC + index)
    del received, tags
    x = torch.randn(batch, 256, device=device)
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
allocated = torch.cuda.memory_allocated() if device.startswith("cuda") else None
print(json.dumps({"job": index, "foreign_marker_words": foreign, "allocated": allocated,
                  "loss": float(loss)}))
'''


def _write_job_script(folder: Path) -> Path:
    path = folder / "doctor_job.py"
    path.write_text(JOB_SCRIPT)
    return path


def _wwrun_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "wwrun", *args]


def _last_json(text: str):
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except ValueError:
                return None
    return None


# Batch of the job script. On CUDA its activations (~0.5 GiB) outweigh the fixed
# costs of a job's stream (cuBLAS's workspaces, ~66 MiB on sm_90, kept for good), so
# a limit of 1.5 peaks holds one job's activations beside the other's fixed costs.
_BATCH = {"cpu": 512, "cuda": 32768}


def _jobs_run(device: str, jobs: int, steps: int, folder: Path, *options: str,
              timeout: float = 300, batch: int | None = None) -> tuple[subprocess.CompletedProcess, dict | None, list]:
    """Run `jobs` copies of the job script under wwrun; its report and each job's figures."""
    script = _write_job_script(folder)
    batch = batch or _BATCH["cuda" if device.startswith("cuda") else "cpu"]
    report = folder / f"report-{time.monotonic_ns()}.json"
    argv = ["--device", device, "--quiet", "--log-dir", str(folder / "logs"), "--report", str(report), *options]
    for index in range(jobs):
        if index:
            argv.append(":")
        argv += [str(script), device, str(steps), str(index), str(batch)]
    done = subprocess.run(_wwrun_command(*argv), capture_output=True, text=True, timeout=timeout,
                          env=_child_env(device), stdin=subprocess.DEVNULL)
    data = json.loads(report.read_text()) if report.is_file() else None
    figures = []
    if data:
        for job in data["jobs"]:
            log = Path(job.get("log_dir") or "") / "stdout.log"
            figures.append(_last_json(log.read_text()) if log.is_file() else None)
    return done, data, figures


def _child_env(device: str) -> dict[str, str]:
    env = dict(os.environ)
    if not device.startswith("cuda"):
        env.setdefault("TRITON_INTERPRET", "1")  # Triton runs on the CPU only interpreted
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_CHECKOUT), env.get("PYTHONPATH")) if p)
    return env


# --- quick checks ----------------------------------------------------------------------


def check_environment(device: str) -> Check:
    import torch

    cuda = torch.version.cuda or "none"
    name = torch.cuda.get_device_name() if device.startswith("cuda") else (platform.processor() or platform.machine() or "cpu")
    detail = (f"{device} ({name}), torch {torch.__version__}, CUDA {cuda}, "
              f"Python {platform.python_version()}, {os.cpu_count()} CPU cores")
    install = _install_state()
    figures = {**_versions(device), "install": install}
    advice = ""
    if install == "not installed":  # run from a checkout: fine, but no `wwrun` command
        detail += f"; wwrun not installed, run from {_CHECKOUT}"
        advice = f"to install it without a package index: cd {_CHECKOUT} && {OFFLINE_INSTALL}"
        lacking = offline_install_lacks(_setuptools_version(), importlib.util.find_spec("wheel") is not None)
        if lacking:  # the advice would fail with "invalid command 'bdist_wheel'"
            advice += f" (needs {OFFLINE_INSTALL_NEEDS}: {lacking}; until then, python -m wwrun)"
        figures["offline_install"] = lacking or "ready"
    return Check("environment", PASS, detail, advice, figures=figures)


def _setuptools_version() -> str | None:
    from importlib import metadata

    try:
        return metadata.version("setuptools")
    except metadata.PackageNotFoundError:
        return None


def offline_install_lacks(setuptools: str | None, wheel: bool) -> str | None:
    """What OFFLINE_INSTALL lacks in an environment with this setuptools version
    (None: not installed) and with or without the `wheel` package; None if nothing."""
    if setuptools is None:
        return "setuptools is not installed"
    release = tuple(int(part) for part in re.findall(r"\d+", setuptools)[:2])
    if release >= (70, 1) or wheel:
        return None
    return f"setuptools {setuptools} is older than 70.1 and wheel is not installed"


def _install_state() -> str:
    """'installed', 'editable' (pip install -e) or 'not installed' (run from a checkout)."""
    from importlib import metadata

    try:
        dist = metadata.distribution("wwrun")
    except metadata.PackageNotFoundError:
        return "not installed"
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    return "editable" if direct.get("dir_info", {}).get("editable") else "installed"


def _versions(device: str) -> dict:
    import torch

    figures = {"device": device, "torch": torch.__version__, "cuda": torch.version.cuda,
               "python": platform.python_version(), "host": platform.node(), "cpu_cores": os.cpu_count()}
    if device.startswith("cuda"):
        figures["device_name"] = torch.cuda.get_device_name()
        figures["driver"] = _driver_version()
    return figures


def _driver_version() -> str | None:
    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def check_allocator(device: str) -> Check:
    from wwrun import build
    from wwrun.memory import allocator

    kind = "cuda" if device.startswith("cuda") else "host"
    cache = str(allocator.build_directory(kind))
    figures, where = {"cache": cache}, f"cache {cache}"
    if kind == "cuda":  # torch's guess, or /usr/local/cuda when that one has no headers
        figures["cuda_home"], how = build.cuda_home()
        where += f"; CUDA_HOME {figures['cuda_home']} ({how})"
    try:
        allocator._extension(kind)
    except Exception as exc:  # a compiler error is long: its last line says what failed
        last = (str(exc).strip().splitlines() or [type(exc).__name__])[-1]
        return Check("allocator build", FAIL, f"{kind} allocator: {last}",
                     "install a C++ compiler (g++) and ninja; WWRUN_BUILD_VERBOSE=1 shows the build")
    return Check("allocator build", PASS, f"{kind} allocator built; {where}", figures=figures)


_KERNEL_PROBE = '''\
import json, os, torch
from triton_kernels import pack, unpack, zero_
device = "cuda" if torch.cuda.is_available() else "cpu"
tensors = [torch.randn(n, device=device) for n in (7, 1000, 33)]
copies = [torch.empty_like(t) for t in tensors]
unpack(pack(tensors), copies)
same = all(torch.equal(a, b) for a, b in zip(tensors, copies))
zero_(copies)
zeroed = all(int(c.count_nonzero()) == 0 for c in copies)
mode = "interpreter" if os.environ.get("TRITON_INTERPRET") == "1" else "compiled"
print(json.dumps({"device": device, "mode": mode, "pack_unpack": same, "zero": zeroed}))
'''


def check_kernels(device: str) -> Check:
    done = subprocess.run([sys.executable, "-c", _KERNEL_PROBE], capture_output=True, text=True,
                          timeout=300, env=_child_env(device))
    result = _last_json(done.stdout)
    if done.returncode != 0 or not result:
        return Check("triton kernels", FAIL, _last_line(done.stderr) or f"exit code {done.returncode}",
                     "check that triton matches torch (pip show triton); on a CPU numpy is needed")
    ok = result["pack_unpack"] and result["zero"]
    return Check("triton kernels", PASS if ok else FAIL,
                 f"pack/unpack and zero on {result['device']}, {result['mode']}",
                 "" if ok else "the kernels returned wrong bytes: report it", figures=result)


def check_memory_flow(device: str) -> Check:
    """Two jobs whose summed peaks exceed the limit: both finish, the run stays under it."""
    with tempfile.TemporaryDirectory(prefix="wwrun-doctor-") as tmp:
        folder = Path(tmp)
        done, report, _ = _jobs_run(device, 2, 3, folder)
        if done.returncode != 0 or not report:
            return Check("memory flow", FAIL, "two jobs without a limit: " + _failure(done),
                         "run `wwrun --device %s` on two scripts to see the error" % device)
        peak = max(job.get("peak_memory_bytes") or 0 for job in report["jobs"])
        if peak <= 0:
            return Check("memory flow", FAIL, "the jobs reported no memory", "report it: the engine measured nothing")
        limit = peak * 3 // 2  # room for one job's peak, not for both at once
        done, report, figures = _jobs_run(device, 2, 10, folder, "--memory-limit", str(limit))
    if done.returncode != 0 or not report:
        return Check("memory flow", FAIL, f"two jobs under {_size(limit)}: " + _failure(done),
                     "the engine could not interleave two jobs; rerun with --explain")
    run_peak = report["run"].get("peak_memory_bytes") or 0
    used = report["run"].get("allocator")
    jobs = {job["name"]: {"peak_memory_bytes": job.get("peak_memory_bytes"),
                          "waited_s": job.get("waited_s"),
                          "memory_allocated": (fig or {}).get("allocated")}
            for job, fig in zip(report["jobs"], figures)}
    figures_out = {"limit_bytes": limit, "run_peak_bytes": run_peak, "jobs": jobs, "allocator": used}
    if used != "waterwave":
        return Check("memory flow", FAIL, f"the jobs ran on the {used!r} allocator, not wwrun's",
                     "the allocator build above says why; PYTORCH_ALLOC_CONF must not ask for a backend",
                     figures=figures_out, allocator=used)
    if run_peak > limit:
        return Check("memory flow", FAIL, f"run peak {_size(run_peak)} over the limit {_size(limit)}",
                     "the scheduler let the jobs overrun: report it with the run's --explain", figures=figures_out,
                     allocator=used)
    detail = f"2 jobs, each peaking {_size(peak)}, under a {_size(limit)} limit: run peak {_size(run_peak)}"
    if device.startswith("cuda"):
        detail += "; memory_allocated per job: " + ", ".join(_size(j["memory_allocated"] or 0) for j in jobs.values())
    return Check("memory flow", PASS, detail, figures=figures_out, allocator=used)


def check_headroom(device: str) -> Check:
    """What the device gives outside the allocator, measured as a run measures it
    (`headroom`, in a child: it initialises CUDA)."""
    if not device.startswith("cuda"):
        return Check("headroom", SKIP, "does not apply on the CPU: no driver, library handles or kernels "
                     "take memory beside the allocator there")
    with tempfile.TemporaryDirectory(prefix="wwrun-doctor-") as tmp:
        done = subprocess.run(_in_child("headroom")(device, Path(tmp), Path(tmp)), capture_output=True,
                              text=True, timeout=300, env=_child_env(device), stdin=subprocess.DEVNULL)
    figures = _last_json(done.stdout)
    if done.returncode != 0 or not isinstance(figures, dict):
        return Check("headroom", FAIL, _failure(done), "rerun it alone: wwrun doctor --full --only headroom")
    used = figures.get("allocator")
    if used != "waterwave":
        return Check("headroom", FAIL, f"measured beside the {used!r} allocator, not wwrun's",
                     "the allocator build above says why", figures=figures, allocator=used)
    return Check("headroom", PASS, _headroom_detail(figures), figures=figures, allocator=used)


def _headroom_detail(figures: dict) -> str:
    return (f"outside the allocator {_size(figures['process_bytes'])} at the first warm-up, "
            f"{_size(figures['per_thread_bytes'])} per further thread; each job stream's cuBLAS workspaces "
            f"{_size(figures['stream_fixed_bytes'])}; kept back for one job: {_size(figures['kept_bytes'])}; "
            + ("a job that gives way at the limit parks in host memory" if figures.get("can_park") else
               "a job that gives way at the limit fails: the driver makes no pinned host memory for its pages"))


QUICK: list[Callable[[str], Check]] = [check_environment, check_allocator, check_headroom, check_kernels,
                                       check_memory_flow]


def _title(check: Callable) -> str:
    return check.__name__.removeprefix("check_").replace("_", " ")


def quick(device: str) -> list[Check]:
    checks = []
    for check in QUICK:
        start = time.monotonic()
        try:
            result = check(device)
        except subprocess.TimeoutExpired as exc:
            result = Check(_title(check), FAIL, f"hung: killed after {exc.timeout:.0f} s",
                           "rerun it alone to see where it stops")
        except Exception as exc:  # a check that breaks is a finding, and the others still run
            result = Check(_title(check), FAIL, f"{type(exc).__name__}: {exc}", "report it, with this line")
        result.seconds = round(time.monotonic() - start, 2)
        checks.append(result)
    if not device.startswith("cuda"):
        checks.append(Check("cuda", SKIP, "no CUDA device: the CUDA allocator, GPU tests and benchmarks were not run"))
    return checks


# --- the full proof: one subprocess per step ------------------------------------------


@dataclasses.dataclass
class Step:
    """A step of `--full`: a command run in a child, and what it measures."""

    name: str
    what: str
    command: Callable[[str, Path, Path], list[str] | None]
    """argv for the device, given a scratch folder and the folder for the step's
    artefacts (--out); None when the step has no form there (then skipped)."""
    needs_checkout: bool = False
    allocator: str | None = "waterwave"
    """The allocator the step measures. A step whose figures name it (`allocator`)
    fails when they name another; pytest steps name it from their tests, which
    assert it themselves (MIXED: tests on different allocators); None: the step
    measures no allocator."""
    estimate_s: tuple[float | None, float] = (60, 60)
    """(CPU, CUDA) seconds, for --budget until a measured duration is at hand. The
    CPU ones were measured on 2 busy cores (with room to spare); the CUDA ones are
    estimates for an H100 (22 minutes in all), but gpu-tests' and rule-f's, measured
    on an H200 (198 to 211 s and 19 s; 55 s more for the build on a fresh machine)."""
    shown: tuple[str, ...] = ()
    """Figures the table shows (dotted paths into the step's JSON)."""


def _pytest(*args: str, file: str | None = None) -> list[str]:
    """pytest on one test file (else every test), with no cache left behind."""
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
            str(_CHECKOUT / "tests" / file) if file else str(_CHECKOUT / "tests"), *args]


def _allocator_tests(device: str) -> str:
    return "test_allocator_cuda.py" if device.startswith("cuda") else "test_allocator.py"


def _bench(name: str, *args: str) -> list[str]:
    return [sys.executable, str(_CHECKOUT / "benchmarks" / name), *args]


def _kind(device: str) -> str:
    """'cuda' or 'cpu': what a benchmark's --device takes."""
    return "cuda" if device.startswith("cuda") else "cpu"


def _cuda_only(build: Callable[[str, Path, Path], list[str]]) -> Callable[[str, Path, Path], list[str] | None]:
    return lambda device, tmp, out: build(device, tmp, out) if device.startswith("cuda") else None


def _in_child(function: str) -> Callable[[str, Path, Path], list[str]]:
    """A doctor function run in the step's child: f(device, scratch folder) -> exit code."""
    def command(device: str, tmp: Path, out: Path) -> list[str]:
        code = f"import sys; from wwrun.doctor import {function}; sys.exit({function}({device!r}, {str(tmp)!r}))"
        return [sys.executable, "-c", code]
    return command


def sweep(device: str, folder: str, jobs: int = 40) -> int:
    """40 jobs of a sweep through the queue: each reports its own figures, and no job
    finds another job's marker words in the memory it receives."""
    done, report, figures = _jobs_run(device, jobs, 5, Path(folder), "--max-concurrent", "4", timeout=STEP_LIMIT_S,
                                      batch=_BATCH["cpu"])  # many small jobs
    if not report:
        print(json.dumps({"error": _failure(done)}))
        return 1
    succeeded = sum(job["state"] == "succeeded" for job in report["jobs"])
    foreign = sum((fig or {}).get("foreign_marker_words", 0) for fig in figures)
    attributed = sum(1 for job in report["jobs"] if (job.get("peak_memory_bytes") or 0) > 0)
    print(json.dumps({"jobs": jobs, "succeeded": succeeded, "with_own_peak": attributed,
                      "foreign_marker_words": foreign, "allocator": report["run"].get("allocator")}))
    return 0 if succeeded == jobs and foreign == 0 else 1


def headroom(device: str, folder: str) -> int:
    """`allocator.measure_headroom` as a run calls it (wwrun's allocator installed
    first, then its warm-ups: cuBLAS, cuDNN and a Triton kernel in this thread and in
    more threads at once), and what `device_capacity` keeps back from the device for
    one job at once."""
    from wwrun.memory import allocator

    allocator.install()
    measured = allocator.measure_headroom()
    print(json.dumps({**measured._asdict(), "kept_bytes": allocator.capacity_headroom(measured),
                      "unforeseen_bytes": allocator.CAPACITY_HEADROOM_BYTES,
                      "can_park": allocator.can_park("cuda"), "allocator": allocator.in_use(device)}))
    return 0


def build_parts(device: str, folder: str) -> int:
    """wwrun's C++ parts that the steps on `device` use, built or loaded, each timed
    (about 0 s when built before), and on CUDA the CUDA_HOME the build used."""
    from wwrun import build, parts

    figures: dict = {"seconds": parts.build_all(cuda=device.startswith("cuda"))}
    if device.startswith("cuda"):
        figures["cuda_home"], figures["cuda_home_found"] = build.cuda_home()
    print(json.dumps(figures))
    return 0


_TEARDOWN_NOISE = ("terminate called", "CUDA error", "Segmentation fault", "Exception ignored")


def clean_exit(device: str, folder: str) -> int:
    """Two jobs under wwrun: the process exits 0 with nothing on stderr about teardown."""
    done, report, _ = _jobs_run(device, 2, 3, Path(folder))
    noise = [w for w in _TEARDOWN_NOISE if w in done.stderr]
    print(json.dumps({"exit_code": done.returncode, "teardown_noise": noise,
                      "allocator": (report or {}).get("run", {}).get("allocator")}))
    if done.returncode != 0 or noise:
        print(f"wwrun exited with {done.returncode}" + (f", stderr has {noise}" if noise else ""), file=sys.stderr)
        return 1
    return 0


BUILD = Step("build", "wwrun's C++ parts, built or loaded", _in_child("build_parts"), allocator=None,
             shown=("seconds.host", "seconds.cpu", "seconds.cuda", "seconds.rng", "cuda_home"))
"""Run before the steps by every --full command (not one of STEPS): the time a
fresh machine spends building is then measured inside the budget, and no step's
duration or time limit includes it."""

STEPS: list[Step] = [
    # test_allocator_cuda.py's tests each run a child on wwrun's allocator, as do the
    # fresh_process tests; the rest (engine, offload, kernels, rng) run in pytest's
    # process on PyTorch's native allocator, and one on cudaMallocAsync.
    Step("gpu-tests", "the GPU tests (pytest -m gpu): wwrun's allocator and PyTorch's, each test asserting its own",
         _cuda_only(lambda d, t, o: _pytest("-m", "gpu", "--junitxml", str(o / "gpu-tests.xml"))), True,
         allocator=MIXED, estimate_s=(None, 210)),
    Step("allocator", "allocator vs PyTorch's native and cudaMallocAsync allocators; host pairs/s",
         lambda d, t, o: _bench("allocator.py", "--repeats", "10", "--out", str(o / "allocator_gpu.json")), True,
         estimate_s=(20, 150),
         shown=("host_pairs_per_s", "cpu_routing_ratio", "gpu.latency_ratio",
                "gpu.one_job_throughput_ratio", "gpu.wwrun.one_job_page_moves_per_step")),
    Step("waterwave", "the paper's experiments through the launcher",
         lambda d, t, o: _bench("waterwave.py", *(("--device", "cuda") if d.startswith("cuda") else ("--quick",)),
                                "--out", str(o / f"waterwave-{_kind(d)}.json")), True,
         estimate_s=(300, 500),
         shown=("a_batch_fraction.waterwave_2jobs", "b_speedup_vs_sequential", "b_speedup_vs_processes",
                "b_waterwave_peak_over_budget", "d_single_job_overhead_small", "d_engine_us_per_iteration",
                "e_waterwave_vs_sequential")),
    Step("fragmentation", "random oversubscribed mixes at 32 and 128 MiB: jobs lost, allocated / reserved",
         lambda d, t, o: _bench("fragmentation.py", "--quick", "--no-sequential", "--device", _kind(d),
                                "--out", str(o / f"fragmentation-{_kind(d)}.json")), True,
         estimate_s=(60, 45), shown=("jobs_lost", "median_allocated_over_reserved", "min_allocated_over_reserved")),
    Step("parking", "a job's pages parked in host memory and back: GB/s each way, every byte intact",
         lambda d, t, o: _bench("parking.py", "--device", _kind(d), "--out", str(o / f"parking-{_kind(d)}.json")),
         True, estimate_s=(30, 45), shown=("park_gb_per_s", "unpark_gb_per_s", "slowest_park_s", "can_park")),
    Step("rule-f", "a job waits for another's frees instead of running out of memory",
         lambda d, t, o: _pytest("-k", "rule_f", file=_allocator_tests(d)), True, estimate_s=(15, 20)),
    Step("cudnn-benchmark", "cudnn.benchmark=True in one job while another holds half the device",
         _cuda_only(lambda d, t, o: _pytest("-k", "cudnn", file="test_allocator_cuda.py")), True,
         estimate_s=(None, 30)),
    Step("headroom", "device memory outside the allocator (cuBLAS, cuDNN, Triton warm-ups in 3 threads)",
         _cuda_only(_in_child("headroom")), estimate_s=(None, 30),
         shown=("process_bytes", "per_thread_bytes", "stream_fixed_bytes", "kept_bytes")),
    Step("sweep-40", "40 jobs through the queue: own figures, no other job's bytes readable", _in_child("sweep"),
         estimate_s=(30, 120), shown=("succeeded", "with_own_peak", "foreign_marker_words")),
    Step("scrub", "bytes a job freed read as zero by the next owner",
         lambda d, t, o: _pytest("-k", "scrub or never_reads", file=_allocator_tests(d)), True, estimate_s=(15, 30)),
    Step("kernels", "Triton pack/unpack/zero against copy, torch.cat, _foreach_*, pinned copies",
         lambda d, t, o: _bench("kernels.py", "--out", str(o / "kernels.json")), True, allocator=None,
         estimate_s=(45, 90), shown=("ratios.pack_large_vs_d2d_copy", "ratios.pack_small_vs_copy_loop",
                                     "ratios.zero_large_vs_foreach_zero")),
    Step("clean-exit", "the process exits cleanly (no terminate, no CUDA error at teardown)", _in_child("clean_exit"),
         estimate_s=(15, 30)),
]


def estimate(step: Step, device: str, measured: dict[str, float] | None = None) -> float:
    """Seconds the step is expected to take: as measured before (the JSON's
    `durations`), else its estimate for the device; 0 where it has no form."""
    if measured and step.name in measured:
        return measured[step.name]
    return step.estimate_s[device.startswith("cuda")] or 0.0


PLAN_MARGIN = 0.1
"""Share of a budget a plan leaves free: estimates are guesses (most CUDA ones never
measured) and a measured duration varies from run to run; a step still running at
the budget's end is stopped, and its time is lost."""


def plan(steps: list[Step], device: str, budget_s: float,
         measured: dict[str, float] | None = None) -> tuple[list[Step], list[Step]]:
    """(the steps to run now, the steps that remain): in order, each step whose
    estimate fits in what the budget, less its margin, has left. The first step
    always runs, so that every command makes progress, even with a step longer than
    the budget."""
    now, later, left = [], [], budget_s * (1 - PLAN_MARGIN)
    for step in steps:
        need = estimate(step, device, measured)
        if need <= left or not now:
            now.append(step)
            left -= need
        else:
            later.append(step)
    return now, later


_PYTEST_COUNT = re.compile(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|deselected)")


def _pytest_figures(stdout: str) -> dict | None:
    """The counts of pytest -q's last line ('3 passed, 1 skipped in 9.1s')."""
    found = {{"error": "errors"}.get(kind, kind): int(n) for n, kind in _PYTEST_COUNT.findall(_last_line(stdout))}
    return found or None


def run_step(step: Step, device: str, limit_s: float, out: Path) -> Check:
    """Run one step in a child with a time limit; a crash or a hang is its verdict alone.
    Its artefacts go to `out`; a step stopped at the time limit says so in its detail."""
    if step.needs_checkout and not (_CHECKOUT / "tests").is_dir():
        return Check(step.name, SKIP, "needs a checkout of wwrun (tests/ and benchmarks/)",
                     "clone it and run `python -m wwrun doctor --full` from there (no install needed)")
    with tempfile.TemporaryDirectory(prefix=f"wwrun-doctor-{step.name}-") as tmp:
        command = step.command(device, Path(tmp), out)
        if command is None:
            return Check(step.name, SKIP, f"does not apply on {device}: {step.what}")
        start = time.monotonic()
        # Its own session, so that a hang is ended with everything the step started.
        child = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 env=_child_env(device), stdin=subprocess.DEVNULL, cwd=tmp,
                                 start_new_session=True)
        try:
            stdout, stderr = child.communicate(timeout=limit_s)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.communicate()
            return Check(step.name, FAIL, f"{_HUNG} {limit_s:.0f} s",
                         f"rerun it alone: wwrun doctor --full --only {step.name}",
                         seconds=round(time.monotonic() - start, 2))
        except BaseException:  # Ctrl-C, SIGTERM: the step in its own session ends with the doctor
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            raise
        seconds = round(time.monotonic() - start, 2)
    done = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    is_pytest = command[1:3] == ["-m", "pytest"]  # its tests check their allocator themselves
    figures = _pytest_figures(stdout) if is_pytest else _last_json(stdout)
    figures = figures if isinstance(figures, (dict, list)) else None
    measured = (figures or {}).get("allocator") if isinstance(figures, dict) else None
    allocator = step.allocator if is_pytest else measured
    if done.returncode != 0:
        verdict, detail = FAIL, _failure(done)
    elif step.allocator and not is_pytest and measured != step.allocator:
        # Figures of another allocator than the one claimed are worse than none.
        verdict = FAIL
        detail = (f"measured the {measured!r} allocator, not {step.allocator!r}" if measured
                  else f"its figures do not say which allocator they measured (expected {step.allocator!r})")
    else:
        verdict, detail = PASS, step.what + _summary(figures, step.shown)
    advice = f"rerun it alone: wwrun doctor --full --only {step.name}" if verdict == FAIL else ""
    return Check(step.name, verdict, detail, advice, seconds, figures, allocator)


OUT_OF_TIME = "out of time"
_HUNG = "hung: killed after"


def full(device: str, steps: list[Step] | None = None, budget_s: float = FULL_LIMIT_S,
         step_limit_s: float = STEP_LIMIT_S, out: Path | None = None) -> Iterator[Check]:
    """Each step's check as it ends, its artefacts in `out` (default: a scratch
    folder). Steps the budget leaves no time for are skipped as OUT_OF_TIME: those
    that would start with less than 10 s left, and those it stops (the first step
    excepted: a step longer than the whole budget fails, as a hang does)."""
    deadline = time.monotonic() + budget_s
    for number, step in enumerate(steps if steps is not None else STEPS):
        left = deadline - time.monotonic()
        if left < 10:
            yield Check(step.name, SKIP, f"{OUT_OF_TIME} (the steps' budget is {budget_s:.0f} s)")
            continue
        limit = min(step_limit_s, left)
        with tempfile.TemporaryDirectory(prefix="wwrun-doctor-out-") as scratch:
            check = run_step(step, device, limit, out or Path(scratch))
        if number and limit < step_limit_s and check.verdict == FAIL and check.detail.startswith(_HUNG):
            check = Check(step.name, SKIP, f"{OUT_OF_TIME}: stopped at the end of the budget after "
                          f"{check.seconds:.0f} s", seconds=check.seconds)
        yield check


# --- output ----------------------------------------------------------------------------


def line(c: Check, width: int) -> str:
    """A check's line in the table (and its advice below it)."""
    text = f"{_MARKS[c.verdict]} {c.name:<{width}}  {c.detail}" + (f"  ({c.seconds:.0f} s)" if c.seconds >= 1 else "")
    if c.advice:
        text += f"\n  {'':<{width}}  → {c.advice}"
    return text


def counts(checks: list[Check]) -> str:
    failed = sum(c.verdict == FAIL for c in checks)
    skipped = sum(c.verdict == SKIP for c in checks)
    return f"{len(checks) - failed - skipped} passed, {failed} failed, {skipped} skipped"


def table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    return "\n".join([*(line(c, width) for c in checks), counts(checks)])


RESULTS_FILE = "doctor.json"


def write_json(path: Path, data: dict) -> None:
    """Written whole and renamed into place: a run killed mid-write leaves the last one."""
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(partial, path)


def _figure(key: str, value) -> str:
    """A figure as the table shows it: bytes in binary units, large numbers in k/M,
    others to 3 significant digits."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if key.endswith("bytes"):
        return _size(value)
    if abs(value) >= 1e6:
        return f"{value / 1e6:.3g}M"
    if abs(value) >= 1e4:
        return f"{value / 1e3:.3g}k"
    return str(value) if isinstance(value, int) else f"{value:.3g}"


def _lookup(figures: dict, path: str):
    for part in path.split("."):
        if not isinstance(figures, dict) or part not in figures:
            return None
        figures = figures[part]
    return figures


def _summary(figures, shown: tuple[str, ...] = ()) -> str:
    """A step's figures, briefly, for the table (the JSON keeps them all): those the
    step names, else its first scalars."""
    if not isinstance(figures, dict):
        return ""
    if shown:
        pairs = [(path.rsplit(".", 1)[-1], _lookup(figures, path)) for path in shown]
    else:
        pairs = list(figures.items())
    scalars = [f"{k}={_figure(k, v)}" for k, v in pairs
               if isinstance(v, (int, float, str)) and k != "allocator" and len(str(v)) < 24]
    return f": {', '.join(scalars[:5])}" if scalars else ""


def _failure(done: subprocess.CompletedProcess) -> str:
    if done.returncode < 0:
        return f"crashed ({signal.Signals(-done.returncode).name})"
    line = _last_line(done.stderr) or _last_line(done.stdout)
    return f"exit code {done.returncode}" + (f": {line}" if line else "")


def _last_line(text: str) -> str:
    lines = [line.strip() for line in (text or "").strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line, exit code 2, as every wwrun error
        self.exit(2, f"{self.prog}: {message}\n")


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def _terminated(signum, frame):
    raise SystemExit(128 + signum)


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="wwrun doctor", description=__doc__.splitlines()[0],
                     epilog=f"Offline (no package index): {OFFLINE_INSTALL} (needs {OFFLINE_INSTALL_NEEDS}), "
                            "or `python -m wwrun doctor` from the checkout without installing.")
    parser.add_argument("--full", action="store_true", help="the whole proof, one subprocess per step")
    parser.add_argument("--out", type=Path, metavar="DIR", help="folder for --full's doctor.json and every artefact "
                        "of its steps (default: a new folder in the system's temporary folder); one that "
                        "holds a doctor.json already is refused: go on with it with --resume DIR")
    parser.add_argument("--only", choices=[s.name for s in STEPS], help="with --full: run this step alone")
    parser.add_argument("--budget", type=_seconds, metavar="SECONDS",
                        help="with --full: build wwrun's C++ parts, then run the steps that fit in what "
                             "is left of SECONDS (by their measured or estimated durations, less a "
                             f"{PLAN_MARGIN * 100:.0f}%% margin) and name the rest, for --resume")
    parser.add_argument("--resume", type=Path, metavar="DIR",
                        help="go on with the --full run whose doctor.json is in DIR: run every step "
                             "that has not passed there (never run, failed, hung, stopped at a budget's "
                             "end, skipped), keep the passed ones (implies --full and --out DIR)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    if args.resume is not None:
        if args.out is not None and args.out.resolve() != args.resume.resolve():
            parser.error("--resume DIR writes into DIR: leave out --out")
        if not (args.resume / RESULTS_FILE).is_file():
            parser.error(f"--resume {args.resume}: no {RESULTS_FILE} there to go on from")
        args.full, args.out = True, args.resume
    for flag in ("only", "budget"):
        if getattr(args, flag) is not None and not args.full:
            parser.error(f"--{flag} needs --full")
    if args.out is not None and args.out.exists() and not args.out.is_dir():
        parser.error(f"--out {args.out}: not a folder")
    if args.full and args.resume is None and args.out is not None and (args.out / RESULTS_FILE).exists():
        # Writing over it would lose its steps; adding to it is what --resume does.
        parser.error(f"--out {args.out}: it holds a {RESULTS_FILE} already; add to it with "
                     f"--resume {args.out}, or choose another --out")
    import torch

    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    elif device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible here")
    command = "wwrun doctor" + ("".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:])))
    if not args.full:
        checks = quick(device)
        print(table(checks))
        return 1 if any(c.verdict == FAIL for c in checks) else 0

    out = args.out
    if out is None:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        out = Path(tempfile.mkdtemp(prefix=f"wwrun-doctor-{stamp}-"))
    out.mkdir(parents=True, exist_ok=True)
    path = out / RESULTS_FILE
    started = time.monotonic()  # a --budget counts from here: the build is in it
    environment = check_environment(device)
    data = {**_versions(device), "commands": [], "date": None, "passed": True, "complete": False,
            "durations": {}, "remaining": [], "steps": [dataclasses.asdict(environment)]}
    if args.resume is not None:
        try:
            data = json.loads(path.read_text())
            whole = (all(isinstance(s["name"], str) for s in data["steps"])
                     and isinstance(data["durations"], dict) and isinstance(data["commands"], list))
        except (ValueError, TypeError, KeyError):
            whole = False
        if not whole:  # what the run goes on from
            parser.error(f"--resume {args.resume}: {RESULTS_FILE} is not a doctor's JSON")
        mismatch = [k for k in ("device", "device_name", "torch") if data.get(k) != environment.figures.get(k)]
        if mismatch:
            parser.error(f"--resume {args.resume}: made with another {', '.join(mismatch)} "
                         f"({', '.join(str(data.get(k)) for k in mismatch)}); start a new --out")
    # A pass is kept; every other step runs (again): one that failed, hung, was
    # stopped at a budget's end or never ran, and one skipped here before.
    passed = {s["name"] for s in data["steps"] if s["verdict"] == PASS}
    steps = [s for s in STEPS if (args.only is None or s.name == args.only) and s.name not in passed]
    budget = args.budget or FULL_LIMIT_S
    data["commands"].append(command)

    def record(check: Check) -> None:
        """Its verdict in the JSON, in place of an earlier one of the same name."""
        entry = dataclasses.asdict(check)
        names = [s["name"] for s in data["steps"]]
        if check.name in names:
            data["steps"][names.index(check.name)] = entry
        else:
            data["steps"].append(entry)

    def save() -> None:
        have = {s["name"] for s in data["steps"]}
        data["remaining"] = [s.name for s in STEPS if s.name not in have]
        data["complete"] = not data["remaining"]
        data["passed"] = not any(s["verdict"] == FAIL for s in data["steps"])
        data["date"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        write_json(path, data)

    print(f"results: {path}")
    width = max(len(s.name) for s in STEPS)
    if args.resume is None:
        print(line(environment, width), flush=True)
    save()
    checks = [environment] if args.resume is None else []
    if not steps:
        print(f"nothing to run: {args.only or 'every step'} passed before", flush=True)
    main_thread = threading.current_thread() is threading.main_thread()
    # A command limit's SIGTERM (`timeout`) ends the running step too (run_step), as Ctrl-C does.
    before = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    try:
        if steps:  # the build first, inside the budget: on a fresh machine it takes a minute or more
            build = run_step(BUILD, device, min(STEP_LIMIT_S, budget), out)
            checks.append(build)
            record(build)
            save()
            print(line(build, width), flush=True)
            if build.verdict == FAIL:  # every step would fail on it: they remain for --resume
                steps = []
        left = budget - (time.monotonic() - started)
        if args.budget is not None and steps:
            steps, later = plan(steps, device, left, data["durations"])
            if later:
                print(f"within the {left:.0f} s left: {', '.join(s.name for s in steps)}; "
                      f"left for later: {', '.join(s.name for s in later)}", flush=True)
        for check in full(device, steps, budget_s=left, out=out):
            if check.seconds:  # also a step the budget stopped: it takes at least that long
                data["durations"][check.name] = check.seconds
            if not (check.verdict == SKIP and check.detail.startswith(OUT_OF_TIME)):  # else it remains
                checks.append(check)
                record(check)
            save()  # after every step: a run killed later keeps this one
            print(line(check, width), flush=True)
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, before)
    print(counts(checks))
    failed = [s["name"] for s in data["steps"] if s["verdict"] == FAIL and s["name"] in {t.name for t in STEPS}]
    if data["remaining"] or failed:
        todo = [f"{what}: {', '.join(names)}" for what, names in (("remaining", data["remaining"]),
                                                                  ("failed", failed)) if names]
        print(f"{'; '.join(todo)}; go on with: wwrun doctor --full --resume {out}"
              + (f" --budget {args.budget:g}" if args.budget else ""))
    print(f"results: {path}")
    return 1 if any(c.verdict == FAIL for c in checks) else 0
