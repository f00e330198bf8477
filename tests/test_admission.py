"""No job lost to memory it could have had (issue 20): real scripts through wwrun's
launcher on the CPU allocator, whose summed peaks exceed --memory-limit. Every job
must finish (a job that fits alone waits, it does not fail), the reserved memory must
never pass the limit, and small jobs must run beside a large one when they fit.

The full grid and the 20-run loops are in benchmarks/fragmentation.py."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import wwrun
from wwrun.display import QuietDisplay
from wwrun.recipe import load_recipe

CHECKOUT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
MiB = 1 << 20


def _fragmentation():
    """benchmarks/fragmentation.py: the random mixes and the lost-job classifier."""
    spec = importlib.util.spec_from_file_location("fragmentation", CHECKOUT / "benchmarks" / "fragmentation.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _launch(config, tmp_path, **options):
    for key, value in {"device": "cpu", "quiet": True, "log_dir": str(tmp_path / "logs"), **options}.items():
        setattr(config, key, value)
    return wwrun.launch(config, display=QuietDisplay(io.StringIO()))


def _jobs(*jobs: tuple[str, list[str]]):
    return wwrun.LaunchConfig(jobs=[wwrun.JobSpec(name=f"job{i}", script=script, args=args)
                                    for i, (script, args) in enumerate(jobs)])


def _interrupt_once(events: Path, job: str, state: str, after_s: float = 0.0) -> None:
    """Ctrl-C (SIGINT to this process, which runs the launch) `after_s` after the run's
    events file first says `job` is in `state`; gives up after 60 s."""

    def interrupt():
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            lines = events.read_text().splitlines() if events.exists() else []
            if any(json.loads(line)["job"] == job and json.loads(line)["state"] == state for line in lines):
                time.sleep(after_s)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.02)

    threading.Thread(target=interrupt, daemon=True).start()


def _all_finish_within(result, limit):
    assert [job.state.value for job in result.jobs] == ["succeeded"] * len(result.jobs), \
        [job.error for job in result.jobs]
    assert result.extra["peak_reserved_bytes"] <= limit


def _lose_nothing(result, limit):
    """Every job finishes and reserved never passes the limit; a lost job fails the
    test with what lost it (admission: the jobs let in held more than the limit;
    fragmentation: the bytes were free, not in one piece)."""
    assert result.extra["peak_reserved_bytes"] <= limit
    classify = _fragmentation().classify
    lost = {job.name: (classify(job.error, limit), job.error) for job in result.jobs if job.state.value != "succeeded"}
    assert not lost, lost


def test_the_quickstart_under_1_15x_its_largest_job_finishes(tmp_path):
    recipe = CHECKOUT / "recipes" / "quickstart.yaml"
    alone = _launch(load_recipe(recipe), tmp_path, policy="concurrent")
    limit = int(1.15 * max(job.extra["peak_memory_bytes"] for job in alone.jobs))
    assert sum(job.extra["peak_memory_bytes"] for job in alone.jobs) > limit  # they must take turns
    result = _launch(load_recipe(recipe), tmp_path, policy="waterwave", memory_limit=limit)
    _lose_nothing(result, limit)


def test_three_jobs_each_making_a_120mib_temporary_take_turns_under_200mib(tmp_path):
    """One temporary fits at a time. Three runs: a job ending while the next one's
    first large request waits is a race (lost in half the runs of a loop)."""
    job = (str(SCRIPTS / "big_temporary.py"), ["40", "120"])
    for _ in range(3):
        result = _launch(_jobs(job, job, job), tmp_path, memory_limit=200 * MiB)
        _all_finish_within(result, 200 * MiB)
        assert all(job.extra["peak_memory_bytes"] > 120 * MiB for job in result.jobs)  # one at a time fits


# A few cells of the benchmark's grid: (limit, largest tensor's share of it, seed).
MIXES = [(32 * MiB, 0.02, 0), (32 * MiB, 0.10, 1), (32 * MiB, 0.25, 1), (128 * MiB, 0.02, 0), (128 * MiB, 0.25, 1)]


@pytest.mark.parametrize("limit, fraction, seed", MIXES, ids=[f"{l >> 20}MiB-{f:.0%}-seed{s}" for l, f, s in MIXES])
def test_random_oversubscribed_mixes_lose_no_job(tmp_path, limit, fraction, seed):
    """2 to 5 seeded MLPs, each fitting alone with a 20% margin, their summed peaks
    1.3 to 3x the limit. A lost job fails the test."""
    frag = _fragmentation()
    jobs = frag.mix(limit, fraction, seed)
    peaks = [frag.job_peak(*(int(args[args.index(flag) + 1]) for flag in ("--width", "--batch", "--depth")))
             for args in jobs]
    assert max(peaks) <= limit / frag.MARGIN and 1.3 * limit <= sum(peaks) <= 3 * limit
    result = _launch(_jobs(*[(frag.JOB_SCRIPT, args) for args in jobs]), tmp_path, memory_limit=limit)
    _lose_nothing(result, limit)


def _busy_spans(trace: dict) -> dict[str, list[tuple[float, float]]]:
    """Each job's NodeGroup spans (forward, backward, profile) in the engine's trace."""
    names = {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    spans: dict[str, list[tuple[float, float]]] = {}
    for e in trace["traceEvents"]:
        if e.get("ph") == "X" and e["name"].split()[0] in ("fwd", "bwd", "profile"):
            spans.setdefault(names[e["tid"]], []).append((e["ts"], e["ts"] + e["dur"]))
    return spans


def test_a_small_job_runs_beside_a_large_one_when_it_fits(tmp_path):
    """The quickstart's MLP, CNN and character transformer under 40 MiB: the two
    larger ones do not fit together, but the MLP fits beside either, and the trace
    shows it working while the transformer works."""
    trace = tmp_path / "trace.json"
    result = _launch(load_recipe(CHECKOUT / "recipes" / "quickstart.yaml"), tmp_path,
                     memory_limit=40 * MiB, trace=str(trace))
    _lose_nothing(result, 40 * MiB)
    spans = _busy_spans(json.loads(trace.read_text()))
    large = spans["char-transformer"]
    overlapping = [s for s in spans["mlp"] if any(s[0] < end and start < s[1] for start, end in large)]
    assert len(overlapping) >= 10, "the MLP waited while the transformer ran"


def test_evaluation_passes_take_turns_when_two_would_not_fit(tmp_path):
    """A no_grad evaluation keeps nothing for backward, but its temporaries (64 MiB
    here, its training iterations a few KiB) do not fit twice under the limit: it
    waits for room as a training pass does, instead of running out of memory."""
    job = (str(SCRIPTS / "evaluating.py"), ["6", "32"])
    result = _launch(_jobs(job, job, job), tmp_path, memory_limit=100 * MiB)
    _all_finish_within(result, 100 * MiB)
    assert all(job.extra["peak_memory_bytes"] > 60 * MiB for job in result.jobs)  # two would not fit


def test_validation_forwards_outside_no_grad_free_their_graphs(tmp_path):
    """A forward that no backward follows keeps nothing once its output is dropped,
    also while the engine's saved-tensor hooks are on (two jobs taking turns: every
    pass keeps per-tensor hooks). Kept by a cycle through its own output, each graph
    lived for good: 15 MiB jobs grew to 147 MiB and ran out of memory."""
    job = (str(SCRIPTS / "validation_with_grad.py"), ["3", "6"])
    alone = _launch(_jobs(job), tmp_path, policy="concurrent")
    peak = alone.jobs[0].extra["peak_memory_bytes"]
    limit = int(1.6 * peak)  # one fits, two do not
    result = _launch(_jobs(job, job), tmp_path, memory_limit=limit)
    _all_finish_within(result, limit)
    assert all(job.extra["peak_memory_bytes"] <= 1.25 * peak for job in result.jobs), \
        ([job.extra["peak_memory_bytes"] for job in result.jobs], peak)


def _late_beside_holder(tmp_path, holder_steps):
    """A job (job1) that evaluates late on a 64 MiB batch, once a job (job0) holding
    32 MiB of parameters and gradients has taken its first step: under 90 MiB each
    fits alone, not both."""
    held = str(tmp_path / "held")
    holder = (str(SCRIPTS / "holds_then_trains.py"), ["16", str(holder_steps), held])
    late = (str(SCRIPTS / "late_evaluation.py"), ["20", "5", "32", held])
    return holder, late


def test_a_job_that_outgrows_its_plan_late_waits_at_the_limit_instead_of_running_out(tmp_path):
    """A job sized by its training iterations evaluates late on a far larger batch
    (makemore at step 500): it fits alone, not beside the other job's parameters. At
    the limit it waits for that job to end (Note [Waiting at the limit]) and prints
    what it prints alone; it ran out of memory before."""
    holder, late = _late_beside_holder(tmp_path, 150)
    alone = _launch(_jobs((late[0], late[1][:3])), tmp_path / "alone", policy="concurrent")
    result = _launch(_jobs(holder, late), tmp_path / "together", memory_limit=90 * MiB)
    _all_finish_within(result, 90 * MiB)
    peaks = [job.extra["peak_memory_bytes"] for job in (*result.jobs, alone.jobs[0])]
    assert peaks[0] + peaks[2] > 90 * MiB, peaks  # they do not fit side by side
    read = lambda job: (Path(job.log_dir) / "stdout.log").read_text()  # noqa: E731
    assert read(result.jobs[1]) == read(alone.jobs[0])


def test_a_job_at_the_limit_waits_for_what_an_ended_job_left_behind_to_die(tmp_path):
    """An ended job's thread still holds 32 MiB for 3 s (the engine plans without
    it) as a job that fits alone evaluates on a batch that needs them. Its request
    waits at the limit until they are freed and then succeeds; it ran out of memory
    at once, as if it could not fit even alone."""
    ended = str(tmp_path / "ended")
    leaves = (str(SCRIPTS / "leaves_memory_behind.py"), ["32", "3", ended])
    late = (str(SCRIPTS / "late_evaluation.py"), ["20", "5", "32", ended])
    alone = _launch(_jobs((late[0], late[1][:3])), tmp_path / "alone", policy="concurrent")
    result = _launch(_jobs(leaves, late), tmp_path / "together", memory_limit=90 * MiB)
    _all_finish_within(result, 90 * MiB)
    read = lambda job: (Path(job.log_dir) / "stdout.log").read_text()  # noqa: E731
    assert read(result.jobs[1]) == read(alone.jobs[0])
    assert alone.jobs[0].extra["peak_memory_bytes"] + 32 * MiB > 90 * MiB  # they do not fit side by side


def test_ctrl_c_reaches_a_job_waiting_at_the_limit_as_under_python(tmp_path):
    """A job waiting at the limit (its late evaluation beside a job that trains on)
    gets Ctrl-C as a KeyboardInterrupt raised by the allocation that waits, inside
    its model's forward, and the run ends at once."""
    events = tmp_path / "events.jsonl"
    # 1 s past the evaluation's start (a short wait) it waits at the limit, until job0 ends.
    _interrupt_once(events, "job1", "waiting", after_s=1)
    holder, late = _late_beside_holder(tmp_path, 100000)
    result = _launch(_jobs(holder, late), tmp_path, memory_limit=90 * MiB, events=str(events), grace_period_s=10)
    assert [(job.state.value, job.exit_code) for job in result.jobs] == [("interrupted", 130)] * 2, \
        [job.error for job in result.jobs]
    said = (Path(result.jobs[1].log_dir) / "stdout.log").read_text()
    # Raised where the allocation waited, in the model's forward, as under python.
    assert said.startswith("KeyboardInterrupt in the evaluation, through forward") and " wait_at_limit " in said, said
    assert result.exit_code == 130


def test_a_job_at_the_limit_fails_as_under_python_once_no_job_frees_anything_for_the_bound(tmp_path, monkeypatch):
    """Waiting at the limit has a bound: while the other job idles holding its memory
    (nothing freed anywhere for LIMIT_RETRY_S, here 1 s), the waiting job's request
    fails with the allocator's out-of-memory error instead of waiting on."""
    from wwrun.memory import engine

    monkeypatch.setattr(engine, "LIMIT_RETRY_S", 1.0)
    holder, late = _late_beside_holder(tmp_path, 0)
    holder = (holder[0], [*holder[1], "20"])  # idles 20 s after its first step
    result = _launch(_jobs(holder, late), tmp_path, memory_limit=90 * MiB)
    assert [job.state.value for job in result.jobs] == ["succeeded", "failed"], [job.error for job in result.jobs]
    assert "is out of memory" in result.jobs[1].error
    assert result.jobs[1].extra["wait_s"] >= 0.5  # it waited at the limit first (its retries aside)
    assert result.jobs[1].wall_s < 15  # and gave up long before the holder ended


def _outgrowing_together(tmp_path, mib=20, device="cpu"):
    """Two jobs that each hold 2 x `mib` MiB of temporaries no plan foresaw and each
    ask for `mib` more, both at once (tests/scripts/outgrows_together.py): under 4.5
    x `mib` each fits alone, and together neither can go on unless one lets go."""
    script = str(SCRIPTS / "outgrows_together.py")
    first, second = str(tmp_path / "first"), str(tmp_path / "second")
    return (script, [str(mib), first, second, device]), (script, [str(mib), second, first, device])


def _gave_way(result):
    """(the job whose request failed, the other) of a run of _outgrowing_together's
    pair where one job gave way: whichever came to the limit second (job1 mostly; job0
    when the machine is busy)."""
    failed = [job for job in result.jobs if job.state.value == "failed"]
    assert len(failed) == 1 and len(result.jobs) == 2, [job.error for job in result.jobs]
    return failed[0], next(job for job in result.jobs if job is not failed[0])


def _the_newer_parks_and_both_finish(tmp_path, limit, mib=20, device="cpu"):
    jobs = _outgrowing_together(tmp_path, mib, device)
    trace = tmp_path / "trace.json"
    result = _launch(_jobs(*jobs), tmp_path, memory_limit=limit, trace=str(trace), device=device)
    assert result.extra["offload_host_peak_bytes"] >= 2 * mib * MiB  # its copies: host memory the limit counts
    if device == "cuda":
        from wwrun.memory import allocator

        if not allocator.can_park("cuda"):
            pytest.skip("this GPU's driver makes no pinned host memory for the virtual memory API")
    _all_finish_within(result, limit)
    events = json.loads(trace.read_text())["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e.get("name") == "thread_name"}
    assert len([names[e["tid"]] for e in events if e.get("name") == "parked"]) == 1  # the one there second
    itself = str(tmp_path / "itself")  # it waits for no other job
    alone = _launch(_jobs((jobs[1][0], [str(mib), itself, itself, device])), tmp_path / "alone",
                    policy="concurrent", device=device)
    read = lambda job: (Path(job.log_dir) / "stdout.log").read_text()  # noqa: E731
    assert read(result.jobs[0]) == read(result.jobs[1]) == read(alone.jobs[0])


def test_of_two_jobs_that_outgrow_their_plans_at_once_the_newer_parks_its_pages_and_both_finish(tmp_path):
    """The newer gives way: its pages go to host memory at the same addresses
    (Note [Parking]) while the other takes them, and come back once it has freed
    them. Both finish, each printing what it prints alone, and the device never
    holds more than the limit. The newer failed with out of memory before."""
    _the_newer_parks_and_both_finish(tmp_path, 90 * MiB)


@pytest.mark.gpu
@pytest.mark.fresh_process  # wwrun's allocator installs only before CUDA is initialised
def test_on_cuda_of_two_jobs_that_outgrow_their_plans_at_once_the_newer_parks_and_both_finish(tmp_path):
    """As above on a GPU, in pinned host memory mapped at the tensors' addresses: 1 GiB
    temporaries under 4.5 GiB, and 256 MiB more for the job streams' cuBLAS
    workspaces, which the limit includes (65 MiB each on an H200), not enough for
    either job's third GiB. Before, the newer failed with out of memory."""
    _the_newer_parks_and_both_finish(tmp_path, 4608 * MiB + 256 * MiB, mib=1024, device="cuda")


def test_where_pages_cannot_be_parked_the_newer_gives_way_and_says_so(tmp_path, monkeypatch):
    """As on a GPU whose driver maps no host memory: the newer's request fails with
    out of memory saying it fits alone and gave way, and to whom; the other goes on
    and finishes. With --retries 1, as the error suggests, both finish."""
    from wwrun.memory import engine

    monkeypatch.setattr(engine.Engine, "_park_at_limit", lambda self, *args: False)
    jobs = _outgrowing_together(tmp_path)
    result = _launch(_jobs(*jobs), tmp_path, memory_limit=90 * MiB)
    newer, older = _gave_way(result)
    error = newer.error
    assert "is out of memory" in error and "memory limit of 90.00 MiB is reached" in error, error
    assert f"it gives way to '{older.name}', there first (alone it would fit" in error, error
    assert result.extra["peak_reserved_bytes"] <= 90 * MiB
    # As the error says: with a retry it runs again once the other has freed its memory.
    jobs = _outgrowing_together(tmp_path / "retried")
    (tmp_path / "retried").mkdir()
    retried = _launch(_jobs(*jobs), tmp_path / "retried", memory_limit=90 * MiB, retries=1)
    assert [job.state.value for job in retried.jobs] == ["succeeded", "succeeded"], [j.error for j in retried.jobs]


def test_parked_pages_take_host_memory_the_offload_limit_allows_or_the_newer_gives_way_and_says_so(tmp_path):
    """A parked job's copies are host memory (pinned, on a GPU): they count against
    --offload-limit, as offloaded activations do. Under 1 MiB the newer's 40 MiB
    cannot park: its request fails saying so, and the other finishes."""
    jobs = _outgrowing_together(tmp_path)
    result = _launch(_jobs(*jobs), tmp_path, memory_limit=90 * MiB, offload_limit=1 * MiB)
    newer, older = _gave_way(result)
    error = newer.error
    assert f"it gives way to '{older.name}', there first (alone it would fit" in error, error
    assert "; it could not park: its " in error and " of host memory --offload-limit leaves" in error, error
    assert result.extra["offload_host_peak_bytes"] <= 1 * MiB


def test_a_job_whose_first_pass_is_an_evaluation_waits_for_room_for_it(tmp_path):
    """nanoGPT evaluates at step 0, before it trains: a newcomer's first pass under
    no_grad is measured as a profile is, alone, not taken for one keeping nothing (three
    such jobs started their evaluations at once and lost two of three)."""
    job = (str(SCRIPTS / "evaluating.py"), ["3", "32", "first"])
    result = _launch(_jobs(job, job, job), tmp_path, memory_limit=100 * MiB)
    _all_finish_within(result, 100 * MiB)
    assert all(job.extra["peak_memory_bytes"] > 60 * MiB for job in result.jobs)  # two would not fit


def test_jobs_set_up_side_by_side_and_wait_for_memory_only_at_their_first_tensor(tmp_path):
    """Each script's setup (here: waiting until every job has reached it) runs
    before the job is admitted, beside the others: a job waits for memory only at
    its first device allocation. Admitted before their scripts ran, the jobs after
    the first would wait for the first job's step, which waits for them."""
    met = tmp_path / "met"
    met.mkdir()
    script = str(SCRIPTS / "meets_before_training.py")
    jobs = [(script, [str(met), "3", f"job{i}"]) for i in range(3)]
    result = _launch(_jobs(*jobs), tmp_path, memory_limit=64 * MiB)
    _all_finish_within(result, 64 * MiB)
    assert len({(Path(job.log_dir) / "stdout.log").read_text() for job in result.jobs}) == 1  # as alone


def test_ctrl_c_reaches_a_job_waiting_at_its_first_tensor_as_under_python(tmp_path):
    """A job waiting for admission at its first allocation (here behind a job that
    never takes a step) gets Ctrl-C as a KeyboardInterrupt raised by that
    allocation, where its own `except` sees it, and the run ends at once."""
    events = tmp_path / "events.jsonl"
    _interrupt_once(events, "job1", "queued")
    script = str(SCRIPTS / "first_tensor.py")
    result = _launch(_jobs((script, ["hold", str(tmp_path)]), (script, ["guarded", str(tmp_path)])), tmp_path,
                     memory_limit=64 * MiB, events=str(events), grace_period_s=10)
    holder, guarded = result.jobs
    assert [(job.state.value, job.exit_code) for job in result.jobs] == [("interrupted", 130)] * 2, \
        [job.error for job in result.jobs]
    assert (Path(guarded.log_dir) / "stdout.log").read_text() == "KeyboardInterrupt at the first tensor\n"
    assert result.exit_code == 130
