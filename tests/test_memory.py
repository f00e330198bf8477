"""The run's memory as one truth (wwrun/memory/__init__.py): the allocator measures
every byte on the CPU as on a GPU, the engine plans with its figures, and the run
stays within --memory-limit as the allocator and the operating system see it."""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from wwrun.memory import host_capacity, torch_backend_requested

SCRIPTS = Path(__file__).resolve().parent / "scripts"
CHECKOUT = Path(__file__).resolve().parents[1]
MiB = 1 << 20


def _env(**extra) -> dict:
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(CHECKOUT), env.get("PYTHONPATH")) if p)
    return env


def _wwrun_measured(tmp_path: Path, *argv: str) -> tuple[dict, int]:
    """Runs wwrun in a child: its report and the child's max resident bytes."""
    report = tmp_path / f"report-{len(list(tmp_path.glob('report-*')))}.json"
    probe = (
        "import resource, runpy, sys\n"
        "sys.argv = ['wwrun'] + sys.argv[1:]\n"
        "try:\n"
        "    runpy.run_module('wwrun', run_name='__main__')\n"
        "finally:\n"
        "    print('maxrss', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", probe, "--device", "cpu", "--quiet", "--log-dir", str(tmp_path / "logs"),
         "--report", str(report), *argv],
        capture_output=True, text=True, timeout=300, env=_env(OMP_NUM_THREADS="1"),
    )
    assert report.is_file(), done.stderr
    maxrss = int(done.stderr.rsplit("maxrss", 1)[1].split()[0]) * 1024  # Linux: KiB
    return json.loads(report.read_text()), maxrss


def _child_figures(code: str):
    """Runs `code` in a fresh interpreter; the JSON of its last line."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


def _stdout(report: dict, job: dict) -> str:
    return (Path(report["run"]["log_dir"]) / job["name"] / "stdout.log").read_text()


def test_temporaries_the_engine_cannot_see_as_saved_tensors_stay_under_the_limit(tmp_path):
    """Jobs whose forward makes a large temporary (not saved for backward): their
    summed peaks are over the limit, yet all finish under it, as the allocator and
    the operating system measure; without a limit the same jobs peak well above."""
    script = str(SCRIPTS / "temporaries.py")
    three = [script, ":", script, ":", script]
    alone, alone_rss = _wwrun_measured(tmp_path, script)
    solo = alone["run"]["peak_reserved_bytes"]
    limit = 2 * solo  # two at once at most; three do not fit
    unlimited, _ = _wwrun_measured(tmp_path, *three)
    assert all(job["state"] == "succeeded" for job in unlimited["jobs"])
    assert unlimited["run"]["peak_reserved_bytes"] > limit  # so this test can fail

    limited, limited_rss = _wwrun_measured(tmp_path, "--memory-limit", str(limit), *three)
    assert [job["state"] for job in limited["jobs"]] == ["succeeded"] * 3, [j["error"] for j in limited["jobs"]]
    assert limited["run"]["memory_limit_bytes"] == limit
    assert limited["run"]["peak_memory_bytes"] <= limited["run"]["peak_reserved_bytes"] <= limit
    # The process as the OS sees it: one job's resident memory, plus at most the rest
    # of the limit, plus a stated slack for what is not torch's (three jobs' Python
    # state, their threads and log pipes).
    slack = 48 * MiB
    assert limited_rss <= alone_rss + (limit - solo) + slack, (limited_rss / MiB, alone_rss / MiB)
    losses = {_stdout(limited, job) for job in limited["jobs"]}
    assert losses == {_stdout(alone, alone["jobs"][0])}  # the same numerics as alone


@pytest.mark.parametrize("width, batch", [(128, 8192), (64, 15560)])
def test_two_jobs_that_each_fit_alone_both_finish_under_a_limit_that_holds_one(tmp_path, width, batch):
    """Each job's peak is two thirds of the limit: they take turns. Two ways this
    failed: once larger blocks' segments reserved the whole limit, a job's small
    blocks (its logits) found no segment of their own size class (now idle pages move
    to whichever range needs them, Note [Layouts]); and the other job's pass started
    during a newcomer's first backward, which its profile had not measured (now no
    pass starts beside a profiled iteration until its step)."""
    job = [str(CHECKOUT / "benchmarks" / "train_job.py"), "--width", str(width), "--batch", str(batch), "--steps", "6"]
    report, _ = _wwrun_measured(tmp_path, "--memory-limit", "32MiB", *job, ":", *job, "--seed", "1")
    assert [j["state"] for j in report["jobs"]] == ["succeeded"] * 2, [j["error"] for j in report["jobs"]]
    assert report["run"]["peak_reserved_bytes"] <= 32 * MiB
    assert all(j["peak_memory_bytes"] > 16 * MiB for j in report["jobs"])  # more than half each


def test_several_passes_a_step_and_updates_by_hand_take_turns_and_train_as_alone(tmp_path):
    """Two patterns of real scripts: LBFGS, whose step runs up to 5 forward and
    backward passes and whose history grows after the first step, and weights
    updated by hand with no optimizer. Two of each under a limit that holds about two
    of them: all finish within it with the losses they print alone, and each reports
    3 iterations (LBFGS's optimizer steps; the passes of the one with no optimizer)."""
    script = str(SCRIPTS / "steps_by_closure_or_hand.py")
    alone = {kind: _wwrun_measured(tmp_path, script, kind)[0] for kind in ("lbfgs", "by_hand")}
    peaks = {kind: report["jobs"][0]["peak_memory_bytes"] for kind, report in alone.items()}
    limit = 2 * max(peaks.values())
    assert 2 * sum(peaks.values()) > 1.4 * limit  # so they must take turns
    kinds = ["lbfgs", "lbfgs", "by_hand", "by_hand"]
    argv = [arg for kind in kinds for arg in (":", script, kind)][1:]
    report, _ = _wwrun_measured(tmp_path, "--memory-limit", str(limit), *argv)
    assert [job["state"] for job in report["jobs"]] == ["succeeded"] * 4, [j["error"] for j in report["jobs"]]
    assert report["run"]["peak_reserved_bytes"] <= limit
    assert sum(job["wait_s"] for job in report["jobs"]) > 0
    for kind, job in zip(kinds, report["jobs"]):
        assert _stdout(report, job) == _stdout(alone[kind], alone[kind]["jobs"][0])
        assert job["iterations"] == 3


def test_a_job_that_allocates_until_the_machine_refuses_ends_alone(tmp_path):
    """Under an address-space limit, one job takes all it can while the other then
    starts OpenMP's threads (its first parallel region). Without wwrun's CPU
    allocator the machine refuses the threads and libgomp ends the whole process;
    with it, the greedy job is refused by the allocator, with room left for threads."""
    baseline = subprocess.run(
        [sys.executable, "-c", "import torch, wwrun.memory.allocator; print(open('/proc/self/statm').read())"],
        capture_output=True, text=True, timeout=120, env=_env(),
    )
    mapped = int(baseline.stdout.split()[0]) * os.sysconf("SC_PAGE_SIZE")
    limit = mapped + 1536 * MiB
    script = (
        "import resource, runpy, sys\n"
        f"resource.setrlimit(resource.RLIMIT_AS, ({limit}, resource.RLIM_INFINITY))\n"
        "sys.argv = ['wwrun'] + sys.argv[1:]\n"
        "runpy.run_module('wwrun', run_name='__main__')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script, "--device", "cpu", "--log-dir", str(tmp_path / "logs"),
         str(SCRIPTS / "squeeze" / "hog.py"), ":", str(SCRIPTS / "squeeze" / "calm.py")],
        capture_output=True, text=True, timeout=300,
        env=_env(SQUEEZE_DIR=str(tmp_path), OMP_NUM_THREADS="4"),
    )
    assert "Thread creation failed" not in done.stderr
    assert done.returncode == 0, done.stderr[-2000:]
    assert "[hog] refused after" in done.stdout
    assert re.search(r"^\[calm\] threads \d+ done$", done.stdout, re.M)


def test_a_job_past_the_memory_limit_on_the_cpu_is_told_the_limit_is_reached(tmp_path):
    """On the CPU the run's limit is the allocator's reserved limit, as on a GPU: a job
    that would pass it is told so, with the limit, not that the device gave no more
    pages (the CPU allocator once held the limit only as its backend's capacity)."""
    script = tmp_path / "greedy.py"
    script.write_text("import torch\nheld = [torch.ones(6 << 20, dtype=torch.uint8) for _ in range(8)]\n")
    report, _ = _wwrun_measured(tmp_path, "--memory-limit", "32MiB", str(script))
    [job] = report["jobs"]
    assert job["state"] == "failed", job
    assert "OutOfMemoryError" in job["error"], job
    assert "the device memory limit of 32.00 MiB is reached" in job["error"], job["error"]
    assert "gave no more pages" not in job["error"]


def test_without_a_limit_the_cpu_allocator_keeps_room_for_what_is_not_torch_s():
    available = host_capacity()
    assert 0 < available
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        pytest.skip("this process already runs under an address-space limit")
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (mapped + 2048 * MiB, hard))
    try:
        capped = host_capacity()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert capped <= 2048 * MiB - 512 * MiB  # under the limit, less the headroom
    assert capped < available


def test_a_job_s_own_threads_count_to_the_job(tmp_path):
    """Tensors a job's threads make count to the job (and to its peak), not to
    nobody: the report's peak holds the thread's 64 MiB."""
    script = tmp_path / "threaded.py"
    script.write_text(
        "import threading, torch\n"
        "held = []\n"
        "t = threading.Thread(target=lambda: held.append(torch.ones(16 << 20)))\n"
        "t.start(); t.join()\n"
        "print(int(held[0].sum()))\n"
    )
    report, _ = _wwrun_measured(tmp_path, str(script))
    (job,) = report["jobs"]
    assert job["state"] == "succeeded"
    assert job["peak_memory_bytes"] >= 64 * MiB


def test_a_measured_pass_calls_python_once_per_nodegroup_not_per_saved_tensor():
    """Once profiled, with the allocator measuring, the engine follows backward by one
    stand-in per NodeGroup (its first saved tensor) instead of hooking every saved
    tensor: each hook is a GIL hand-over in backward. Losses stay python's."""
    code = r"""
import threading, torch
from torch import nn
import wwrun.memory.engine as engine_module
from wwrun.memory import Memory

torch.set_num_threads(1)
made = []
class Counted(engine_module._Saved):
    __slots__ = ()
    def __init__(self, *args):
        made.append(args[-1])
        super().__init__(*args)
engine_module._Saved = Counted

def run():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    layers = [m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    per_step, losses = [], []
    for _ in range(4):
        before = len(made)
        loss = model(torch.randn(256, 64, generator=g)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        per_step.append(len(made) - before); losses.append(loss.item())
    return per_step, losses

memory = Memory("cpu", 64 << 20, "waterwave", nodegroups=4)
out = {}
def job():
    with memory.session("j"):
        out["j"] = run()
t = threading.Thread(target=job); t.start(); t.join()
memory.close()
plain = run()
print(out["j"][0], plain[0], out["j"][1] == plain[1])
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    per_step = json.loads(result.stdout.split("]", 1)[0] + "]")
    same_losses = result.stdout.split()[-1]
    assert per_step[0] >= 16, "the profiling pass counts every saved tensor (8 Linear inputs, 8 Tanh outputs)"
    assert all(0 < n <= 4 for n in per_step[2:]), per_step  # one per NodeGroup at most
    assert same_losses == "True", result.stdout


def test_a_pass_whose_whole_claim_fits_beside_the_others_is_gated_once_not_per_group():
    """While every job's whole iteration fits beside the others' (Scheduler.roomy), a
    measured pass takes its whole claim at its start, and its NodeGroups need no
    gate of their own, nor a stand-in to follow backward but the first group's (its
    claim goes back as backward ends): a gate is a lock, a scheduler decision and a
    listener call on the job's thread, a stand-in a hook and its release, each a GIL
    hand-over among jobs. Two jobs whose iterations do not fit together are gated,
    and followed, group by group. Losses stay python's."""
    code = r"""
import json, threading, torch
from torch import nn
import wwrun.memory.engine as engine_module
from wwrun.memory import Memory

torch.set_num_threads(1)
SAVED = engine_module._Saved

def run(after_first=lambda: None):
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(64, 64), nn.Tanh())])
    with torch.no_grad():  # from its own generator: the jobs' threads share torch's global one here
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    losses = []
    for step in range(5):
        loss = model(torch.randn(2048, 64, generator=g)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()
        losses.append(loss.item())
        if step == 0:
            after_first()
    return losses

def passes(limit, jobs):
    # Per job, its passes: [whether its start took the whole claim, gates, stand-ins].
    memory = Memory("cpu", limit, "waterwave", nodegroups=4)
    engine, seen, sizes = memory.engine, {name: [] for name in jobs}, {}
    class Counted(SAVED):
        __slots__ = ()
        def __init__(self, *args):
            seen[args[2].name][-1][2] += 1  # (tensor, engine, job, key, planned)
            super().__init__(*args)
    engine_module._Saved = Counted
    gate = engine._gate
    def counting(job, group, **kwargs):
        whole = gate(job, group, **kwargs)
        if kwargs.get("pass_start"):
            seen[job.name].append([whole, 0, 0])
        seen[job.name][-1][1] += 1
        sizes[job.name] = engine.scheduler.jobs[job.name].footprint
        return whole
    engine._gate = counting
    settled, losses = threading.Barrier(len(jobs)), {}
    def job(name):
        with memory.session(name):
            losses[name] = run(lambda: settled.wait(60))  # both admitted, profiled and settled
    threads = [threading.Thread(target=job, args=(name,)) for name in jobs]
    [t.start() for t in threads]; [t.join() for t in threads]
    memory.close()
    return seen, losses, sizes

alone, losses, sizes = passes(256 << 20, ["a"])
# Each fits alone with room to spare; together their iterations do not.
two, two_losses, _ = passes(int(1.5 * sizes["a"]), ["b", "c"])
plain = run()
print(json.dumps({"alone": alone["a"], "two": two, "footprint": sizes["a"],
                  "same": all(v == plain for v in [losses["a"], *two_losses.values()])}))
"""
    seen = _child_figures(code)
    assert seen["same"], seen
    # Passes 3-5: profiled and settled, alone in 256 MiB: one gate and one stand-in per pass.
    assert all(whole and gates == stand_ins == 1 for whole, gates, stand_ins in seen["alone"][2:]), seen
    later = [p for job in seen["two"].values() for p in job[1:]]
    assert any(not whole for whole, _, _ in later), seen["two"]  # both ran at once after settling
    for whole, gates, stand_ins in later:
        # Else the pass start and 3 group entries, and a stand-in for each group.
        assert gates == stand_ins == (1 if whole else 4), seen["two"]


def test_the_plan_of_a_job_whose_step_runs_several_passes_covers_each_pass():
    """LBFGS runs its passes inside one step and its history grows between them, after
    each pass's peak: from the second pass on, what the scheduler holds for the job as
    a pass starts (persistent bytes and claim) covers what the pass before held at its
    peak. The claim once fell 1 MiB short there, taking the history grown after the
    peak for memory the peak had held, and an LBFGS job beside others was lost."""
    code = r"""
import json, runpy, sys, threading, torch
import wwrun.memory.engine as engine_module
from wwrun.memory import Memory

torch.set_num_threads(1)
memory = Memory("cpu", 256 << 20, "waterwave", jobs_at_once=2)
seen, begins = [], engine_module.Engine._iteration_begins
def iteration_begins(self, job):
    peak = max(job.iter_peak, job.meter(False)[1]) if job.baseline is not None else None
    begins(self, job)
    state = self.scheduler.jobs[job.name]
    seen.append((peak, state.persistent + (state.claim or 0)))
engine_module.Engine._iteration_begins = iteration_begins
def job():
    with memory.session("lbfgs"):
        sys.argv = ["steps_by_closure_or_hand.py", "lbfgs", "--steps", "2"]
        runpy.run_path(SCRIPT, run_name="__main__")
thread = threading.Thread(target=job); thread.start(); thread.join()
memory.close()
print(json.dumps(seen))
""".replace("SCRIPT", repr(str(SCRIPTS / "steps_by_closure_or_hand.py")))
    seen = _child_figures(code)
    assert len(seen) >= 6  # two steps of up to five passes each
    for peak, planned in seen[2:]:  # from the third pass on: the second is over
        assert planned >= peak, seen


def test_backward_keeps_the_gradients_in_flight_it_measured():
    """Backward holds more than the forward targets of the groups it has yet to go
    through (each group's gradients in flight come on top of what it saved): the
    allocator measures each group's backward, and the engine keeps that much until
    backward is through the groups before (seen: five jobs under 128 MiB, each
    keeping only its forward targets in backward, ran out of memory together)."""
    code = r"""
import json, threading, torch
from torch import nn
from wwrun.memory import Memory

torch.set_num_threads(1)
memory = Memory("cpu", 64 << 20, "waterwave", nodegroups=4)
def job():
    with memory.session("j"):
        g = torch.Generator().manual_seed(0)
        model = nn.Sequential(*[m for _ in range(8) for m in (nn.Linear(256, 256), nn.Tanh())])
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        for _ in range(3):
            loss = model(torch.randn(512, 256, generator=g)).square().mean()
            opt.zero_grad(); loss.backward(); opt.step()
t = threading.Thread(target=job); t.start(); t.join()
[model] = memory.engine._jobs["j"].models
[plan] = model.plans.values()
print(json.dumps([plan.targets(), [g.backward_peak_bytes for g in plan.groups], plan.keeps()]))
memory.close()
"""
    targets, backward, keeps = _child_figures(code)
    assert len(targets) == 4 and all(backward), backward  # every group's backward measured
    assert any(b > t for b, t in zip(backward, targets)), (backward, targets)  # more than forward's
    for i in range(1, 4):
        assert keeps[i] == max(targets[i - 1], *backward[:i]), (i, keeps, targets, backward)


def test_a_newcomer_s_gradients_are_planned_as_the_pages_they_take():
    """What a newcomer's first pass asks for as persistent (its model and data, and
    the gradients backward will make) covers what it holds once they exist. The
    gradients, planned as their bytes rather than the pages they take, once left a
    newcomer 0.9 MiB short of its held bytes in its profiled pass beside another
    job (benchmarks/waterwave.py's part (a) at batch 11000)."""
    code = r"""
import json, threading, torch
from torch import nn
from wwrun.memory import Memory, allocator

torch.set_num_threads(1)
memory = Memory("cpu", 64 << 20, "waterwave")
seen = {}
def job():
    with memory.session("j"):
        g = torch.Generator().manual_seed(0)
        model = nn.Sequential(*[m for _ in range(6) for m in (nn.Linear(200, 200), nn.ReLU())])
        x = torch.randn(4000, 200, generator=g)
        loss = model(x).square().mean()
        seen["asked"] = memory.engine._jobs["j"].persistent_reserved
        loss.backward()
        del loss
        seen["held"] = allocator.cpu_job_stats("j")["held_bytes"]["current"]  # model, data, gradients
t = threading.Thread(target=job); t.start(); t.join()
memory.close()
print(json.dumps(seen))
"""
    seen = _child_figures(code)
    assert seen["asked"] >= seen["held"], seen


def test_what_backward_holds_past_its_last_group_is_planned_for():
    """Once backward has freed the saved tensors of a pass's first group, the job may
    still hold much more than its step needs: tensors a stashing pass fetched back
    from the host, gradients in flight. What it tells the scheduler at each group
    covers what the allocator says it holds (seen: 41 MiB held, planned as 0)."""
    code = r"""
import json, threading, torch
from torch import nn
from wwrun.memory import Memory, allocator

torch.set_num_threads(1)
memory = Memory("cpu", 256 << 20, "waterwave", offload="always")
scheduler, seen = memory.engine.scheduler, []
release = scheduler.release
def told(name, held):  # each time backward hands bytes back: what the allocator says then
    release(name, held)
    state = scheduler.jobs[name]
    seen.append([allocator.cpu_job_stats(name)["held_bytes"]["current"], state.persistent + state.held])
scheduler.release = told
def job():
    with memory.session("j"):
        g = torch.Generator().manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                              nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 10))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            if step == 2:
                seen.clear()  # profiled, and its backward measured
            x = torch.randn(24576, 32, generator=g)
            y = torch.randint(0, 10, (24576,), generator=g)
            loss = nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step()
t = threading.Thread(target=job); t.start(); t.join()
memory.close()
print(json.dumps(seen))
"""
    seen = _child_figures(code)
    assert len(seen) >= 4, seen
    assert all(held <= planned for held, planned in seen), seen


def test_an_ended_job_gives_back_its_cache_and_the_running_jobs_keep_theirs():
    """On the CPU what an ended job left cached goes back to the machine as it ends
    (a sweep's queue would keep every ended job's high-water mark); a running job's
    cached pages stay mapped (they once all went, and every running job faulted
    its memory in again at each job's end)."""
    import threading

    import torch

    from wwrun.memory import Memory, allocator

    memory = Memory("cpu", 256 * MiB, "concurrent")
    try:
        holding, cached, done = threading.Event(), threading.Event(), threading.Event()

        def ending():
            with memory.session("ending"):
                kept = torch.empty(32 * MiB, dtype=torch.uint8)  # live until the other caches
                holding.set()
                assert cached.wait(60)
                del kept  # idle pages of its own as it ends

        def running():
            assert holding.wait(60)
            with memory.session("running"):
                torch.empty(16 * MiB, dtype=torch.uint8)  # freed at once: idle pages of its own
                cached.set()
                done.wait(60)

        ends, keeps = threading.Thread(target=ending), threading.Thread(target=running)
        ends.start()
        keeps.start()
        assert cached.wait(60)
        ends.join(60)
        after = allocator.cpu_stats()["device"]["reserved_bytes"]["current"]
        done.set()
        keeps.join(60)
        assert 16 * MiB <= after < 32 * MiB, after / MiB
    finally:
        memory.close()


@pytest.mark.parametrize("environ, backend", [
    ({}, None),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, None),
    ({"PYTORCH_ALLOC_CONF": "backend:native"}, None),
    ({"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}, "cudaMallocAsync"),
    ({"PYTORCH_ALLOC_CONF": "max_split_size_mb:128, backend: cudaMallocAsync"}, "cudaMallocAsync"),
])
def test_a_cuda_allocator_backend_the_user_asked_torch_for_is_seen(environ, backend):
    assert torch_backend_requested(environ) == backend


def test_the_run_names_the_allocator_that_really_serves_it():
    """The report's `allocator` is what `allocator.in_use` sees: wwrun's while the
    run holds it, PyTorch's again once it closed."""
    from wwrun.memory import Memory, allocator

    memory = Memory("cpu", 64 * MiB, "concurrent")
    try:
        assert memory.allocator == allocator.in_use("cpu") == "waterwave"
        assert memory.run_report()["allocator"] == "waterwave"
    finally:
        memory.close()
    assert allocator.in_use("cpu") == "native"
    import torch

    if torch.version.cuda is None:  # a CPU build of torch has PyTorch's CUDA allocator alone
        assert allocator.in_use("cuda") == "native"


@pytest.mark.gpu
def test_on_cuda_the_user_s_cudamallocasync_is_kept_and_reported(tmp_path):
    """PYTORCH_ALLOC_CONF=backend:cudaMallocAsync: the jobs run on PyTorch's
    allocator (wwrun says so), and the report has its figures."""
    script = str(SCRIPTS / "cuda_memory.py")
    report = tmp_path / "report.json"
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--device", "cuda", "--policy", "concurrent", "--quiet",
         "--log-dir", str(tmp_path / "logs"), "--report", str(report), script, "64", ":", script, "128"],
        capture_output=True, text=True, timeout=300,
        env=_env(PYTORCH_ALLOC_CONF="backend:cudaMallocAsync"),
    )
    assert done.returncode == 0, done.stderr
    assert "cudaMallocAsync" in done.stderr
    run = json.loads(report.read_text())["run"]
    assert run["allocator"] == "cudaMallocAsync"
    assert run["peak_reserved_bytes"] >= run["peak_memory_bytes"] >= 128 * MiB


@pytest.mark.gpu
def test_on_cuda_a_run_drops_an_earlier_in_process_run_s_stream_workspaces_never_a_live_job_s():
    """torch keeps a cuBLAS workspace per (handle, stream) for good: an earlier
    in-process run's (a notebook's, a benchmark's) sat in the next run's limit as
    the 'default' job's, until the fragmentation benchmark's third run could not
    start. A new run drops them, but not while a job of wwrun's streams runs."""
    code = r"""
import json, threading, torch
from wwrun.memory import Memory, allocator

def held():
    torch.cuda.synchronize()
    return allocator.stats()["device"]["allocated_bytes"]["current"]

def job(memory, name, ready=None, hold=None):
    with memory.session(name):
        x = torch.randn(64, 64, device="cuda", requires_grad=True)
        (x @ x).sum().backward()
        del x
        if hold is not None:
            ready.set()
            hold.wait(60)

first = Memory("cuda", None, "concurrent", jobs_at_once=2)
threads = [threading.Thread(target=job, args=(first, name)) for name in "AB"]
[t.start() for t in threads]; [t.join(60) for t in threads]
first.close()
seen = {"fixed": allocator.stream_fixed_cost(), "after_first": held()}
second = Memory("cuda", None, "concurrent", jobs_at_once=2)
seen["second_starts_with"] = held()
ready, hold = threading.Event(), threading.Event()
running = threading.Thread(target=job, args=(second, "C", ready, hold)); running.start()
seen["c_ready"] = ready.wait(60)  # C's workspaces are made, its session open
seen["dropped_while_c_runs"] = allocator.drop_idle_workspaces()
hold.set(); running.join(60)
second.close()
print(json.dumps(seen))
"""
    seen = _child_figures(code)
    assert seen["after_first"] >= seen["fixed"] > 0, seen  # the first run's workspaces outlive it
    assert seen["second_starts_with"] < seen["fixed"], seen
    assert seen["c_ready"] and seen["dropped_while_c_runs"] is False, seen


@pytest.mark.gpu
def test_on_cuda_a_run_whose_jobs_share_16_mib_starts_and_measures_its_copy_rate():
    """The offload's copy-rate probe at start-up took 32 MiB of the device, and a
    run whose jobs have less stopped with an out-of-memory traceback; it takes a
    quarter of the jobs' budget at most."""
    code = r"""
import json, torch
from wwrun.memory import Memory, allocator
allocator.install()
fixed = allocator.measure_headroom().stream_fixed_bytes
memory = Memory("cuda", 2 * fixed + (16 << 20), "waterwave", jobs_at_once=2, offload="auto")
print(json.dumps({"budget": memory.engine.capacity, "rate": memory.engine.offloader.copy_rate}))
memory.close()
"""
    seen = _child_figures(code)
    assert seen["budget"] == 16 << 20 and seen["rate"] > 0, seen


@pytest.fixture
def fake_cuda_device(monkeypatch):
    """Memory on a CUDA device that is not here: an 8 GiB device whose capacity is
    6 GiB, whose job streams hold 66 MiB each for good (cuBLAS workspaces) and
    whose set_stream sets a thread-local "current stream", which the fixture's
    function reads; torch's allocator (no CUDA build)."""
    import threading

    import torch

    import wwrun.memory as memory_module
    from wwrun.memory import allocator

    current = threading.local()
    monkeypatch.setattr(memory_module.Memory, "_device_total", lambda self: 8 << 30)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "Stream", lambda: object())
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: setattr(current, "stream", s))
    monkeypatch.setattr(allocator, "install", lambda: (_ for _ in ()).throw(RuntimeError("no CUDA here")))
    monkeypatch.setattr(allocator, "device_capacity", lambda index, jobs=1: (6 << 30) - jobs * MiB)
    monkeypatch.setattr(allocator, "stream_fixed_cost", lambda index: 66 * MiB)
    return lambda: getattr(current, "stream", None)


def test_the_budget_leaves_out_each_job_stream_s_fixed_cost(fake_cuda_device):
    """cuBLAS workspaces are per-stream fixed costs: the engine plans the jobs'
    claims within the limit less one stream's cost per job at once, and the
    allocator's limit stays the whole capacity (the workspaces live in it)."""
    from wwrun.memory import Memory

    memory = Memory("cuda", None, "waterwave", jobs_at_once=3)
    assert memory.allocator == "native"
    assert memory.limit == (6 << 30) - 3 * MiB  # device_capacity was asked for 3 jobs' headroom
    assert memory.fixed_bytes == 3 * 66 * MiB
    assert memory.engine.capacity == memory.limit - 3 * 66 * MiB
    limited = Memory("cuda", 1 << 30, "waterwave", jobs_at_once=2)
    assert limited.engine.capacity == (1 << 30) - 2 * 66 * MiB


def test_a_limit_the_job_streams_fixed_costs_fill_is_refused(fake_cuda_device):
    from wwrun.config import ConfigError
    from wwrun.memory import Memory

    with pytest.raises(ConfigError, match="cuBLAS workspaces"):
        Memory("cuda", 128 * MiB, "waterwave", jobs_at_once=2)


def test_threads_a_job_starts_run_on_the_job_s_stream(fake_cuda_device):
    """Job streams do not synchronize with the legacy default stream: a thread the
    job starts (join_thread, from the thread hooks) makes the job's stream its
    current one, as long as the job lives."""
    import threading

    from wwrun.memory import Memory

    memory = Memory("cuda", None, "concurrent", jobs_at_once=1)
    seen = {}

    def side_thread():
        memory.join_thread("j")
        seen["side"] = fake_cuda_device()

    with memory.session("j") as session:
        job_stream = fake_cuda_device()
        worker = threading.Thread(target=side_thread)
        worker.start()
        worker.join(10)
    assert job_stream is session.stream and seen["side"] is job_stream
    worker = threading.Thread(target=lambda: (memory.join_thread("j"), seen.__setitem__("late", fake_cuda_device())))
    worker.start()
    worker.join(10)
    assert seen["late"] is None  # the job has left: nothing of it is taken up


def test_a_stream_s_fixed_cost_made_before_it_is_bound_counts_to_no_job():
    """What warm_job_stream relies on, on the host allocator: a block made on a
    stream before it is bound to a job, from an unmarked thread (a stand-in for a
    cuBLAS workspace), stays the default job's; the job's figures and its limit
    hold only its own, and a later job on the same stream is not charged for it."""
    from wwrun.memory.allocator import HostAllocator

    alloc = HostAllocator(64 * MiB)
    workspace = alloc.alloc(4 * MiB, stream=5)  # before the stream is any job's
    alloc.register_stream(5, "A", memory_limit=6 * MiB)
    mine = alloc.alloc(5 * MiB, stream=5)  # within A's limit only if the workspace is not A's
    assert alloc.job_stats("A")["allocated_bytes"]["current"] == 5 * MiB
    assert alloc.job_stats("default")["allocated_bytes"]["current"] == 4 * MiB
    alloc.free(mine)
    alloc.unregister_job("A")
    alloc.register_stream(5, "B")
    assert alloc.job_stats("B")["allocated_bytes"]["current"] == 0
    assert alloc.job_stats("default")["allocated_bytes"]["current"] == 4 * MiB
    alloc.free(workspace)


def test_memory_that_outlives_its_job_is_planned_around():
    """A block that outlives the job that made it (torch keeps a cuBLAS workspace per
    handle and stream, a library caches, a script leaves a tensor in a process-wide
    object) stays held for no job: at each job's end the engine plans within the
    limit less what is held so, measured, and grows back when it is freed. A model
    the engine held until then, freed only by a collection (a reference cycle), is
    not counted as such."""
    code = r"""
import json, threading, torch
from wwrun.memory import Memory

MiB = 1 << 20
notes = []
memory = Memory("cpu", 64 * MiB, "waterwave", note=notes.append)
kept = []
def train(keep):
    tensor = torch.ones(keep * MiB, dtype=torch.uint8)
    if keep > 8:
        kept.append(tensor)  # a process-wide cache's
def job(name, keep):
    with memory.session(name):
        train(keep)
def run(name, keep):
    t = threading.Thread(target=job, args=(name, keep)); t.start(); t.join()
    return memory.engine.capacity, memory.engine.scheduler.capacity
def train_model():
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.Tanh(), torch.nn.Linear(1024, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(2):
        model(torch.randn(64, 1024)).sum().backward(); opt.step()
    model.cycle = [model, opt]  # in a reference cycle, as a script's namespace holds them
def model_job():  # a model the engine holds until the job ends: let go then, not left over
    with memory.session("model"):
        train_model()
t = threading.Thread(target=model_job); t.start(); t.join()
assert memory.engine.capacity == 64 * MiB, memory.engine.capacity
figures = [run("small", 1), run("leaky", 24)]
kept.clear()
figures.append(run("after", 1))
print(json.dumps([figures, memory.outlived_bytes, memory.run_report()["outlived_bytes"], notes]))
memory.close()
"""
    figures, outlived, reported, notes = _child_figures(code)
    (small, small_plan), (leaky, leaky_plan), (after, after_plan) = figures
    assert small == small_plan and leaky == leaky_plan and after == after_plan  # one budget
    assert small > 63 * MiB  # nothing held for no job
    assert 64 * MiB - leaky >= 24 * MiB > 64 * MiB - leaky - MiB  # the kept tensor, measured
    assert after == small  # freed: planned for again
    assert reported == outlived >= 24 * MiB
    assert len(notes) == 1 and "still held" in notes[0], notes


def test_start_up_measures_the_offload_copy_rate_without_importing_triton():
    """Parking weighs copies at a rate measured before the jobs start, on the main
    thread, where a Ctrl-C landing in Triton's import would abort the process:
    Triton is imported by a job's first stash, not here."""
    probe = (
        "import sys\n"
        "from wwrun.memory import Memory\n"
        "memory = Memory('cpu', 64 << 20, 'waterwave', offload='auto', jobs_at_once=2)\n"
        "print(memory.engine.offloader.copy_rate > 0, 'triton' in sys.modules)\n"
        "memory.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, env=_env())
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
