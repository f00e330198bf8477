"""Admission logic (wwrun/memory/scheduler.py) driven by simulated jobs.

Each simulated job builds its model (persistent bytes), then runs iterations: a
forward that asks for its NodeGroups' growth one group at a time (and may wait), then
a backward that hands the groups back in reverse order (never waits). Its first
iteration is a profiling pass: sizes unknown to the scheduler until it ends. The
interleaving of the jobs' steps is random. Deadlock freedom means every run ends with
each job finished (or, for a job that cannot fit even alone, refused); the budget
means `used` never exceeds the capacity.
"""

import random
from dataclasses import dataclass

import pytest

from wwrun.memory.scheduler import Decision, Scheduler


@dataclass
class SimJob:
    name: str
    persistent: int
    groups: list[int]
    iterations: int
    priority: int = 0
    phase: str = "queued"  # queued, building, forward, backward, done, refused, failed
    iteration: int = 0
    group: int = 0  # next group to ask for (forward) or to free (backward)
    held: int = 0
    waits: int = 0

    @property
    def claim(self):
        return sum(self.groups)


def simulate(jobs, capacity, rng, queue="fifo", max_steps=100_000):
    sched = Scheduler(capacity, queue=queue)
    for job in jobs:
        sched.enqueue(job.name, job.priority)
    peak, idle_rounds = 0, 0
    for _ in range(max_steps):
        live = [j for j in jobs if j.phase not in ("done", "refused", "failed")]
        if not live:
            return sched, peak
        progressed = False
        for job in rng.sample(live, len(live)):
            if step(sched, job):
                progressed = True
                break
        assert sched.used <= capacity, "budget exceeded"
        peak = max(peak, sched.used)
        if progressed:
            idle_rounds = 0
            continue
        # Nobody moved. A job that started waiting may have let another through (the
        # engine wakes every waiter when one starts waiting): one more round, then
        # the scheduler must name a victim.
        idle_rounds += 1
        victim = sched.stuck_victim()
        if victim is None:
            assert idle_rounds < 2, f"deadlock: {[(j.name, j.phase, j.group) for j in live]}"
            continue
        failed = next(j for j in jobs if j.name == victim)
        started = [j for j in live if j.phase in ("building", "forward", "backward")]
        # Named only when the started jobs cannot all run: their persistent bytes plus
        # the largest iteration do not fit (a newcomer's size is known only once it ran).
        assert sum(j.persistent for j in started) + max(j.claim for j in started) > capacity
        failed.phase = "failed"
        sched.finish(victim)
    raise AssertionError("simulation did not end")


def step(sched, job) -> bool:
    """One action of `job`; False when it has to wait."""
    if job.phase == "queued":
        if not sched.try_start(job.name):
            return False
        job.phase = "building"
    if job.phase == "building":  # the script allocates its model
        decision = sched.request_persistent(job.name, job.persistent)
        if decision is Decision.TOO_LARGE:
            job.phase = "refused"
            sched.finish(job.name)
            return True
        if decision is Decision.WAIT:
            return False
        job.phase = "forward"
        return True
    if job.phase == "forward":
        profile = job.iteration == 0
        decision = sched.request(
            job.name, job.held + job.groups[job.group], pass_start=job.group == 0, profile=profile
        )
        if decision is Decision.TOO_LARGE:
            job.phase = "refused"
            sched.finish(job.name)
            return True
        if decision is Decision.WAIT:
            job.waits += 1
            return False
        job.held += job.groups[job.group]
        job.group += 1
        if job.group == len(job.groups):
            job.phase, job.group = "backward", len(job.groups) - 1
        return True
    if job.phase == "backward":
        job.held -= job.groups[job.group]
        sched.release(job.name, job.held)
        job.group -= 1
        if job.group < 0:
            if job.iteration == 0:
                sched.end_profile(job.name, job.claim)
            job.iteration += 1
            job.group = 0
            job.phase = "forward" if job.iteration < job.iterations else "done"
            if job.phase == "done":
                sched.finish(job.name)
        return True
    return False


def random_mix(rng, capacity):
    jobs = []
    for i in range(rng.randint(1, 5)):
        persistent = rng.randint(0, capacity // 6)
        groups = [rng.randint(0, capacity // 4) for _ in range(rng.randint(1, 6))]
        jobs.append(
            SimJob(f"j{i}", persistent, groups, rng.randint(1, 4), priority=rng.choice([0, 0, 1]))
        )
    return jobs


@pytest.mark.parametrize("queue", ["fifo", "las"])
def test_random_mixes_never_deadlock_nor_exceed_the_budget(queue):
    """Thousands of random mixes."""
    rng = random.Random({"fifo": 1234, "las": 99}[queue])
    capacity = 1000
    outcomes = {"done": 0, "refused": 0, "failed": 0}
    for _ in range(2000):
        jobs = random_mix(rng, capacity)
        simulate(jobs, capacity, rng, queue=queue)
        for job in jobs:
            outcomes[job.phase] += 1
            fits_alone = job.persistent + job.claim <= capacity
            # Refused only jobs that cannot fit even alone; those never finish.
            if job.phase == "refused":
                assert not fits_alone
            if not fits_alone:
                assert job.phase in ("refused", "failed")
        fitting = [j for j in jobs if j.persistent + j.claim <= capacity]
        if fitting and sum(j.persistent for j in fitting) + max(j.claim for j in fitting) <= capacity:
            assert all(j.phase == "done" for j in fitting), "jobs that fit together all finish"
    assert outcomes["done"] > 5000 and outcomes["refused"] > 0


def profiled(sched, name, persistent, claim):
    """Start `name`, build its model and run its profiling pass alone."""
    sched.enqueue(name)
    assert sched.try_start(name)
    assert sched.request_persistent(name, persistent) is Decision.GRANT
    assert sched.request(name, claim, pass_start=True, profile=True) is Decision.GRANT
    sched.release(name, 0)
    sched.end_profile(name, claim)


def test_jobs_whose_peaks_exceed_capacity_together_all_finish_interleaved():
    rng = random.Random(7)
    waits = 0
    for _ in range(300):
        jobs = [SimJob(f"j{i}", 50, [100, 100, 100], 4) for i in range(3)]  # 3 x 350 > 1000
        _, peak = simulate(jobs, 1000, rng)
        assert all(j.phase == "done" for j in jobs)
        assert peak <= 1000
        waits += sum(j.waits for j in jobs)
    assert waits > 0, "with room for two and a half iterations somebody must wait"


def test_two_jobs_each_needing_most_of_the_device_share_it():
    sched = Scheduler(1000)
    profiled(sched, "a", 100, 600)
    profiled(sched, "b", 100, 600)  # 100 + 100 + 600 <= 1000: b may start
    assert sched.request("a", 300, pass_start=True) is Decision.GRANT
    # b's first 300 would leave 200 free while a needs 300 more and b 300: unsafe.
    assert sched.request("b", 300, pass_start=True) is Decision.WAIT
    assert sched.request("a", 600) is Decision.GRANT
    sched.release("a", 400)  # a's backward frees group by group...
    # 200 free: b (needs 600) cannot finish, nor can a hand back enough first.
    assert sched.request("b", 300, pass_start=True) is Decision.WAIT
    sched.release("a", 200)
    # 300 free after b's 300: b finishes first (needs 300 more), then a. Safe: b's
    # forward overlaps a's backward.
    assert sched.request("b", 300, pass_start=True) is Decision.GRANT
    assert sched.request("b", 600) is Decision.GRANT
    assert sched.used == 1000
    assert sched.request("a", 300, pass_start=True) is Decision.WAIT


def test_a_waiting_job_unblocks_another_only_by_holding_less():
    """unblocked_by: would another waiting request go, were the job to park?"""
    sched = Scheduler(1000)
    profiled(sched, "a", 100, 400)
    profiled(sched, "b", 100, 400)
    profiled(sched, "c", 100, 200)
    assert sched.request("a", 400, pass_start=True) is Decision.GRANT  # a holds a whole pass
    assert sched.request("b", 200, pass_start=True) is Decision.GRANT
    assert sched.request("b", 400) is Decision.WAIT  # 100 free: b waits for a's backward
    assert sched.request("c", 150, pass_start=True) is Decision.WAIT  # and c for room
    assert not sched.unblocked_by("b", 200)  # holding as much helps nobody
    assert not sched.unblocked_by("b", 180)  # 120 free: still short of c's 150
    assert sched.unblocked_by("b", 0)  # 300 free: c goes, a then b then c can finish
    assert not sched.unblocked_by("c", 0)  # c holds nothing to give
    assert sched.jobs["b"].held == 200  # asking changes nothing
    sched.release("b", 0)  # b parked its activations
    assert sched.request("c", 150, pass_start=True) is Decision.GRANT
    assert sched.request("b", 400) is Decision.WAIT


def test_only_running_jobs_can_free_memory_for_a_waiting_one():
    """others_can_free: a job waiting at the limit may count on another that runs, or
    whose wait could be granted, or that waits at the limit too but came later (it
    gives way first); not on one that waits in vain, nor a queued one."""
    sched = Scheduler(1000)
    profiled(sched, "a", 100, 400)
    profiled(sched, "b", 100, 400)
    assert sched.request("a", 400, pass_start=True) is Decision.GRANT
    assert sched.request("a", 850) is Decision.WAIT  # a outgrew its plan: 100 + 850 + b's 100
    assert sched.others_can_free("a")  # b runs
    sched.jobs["a"].at_limit = sched.jobs["b"].at_limit = True
    assert sched.others_can_free("a")  # b waits at the limit, newer: it gives way, and its memory comes free
    assert not sched.others_can_free("b")  # nobody gives way for b: a came first
    sched.jobs["a"].at_limit = sched.jobs["b"].at_limit = False
    assert sched.request("b", 500, pass_start=True) is Decision.WAIT  # b outgrew its plan too
    assert not sched.others_can_free("a")  # b waits in vain: nobody will free
    sched.enqueue("c", 0)  # queued: it frees nothing
    assert not sched.others_can_free("a")
    sched.release("a", 0)  # a gave way: b's wait could now be granted
    assert sched.others_can_free("a")


def test_a_job_that_parked_its_pages_at_the_limit_frees_nothing_and_is_never_made_to_give_way_again():
    """A job parked at the limit (Note [Parking]) has given its pages: no other job
    counts on its frees, and when every other job waits, one of them gives way,
    not it."""
    sched = Scheduler(1000)
    profiled(sched, "a", 100, 400)
    profiled(sched, "b", 100, 400)
    assert sched.request("a", 400, pass_start=True) is Decision.GRANT
    sched.jobs["b"].parked = True  # not waiting in the scheduler, asking for nothing
    assert not sched.others_can_free("a")  # it was counted as a running job that frees
    sched.jobs["a"].at_limit = True
    assert sched.stuck_victim() == "a"  # every other job waits: a gives way, not b
    sched.jobs["b"].parked = False
    assert sched.stuck_victim() is None  # b, no longer parked and not waiting, runs


def test_sharing_jobs_plan_the_whole_budget():
    """Under the allocator the budget is held pages, and a job's layout is its own:
    two jobs whose held bytes just fit run their passes at once, with nothing kept
    back for fragmentation."""
    sched = Scheduler(1000)
    profiled(sched, "a", 150, 350)
    profiled(sched, "b", 150, 350)
    assert sched.request("a", 350, pass_start=True) is Decision.GRANT
    assert sched.request("b", 350, pass_start=True) is Decision.GRANT  # 150 + 150 + 350 + 350 = 1000
    assert sched.used == 1000


def test_new_job_waits_for_room_and_profiles_alone():
    sched = Scheduler(1000)
    profiled(sched, "a", 200, 700)
    sched.enqueue("b")
    assert not sched.try_start("b"), "200 + 200 + 700 > 1000: a second job like a does not fit"
    sched.finish("a")
    assert sched.try_start("b")
    sched.enqueue("c")
    assert not sched.try_start("c"), "b is not profiled yet"


def test_too_large_and_bad_arguments():
    sched = Scheduler(1000)
    sched.enqueue("big")
    assert sched.try_start("big")
    sched.set_persistent("big", 900)
    assert sched.request("big", 200, pass_start=True, profile=True) is Decision.TOO_LARGE
    with pytest.raises(ValueError):
        Scheduler(0)
    with pytest.raises(ValueError):
        Scheduler(10, queue="lifo")
    with pytest.raises(ValueError):
        sched.enqueue("big")


def test_las_serves_least_attained_service_first():
    def run(queue):
        sched = Scheduler(1000, queue=queue)
        for name in ("old", "new", "holder"):
            sched.enqueue(name)
            assert sched.try_start(name)
            sched.request(name, 0, pass_start=True, profile=True)
            sched.end_profile(name, 600)
        sched.add_service("old", 10.0)
        sched.add_service("new", 1.0)
        assert sched.request("holder", 600, pass_start=True) is Decision.GRANT
        # Both wait for a 600 pass; "old" asked first.
        assert sched.request("old", 600, pass_start=True) is Decision.WAIT
        assert sched.request("new", 600, pass_start=True) is Decision.WAIT
        sched.release("holder", 0)
        return [name for name in ("old", "new") if sched.request(name, 600, pass_start=True) is Decision.GRANT]

    assert run("fifo") == ["old"]
    assert run("las") == ["new"]


def test_higher_priority_job_starts_first():
    sched = Scheduler(1000)
    profiled(sched, "running", 200, 700)
    sched.enqueue("low", priority=0)
    sched.enqueue("high", priority=5)
    assert not sched.try_start("low") and not sched.try_start("high")  # no room yet
    sched.finish("running")
    assert not sched.try_start("low"), "high is first in the queue"
    assert sched.try_start("high")


def test_no_newcomer_starts_while_a_job_waits_at_the_limit():
    """A job waiting at the limit lacks pages the plan counts as free: a newcomer
    let in on them would take what it waits for, there or between two of its waits
    in the pass that came to the limit."""
    sched = Scheduler(1000)
    profiled(sched, "a", 100, 200)
    sched.enqueue("b", 0)
    sched.jobs["a"].at_limit = True
    assert not sched.try_start("b")
    sched.jobs["a"].at_limit = False
    sched.jobs["a"].outgrown = True  # between two of its waits there, in one pass
    assert not sched.try_start("b")
    sched.jobs["a"].outgrown = False  # that pass ended
    assert sched.try_start("b")


def test_newcomers_wait_until_the_running_jobs_optimizer_state_is_known():
    sched = Scheduler(1000)
    sched.enqueue("a")
    assert sched.try_start("a")
    assert sched.request_persistent("a", 200) is Decision.GRANT
    assert sched.request("a", 300, pass_start=True, profile=True) is Decision.GRANT
    sched.release("a", 0)
    sched.end_profile("a", 300, settled=False)  # its first step is still to come
    sched.enqueue("b")
    assert not sched.try_start("b"), "a's optimizer state is not known yet"
    sched.set_persistent("a", 400)  # Adam's two buffers appeared at the first step
    sched.settle("a")
    assert sched.smallest == (400, 300)
    assert not sched.try_start("b"), "400 + 400 + 300 > 1000: a second job like a does not fit"
    sched.finish("a")
    assert sched.try_start("b")


def test_a_newcomer_alike_a_settled_job_waits_for_its_claim_before_its_first_pass():
    """Admission guesses a newcomer's model only; its first pass asks for the claim of
    a settled job of its kind (the engine's: same parameters and inputs), so it waits
    holding its model rather than start a pass that cannot finish beside the others."""
    sched = Scheduler(1000)
    sched.enqueue("a")
    assert sched.try_start("a")
    assert sched.alike_claim("a", "mlp-64") == 0  # nothing settled yet: measured as it goes
    assert sched.request_persistent("a", 100) is Decision.GRANT
    assert sched.request("a", 600, pass_start=True, profile=True) is Decision.GRANT
    sched.release("a", 0)
    sched.end_profile("a", 600)
    sched.enqueue("b")
    assert sched.try_start("b"), "100 + 100 + 600 <= 1000: b's model fits beside a's iteration"
    assert sched.alike_claim("b", "cnn") == 0
    assert sched.alike_claim("b", "mlp-64") == 600
    assert sched.request_persistent("b", 100) is Decision.GRANT
    assert sched.request("a", 600, pass_start=True) is Decision.GRANT
    # 100 + 100 + 600 + 600 > 1000: b's first pass waits for a's backward.
    assert sched.request("b", 600, pass_start=True) is Decision.WAIT
    sched.release("a", 0)
    assert sched.request("b", 600, pass_start=True) is Decision.GRANT


def test_a_newcomer_alike_a_settled_job_starts_its_first_pass_beside_the_others():
    """A newcomer of a known kind is planned with the settled job's claim, so its
    first pass need not wait for the others' passes to drain (one of unknown size
    does); the others' new passes do not wait for it either, and what it measures
    can only raise the claim it was lent."""
    sched = Scheduler(2000)
    sched.enqueue("a")
    assert sched.try_start("a") and sched.alike_claim("a", "mlp") == 0
    assert sched.request_persistent("a", 100) is Decision.GRANT
    assert sched.request("a", 600, pass_start=True, profile=True) is Decision.GRANT
    sched.release("a", 0)
    sched.end_profile("a", 600)
    sched.enqueue("b")
    assert sched.try_start("b")
    assert sched.request_persistent("b", 100) is Decision.GRANT
    assert sched.request("a", 600, pass_start=True) is Decision.GRANT  # a is mid-pass
    assert sched.request("b", 600, pass_start=True, profile=True) is Decision.WAIT  # unknown: alone
    assert sched.alike_claim("b", "mlp") == 600
    assert sched.request("b", 600, pass_start=True) is Decision.GRANT  # beside a's pass
    sched.release("a", 0)
    assert sched.request("a", 600, pass_start=True) is Decision.GRANT  # a's next pass goes on
    sched.end_profile("b", 500)
    assert sched.jobs["b"].claim == 600


def test_roomy_while_every_job_s_whole_iteration_fits_beside_the_others():
    """`roomy`: no request within a claim can be refused, so a pass may take its whole
    claim at its start. Not while a job is queued, being profiled or waiting, nor once
    the jobs' persistent bytes and claims together pass the budget."""
    sched = Scheduler(1000)
    sched.enqueue("a")
    assert sched.try_start("a")
    assert sched.request_persistent("a", 100) is Decision.GRANT
    assert sched.request("a", 300, pass_start=True, profile=True) is Decision.GRANT
    assert not sched.roomy(), "a is being profiled: its claim is unknown"
    sched.release("a", 0)
    sched.end_profile("a", 300)
    assert sched.roomy()
    sched.enqueue("b")
    assert not sched.roomy(), "b is queued"
    assert sched.try_start("b")
    assert not sched.roomy(), "b has no claim yet"
    assert sched.request_persistent("b", 100) is Decision.GRANT
    assert sched.request("b", 300, pass_start=True, profile=True) is Decision.GRANT
    sched.release("b", 0)
    sched.end_profile("b", 300)
    assert sched.roomy(), "100 + 300 + 100 + 300 <= 1000"
    assert sched.request("a", 300, pass_start=True) is Decision.GRANT
    assert sched.request("b", 300, pass_start=True) is Decision.GRANT  # each holds its whole claim
    sched.raise_claim("b", 600)
    assert not sched.roomy(), "100 + 300 + 100 + 600 > 1000"
    assert sched.request("b", 600) is Decision.WAIT
    sched.raise_claim("b", 300)  # a claim never shrinks: still over
    assert not sched.roomy() and sched.jobs["b"].waiting is not None
    assert Scheduler(None).roomy()
