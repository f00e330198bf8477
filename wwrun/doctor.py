"""`wwrun doctor`: what wwrun will use on this machine, and whether each part works.

    wwrun doctor                     # quick (under a minute): versions, allocator build,
                                     # Triton kernels, a two-job memory-flow run
    wwrun doctor --full [--out DIR]  # the whole proof, one subprocess per step
    wwrun doctor --full --only kernels

Quick checks run in this process, except what could take the process down (the
kernels, the launcher run), which runs in a child. Full steps each run in their own
subprocess with a time limit, so that a crash or a hang in one is reported and the
rest go on; the figures each step prints last (one JSON object on one line, as every
benchmark does) are kept. The full run writes one JSON file into DIR and prints a
table. Exit code 0 only if nothing failed (skipped is not failed).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PASS, FAIL, SKIP = "pass", "fail", "skip"
_MARKS = {PASS: "✓", FAIL: "✗", SKIP: "–"}
STEP_LIMIT_S = 600
FULL_LIMIT_S = 25 * 60
_CHECKOUT = Path(__file__).resolve().parents[1]


@dataclasses.dataclass
class Check:
    """One line of the doctor's table."""

    name: str
    verdict: str
    detail: str = ""
    advice: str = ""
    seconds: float = 0.0
    figures: dict | list | None = None


# --- what a job of the memory-flow and sweep checks runs -----------------------------

# A small training job that also checks the memory it is given: it fills what it frees
# with its own marker words, and counts any other job's marker in what it receives.
JOB_SCRIPT = '''\
import json, sys
import torch

device, steps, index = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
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
    x = torch.randn(512, 256, device=device)
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


def _jobs_run(device: str, jobs: int, steps: int, folder: Path, *options: str,
              timeout: float = 300) -> tuple[subprocess.CompletedProcess, dict | None, list]:
    """Run `jobs` copies of the job script under wwrun; its report and each job's figures."""
    script = _write_job_script(folder)
    report = folder / f"report-{time.monotonic_ns()}.json"
    argv = ["--device", device, "--quiet", "--log-dir", str(folder / "logs"), "--report", str(report), *options]
    for index in range(jobs):
        if index:
            argv.append(":")
        argv += [str(script), device, str(steps), str(index)]
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
    return Check("environment", PASS, detail, figures=_versions(device))


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
    jobs = {job["name"]: {"peak_memory_bytes": job.get("peak_memory_bytes"),
                          "waited_s": job.get("waited_s"),
                          "memory_allocated": (fig or {}).get("allocated")}
            for job, fig in zip(report["jobs"], figures)}
    figures_out = {"limit_bytes": limit, "run_peak_bytes": run_peak, "jobs": jobs}
    if run_peak > limit:
        return Check("memory flow", FAIL, f"run peak {_size(run_peak)} over the limit {_size(limit)}",
                     "the scheduler let the jobs overrun: report it with the run's --explain", figures=figures_out)
    detail = f"2 jobs, each peaking {_size(peak)}, under a {_size(limit)} limit: run peak {_size(run_peak)}"
    if device.startswith("cuda"):
        detail += "; memory_allocated per job: " + ", ".join(_size(j["memory_allocated"] or 0) for j in jobs.values())
    return Check("memory flow", PASS, detail, figures=figures_out)


QUICK: list[Callable[[str], Check]] = [check_environment, check_allocator, check_kernels, check_memory_flow]


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
    """A step of `--full`: a command run in a child, and what it needs."""

    name: str
    what: str
    command: Callable[[str, Path], list[str] | None]
    """argv for the device, or None when the step has no form there (then skipped)."""
    needs_checkout: bool = False
    verdict: Callable[[subprocess.CompletedProcess, object], tuple[str, str]] | None = None
    """(verdict, detail) from the finished child and its last JSON line; default: exit code."""


def _pytest(*args: str) -> list[str]:
    return [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(_CHECKOUT / "tests"), *args]


def _bench(name: str, *args: str) -> list[str]:
    return [sys.executable, str(_CHECKOUT / "benchmarks" / name), *args]


def _cuda_only(build: Callable[[str, Path], list[str]]) -> Callable[[str, Path], list[str] | None]:
    return lambda device, tmp: build(device, tmp) if device.startswith("cuda") else None


def _sweep_command(device: str, tmp: Path) -> list[str]:
    code = ("import sys; from wwrun.doctor import sweep; "
            f"sys.exit(sweep({device!r}, {str(tmp)!r}))")
    return [sys.executable, "-c", code]


def sweep(device: str, folder: str, jobs: int = 40) -> int:
    """40 jobs of a sweep through the queue: each reports its own figures, and no job
    finds another job's marker words in the memory it receives."""
    done, report, figures = _jobs_run(device, jobs, 5, Path(folder), "--max-concurrent", "4", timeout=STEP_LIMIT_S)
    if not report:
        print(json.dumps({"error": _failure(done)}))
        return 1
    succeeded = sum(job["state"] == "succeeded" for job in report["jobs"])
    foreign = sum((fig or {}).get("foreign_marker_words", 0) for fig in figures)
    attributed = sum(1 for job in report["jobs"] if (job.get("peak_memory_bytes") or 0) > 0)
    print(json.dumps({"jobs": jobs, "succeeded": succeeded, "with_own_peak": attributed,
                      "foreign_marker_words": foreign}))
    return 0 if succeeded == jobs and foreign == 0 else 1


def _exit_command(device: str, tmp: Path) -> list[str]:
    script = _write_job_script(tmp)
    return _wwrun_command("--device", device, "--quiet", "--log-dir", str(tmp / "logs"),
                          str(script), device, "3", "0", ":", str(script), device, "3", "1")


def _clean_exit(done: subprocess.CompletedProcess, _figures) -> tuple[str, str]:
    noise = [w for w in ("terminate called", "CUDA error", "Segmentation fault", "Exception ignored")
             if w in done.stderr]
    if done.returncode != 0 or noise:
        return FAIL, f"exit code {done.returncode}" + (f", stderr has {noise}" if noise else "")
    return PASS, "two jobs ran and the process exited 0 with nothing on stderr about teardown"


STEPS: list[Step] = [
    Step("gpu-tests", "the GPU tests (pytest -m gpu)", _cuda_only(lambda d, t: _pytest("-m", "gpu")), True),
    Step("allocator", "allocator vs PyTorch's native and cudaMallocAsync allocators; host pairs/s",
         lambda d, t: _bench("allocator.py", "--repeats", "10"), True),
    Step("waterwave", "the paper's experiments through the launcher",
         lambda d, t: _bench("waterwave.py", "--device", "cuda") if d.startswith("cuda")
         else _bench("waterwave.py", "--quick"), True),
    Step("rule-f", "a job waits for another's frees instead of running out of memory",
         lambda d, t: _pytest("-k", "rule_f", str(_CHECKOUT / "tests" / (
             "test_allocator_cuda.py" if d.startswith("cuda") else "test_allocator.py"))), True),
    Step("cudnn-benchmark", "cudnn.benchmark=True in one job while another holds half the device",
         _cuda_only(lambda d, t: _pytest("-k", "cudnn", str(_CHECKOUT / "tests" / "test_allocator_cuda.py"))), True),
    Step("sweep-40", "40 jobs through the queue: own figures, no other job's bytes readable", _sweep_command),
    Step("scrub", "bytes a job freed read as zero by the next owner",
         lambda d, t: _pytest("-k", "scrub or never_reads", str(_CHECKOUT / "tests" / (
             "test_allocator_cuda.py" if d.startswith("cuda") else "test_allocator.py"))), True),
    Step("kernels", "Triton pack/unpack/zero against copy, torch.cat, _foreach_*, pinned copies",
         lambda d, t: _bench("kernels.py"), True),
    Step("clean-exit", "the process exits cleanly (no terminate, no CUDA error at teardown)", _exit_command,
         verdict=_clean_exit),
]


def run_step(step: Step, device: str, limit_s: float) -> Check:
    """Run one step in a child with a time limit; a crash or a hang is its verdict alone."""
    if step.needs_checkout and not (_CHECKOUT / "tests").is_dir():
        return Check(step.name, SKIP, "needs a checkout of wwrun (tests/ and benchmarks/)")
    with tempfile.TemporaryDirectory(prefix=f"wwrun-doctor-{step.name}-") as tmp:
        command = step.command(device, Path(tmp))
        if command is None:
            return Check(step.name, SKIP, f"no form on {device}: {step.what}")
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
            return Check(step.name, FAIL, f"hung: killed after {limit_s:.0f} s",
                         f"rerun it alone: wwrun doctor --full --only {step.name}",
                         seconds=round(time.monotonic() - start, 2))
        seconds = round(time.monotonic() - start, 2)
        done = subprocess.CompletedProcess(command, child.returncode, stdout, stderr)
    figures = _last_json(done.stdout)
    if step.verdict is not None:
        verdict, detail = step.verdict(done, figures)
    elif done.returncode == 0:
        verdict, detail = PASS, step.what + _summary(figures)
    else:
        verdict, detail = FAIL, _failure(done)
    advice = f"rerun it alone: wwrun doctor --full --only {step.name}" if verdict == FAIL else ""
    return Check(step.name, verdict, detail, advice, seconds, figures if isinstance(figures, (dict, list)) else None)


def full(device: str, steps: list[Step] | None = None, budget_s: float = FULL_LIMIT_S,
         step_limit_s: float = STEP_LIMIT_S) -> Iterator[Check]:
    """Each step's check as it ends (the environment first)."""
    yield check_environment(device)
    deadline = time.monotonic() + budget_s
    for step in steps if steps is not None else STEPS:
        left = deadline - time.monotonic()
        if left < 10:
            yield Check(step.name, SKIP, f"out of time (the full proof is capped at {budget_s / 60:.0f} min)")
            continue
        yield run_step(step, device, min(step_limit_s, left))


# --- output ----------------------------------------------------------------------------


def table(checks: list[Check]) -> str:
    width = max(len(c.name) for c in checks)
    lines = []
    for c in checks:
        lines.append(f"{_MARKS[c.verdict]} {c.name:<{width}}  {c.detail}" + (f"  ({c.seconds:.0f} s)" if c.seconds >= 1 else ""))
        if c.verdict == FAIL and c.advice:
            lines.append(f"  {'':<{width}}  → {c.advice}")
    failed = sum(c.verdict == FAIL for c in checks)
    skipped = sum(c.verdict == SKIP for c in checks)
    lines.append(f"{len(checks) - failed - skipped} passed, {failed} failed, {skipped} skipped")
    return "\n".join(lines)


def write_json(checks: list[Check], device: str, command: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    figures = _versions(device)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    slug = "".join(ch if ch.isalnum() else "_" for ch in figures.get("device_name", device).lower()).strip("_")
    path = out / f"doctor-{slug}-{stamp}.json"
    data = {**figures, "command": command, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
            "passed": not any(c.verdict == FAIL for c in checks),
            "steps": [dataclasses.asdict(c) for c in checks]}
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _summary(figures) -> str:
    """A step's scalar figures, briefly, for the table (the JSON keeps them all)."""
    if not isinstance(figures, dict):
        return ""
    scalars = [f"{k}={v}" for k, v in figures.items() if isinstance(v, (int, float, str)) and len(str(v)) < 24]
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


def main(argv: list[str] | None = None) -> int:
    parser = _Parser(prog="wwrun doctor", description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the whole proof, one subprocess per step")
    parser.add_argument("--out", type=Path, help="folder for --full's JSON (default: benchmarks/results/ "
                        "of the checkout, else the current folder)")
    parser.add_argument("--only", choices=[s.name for s in STEPS], help="with --full: run this step alone")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    args = parser.parse_args(argv)
    if args.only and not args.full:
        parser.error("--only needs --full")
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
    out = args.out or (_CHECKOUT / "benchmarks" / "results" if (_CHECKOUT / "benchmarks").is_dir() else Path.cwd())
    if out.exists() and not out.is_dir():
        parser.error(f"--out {out}: not a folder")
    steps = [s for s in STEPS if s.name == args.only] if args.only else None
    checks = []
    for check in full(device, steps):
        checks.append(check)
        print(table([check]).splitlines()[0], flush=True)
    path = write_json(checks, device, command, out)
    print()
    print(table(checks))
    print(f"results: {path}")
    return 1 if any(c.verdict == FAIL for c in checks) else 0
