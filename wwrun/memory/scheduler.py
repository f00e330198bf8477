"""Memory-aware admission of NodeGroups: the Banker's algorithm over bytes.

Pure logic, no torch and no threads: the engine (wwrun/memory/engine.py) calls it under its
lock and does the waiting; tests drive it with simulated jobs.

Model (Waterwave, IEEE TC 2023, §NodeGroup pipeline execution; the safety test is
Dijkstra's Banker's algorithm, EWD-108):

    P_j  persistent bytes of job j: parameters, gradients, optimizer state (the most
         seen; they stay until the job ends)
    A_j  claim: the most activation bytes j holds at once in an iteration (profiled)
    H_j  activation bytes j holds now (granted growth, or measured, whichever is more)
    used = sum_j (P_j + H_j) <= capacity                                (the budget)

Under wwrun's allocator the bytes are held bytes: the pages under a job's live
blocks (Note [Layouts] in csrc/allocator/waterwave_allocator.h). A job's blocks
stay in ranges of its own, so it holds the same pages beside others as alone, and
the budget needs no margin for fragmentation: every page it does not plan for is
free for some request.

A job's forward asks, group by group, to raise H_j by the group's predicted growth.
Backward only ever lowers H_j and never waits. A request is granted when the state
after it is *safe*: some order exists in which every profiled job can finish its
iteration, job k needing A_k - H_k more and handing back H_k when done (P_k stays).
From a safe state the first job of that order can always proceed, so the jobs never
all wait at once: no deadlock.

Jobs being profiled (their first iteration, or a new input shape) have no claim yet,
unless a settled job of their kind lends them its own (`alike_claim`): then they are
planned like any other. Otherwise they start a pass only when no other job holds
activations, and other jobs' new passes wait for them; running alone they come
first in the safe order (they will hand their bytes back), else last (keeping
them). These ordering preferences give way whenever they alone would leave every
job waiting. If every job waits and no
request is even safe (only possible when a profile or a newcomer's model reveals a
job that does not fit beside the others), `stuck_victim` names the job to fail.

Jobs are admitted (`try_start`; the engine asks at a job's first device allocation,
so its queue order is the order of arrival there) in queue order once the running
ones are *settled*
(profiled, and their persistent bytes known: an optimizer's state appears at its first
step, after the profile) and one more model as small as the smallest seen so far
leaves room for each running job's iteration: sum P + max A <= capacity, and the
passes in progress can all still end beside it. That guess is the newcomer's
persistent bytes from then on, until its first pass says what they are: its script
builds its model before wwrun sees it, and the room must not go meanwhile. Admitting
beside a job whose optimizer state is still to come would let every job's model exist
at once with no room left for any pass. A newcomer's activations are not guessed at
admission (a small job is not kept out by a large one): its first pass asks for the
claim of a settled job of its kind (`alike_claim`, as any pass start would) or, of a
new kind, for what it measures module by module, and waits until that fits.

Waiting requests are served in queue order: requests in the middle of a pass first
(finishing a pass frees memory sooner), then pass starts by priority and then FIFO
(arrival) or LAS (least attained service first, as in Tiresias, NSDI'19). A lower
ranked request may go first when a higher ranked one does not fit (backfilling),
which is what overlaps one job's backward with another's forward.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass


class Decision(enum.Enum):
    GRANT = "grant"
    WAIT = "wait"
    TOO_LARGE = "too_large"  # the job cannot fit even alone on the device


@dataclass(frozen=True, slots=True)
class Want:
    """A waiting request: the held (and persistent) bytes the job asks to reach."""

    held: int
    persistent: int | None
    pass_start: bool
    profile: bool


@dataclass(slots=True)
class JobState:
    name: str
    priority: int
    seq: int
    started: bool = False
    persistent: int = 0
    claim: int | None = None  # None until the first profile ends
    held: int = 0
    profiling: bool = False
    pending_profile: bool = False
    settled: bool = False  # profiled, and its persistent bytes known
    waiting: Want | None = None
    attained_s: float = 0.0
    kind: object = None  # jobs of one kind are alike (Scheduler.alike_claim)
    guessed: bool = False  # its persistent bytes are the admission's guess, not yet its own
    at_limit: bool = False  # waiting in the allocator at the limit: the first to give way (stuck_victim)
    outgrown: bool = False  # came to the limit in its pass in progress: no newcomer starts until it ends
    parked: bool = False  # gave way at the limit, its pages on the host: it frees nothing more, and waits

    @property
    def footprint(self) -> int:
        return self.persistent + (self.claim or 0)


class Scheduler:
    """Admission of jobs and of their NodeGroups under `capacity` bytes (None: no limit)."""

    def __init__(self, capacity: int | None, queue: str = "fifo"):
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        if queue not in ("fifo", "las"):
            raise ValueError(f"queue must be 'fifo' or 'las', got {queue!r}")
        self.capacity = capacity
        self.queue = queue
        self.jobs: dict[str, JobState] = {}
        self._seq = itertools.count()
        self._sizes: dict[str, tuple[int, int, object]] = {}  # (persistent, claim, kind) of each settled job seen

    # ---- jobs -------------------------------------------------------------------
    def enqueue(self, name: str, priority: int = 0) -> None:
        if name in self.jobs:
            raise ValueError(f"job {name!r} is already known")
        self.jobs[name] = JobState(name, priority, next(self._seq))

    def try_start(self, name: str) -> bool:
        """True when the queued job may start now; it is then active."""
        job = self.jobs[name]
        if job.started:
            return True
        queued = [j for j in self.jobs.values() if not j.started]
        if min(queued, key=self._rank) is not job:
            return False
        if not self._room_for_newcomer():
            return False
        job.started = True
        if self.capacity is not None and len(self.active()) > 1:
            # Its model is built before its first pass asks for it: the room its
            # admission counted on is its own from now on, or the running jobs'
            # passes would take it meanwhile; it goes in when the passes in progress
            # can all still end beside it.
            guess = Want(0, max(job.persistent, self._guess_persistent()), False, False)
            if not self._safe(job, guess):
                job.started = False
                return False
            job.persistent, job.guessed = guess.persistent, True
        return True

    def _guess_persistent(self) -> int:
        """A newcomer's persistent bytes before they are known: the smallest seen."""
        return min((p for p, _, _ in self._sizes.values()), default=0)

    def _room_for_newcomer(self) -> bool:
        """Whether one more job's model fits beside the active ones while each of them
        can still run its iterations: sum P + the newcomer's P + max A <= the budget,
        the newcomer's P guessed by the smallest seen so far. Its activations are not
        guessed here: its first pass waits until they fit (the engine asks for the
        claim of a settled job with the same parameters, else for what it measures),
        so a small job is not kept out by a large one it is taken for."""
        active = self.active()
        if not active or self.capacity is None:
            return True
        if any(not j.settled or j.claim is None or j.profiling or j.pending_profile for j in active):
            return False  # size the running jobs before adding one more
        if any(j.at_limit or j.outgrown for j in active):
            # One lacks pages the plan counts as free, or did in its pass in progress
            # (it tries again between its waits): a newcomer would take them.
            return False
        persistent = sum(j.persistent for j in active) + self._guess_persistent()
        return persistent + max(j.claim for j in active) <= self.capacity

    def alike_claim(self, name: str, kind: object) -> int:
        """The claim of a settled job of the same `kind` (the engine's: its parameters'
        bytes and its input signature), the guess for a newcomer's first pass; 0 if none.
        A job with no claim yet is planned with it: its first pass is then no profile
        to the scheduler (the engine measures it all the same) and starts beside the
        others' passes whenever the Banker's rule allows, as one of a sweep's would."""
        job = self.jobs[name]
        job.kind = kind
        guess = min((c for _, c, k in self._sizes.values() if k == kind), default=0)
        if self.capacity is not None:
            guess = min(guess, max(0, self.capacity - job.persistent))  # never "too large" by a guess
        if guess and job.claim is None:
            job.claim = guess
        return guess

    def finish(self, name: str) -> None:
        """The job ended (success or failure): everything it held is free."""
        self.jobs.pop(name, None)

    def active(self) -> list[JobState]:
        return [j for j in self.jobs.values() if j.started]

    def add_service(self, name: str, seconds: float) -> None:
        if name in self.jobs:
            self.jobs[name].attained_s += seconds

    def _rank(self, job: JobState):
        order = job.attained_s if self.queue == "las" else 0.0
        return (-job.priority, order, job.seq)

    # ---- memory -----------------------------------------------------------------
    @property
    def used(self) -> int:
        return sum(j.persistent + j.held for j in self.active())

    def set_persistent(self, name: str, nbytes: int) -> None:
        """Persistent bytes measured by the job itself (not asked for: already there)."""
        self.jobs[name].persistent = nbytes
        self._note_size(self.jobs[name])

    def settle(self, name: str) -> None:
        """The job's persistent bytes are known (it took an optimizer step, or ran a
        second pass without one): newcomers may be sized by it."""
        job = self.jobs.get(name)
        if job is not None and not job.settled:
            job.settled = True
            self._note_size(job)

    @property
    def smallest(self) -> tuple[int, int] | None:
        """(persistent, claim) of the smallest settled job that trains."""
        return min((size[:2] for size in self._sizes.values()), key=sum, default=None)

    def _note_size(self, job: JobState) -> None:
        if job.settled and job.claim:
            self._sizes[job.name] = (job.persistent, job.claim, job.kind)

    def abort_profile(self, name: str) -> None:
        """The profiling pass failed: the job keeps whatever claim it had."""
        job = self.jobs.get(name)
        if job is not None:
            job.profiling = job.pending_profile = False

    def end_profile(self, name: str, claim: int, *, settled: bool = True) -> None:
        """The job's first pass (or one of a new input shape) is measured: `claim` is
        the most it holds at once. `settled=False` while its persistent bytes may
        still grow (the engine settles it after its first optimizer step)."""
        job = self.jobs[name]
        job.profiling = job.pending_profile = False
        job.claim = max(job.claim or 0, claim)
        if settled:
            job.settled = True
        self._note_size(job)

    def raise_claim(self, name: str, claim: int) -> None:
        """A later iteration of the job held more than its profile (measured by the
        allocator over a whole iteration): its claim grows, never shrinks."""
        job = self.jobs.get(name)
        if job is not None and job.claim is not None and claim > job.claim:
            job.claim = claim
            self._note_size(job)

    def fits_alone(self, name: str, held: int | None = None, persistent: int | None = None) -> bool:
        job = self.jobs[name]
        need = max(job.claim or 0, job.held if held is None else held)
        own = job.persistent if persistent is None else persistent
        return self.capacity is None or own + need <= self.capacity

    def request(self, name: str, held: int, *, pass_start: bool = False, profile: bool = False) -> Decision:
        """Ask to raise the job's held activation bytes to `held`.

        `pass_start`: the first group of a forward pass; `profile`: that pass has no
        profile yet (its growth is then requested as it is measured)."""
        return self._decide(self.jobs[name], Want(max(held, self.jobs[name].held), None, pass_start, profile))

    def request_persistent(self, name: str, nbytes: int) -> Decision:
        """Ask to raise the job's persistent bytes to `nbytes` (a newcomer's model;
        its admission's guess, more or less, gives way to them)."""
        job = self.jobs[name]
        return self._decide(job, Want(job.held, nbytes if job.guessed else max(nbytes, job.persistent), False, False))

    def _decide(self, job: JobState, want: Want) -> Decision:
        if not self.fits_alone(job.name, want.held, want.persistent):
            job.waiting = None
            return Decision.TOO_LARGE
        if self.capacity is None or self._grantable(job, want):
            job.held = want.held
            if want.persistent is not None:
                job.persistent, job.guessed = want.persistent, False
            if job.claim is not None and not job.profiling and job.held > job.claim:
                job.claim = job.held  # a prediction fell short: the claim grows
            if want.pass_start and want.profile:
                job.profiling = True
            job.pending_profile = False
            job.waiting = None
            return Decision.GRANT
        job.waiting = want
        job.pending_profile = want.pass_start and want.profile
        return Decision.WAIT

    def roomy(self) -> bool:
        """Whether every job's whole iteration fits beside every other's at once: all
        are admitted and sized (none queued, profiling or waiting), and their persistent
        bytes and claims together are within the budget. Then every request within a
        claim is granted at once, and a pass may take its whole claim at its start."""
        if self.capacity is None:
            return True
        total = 0
        for job in self.jobs.values():
            if (not job.started or job.waiting is not None or job.claim is None
                    or job.profiling or job.pending_profile):
                return False
            total += job.persistent + job.claim
        return total <= self.capacity

    def release(self, name: str, held: int) -> None:
        """The job's held activation bytes are now `held` (backward freed memory)."""
        job = self.jobs.get(name)
        if job is not None:
            job.held = held

    def unblocked_by(self, name: str, held: int) -> bool:
        """Whether another job's waiting request, refused as things are, would be
        granted were job `name` to hold only `held` (it parks activations on the host
        while it waits: the engine's `_park`)."""
        job = self.jobs[name]
        if held >= job.held:
            return False
        others = [j for j in self.active() if j is not job and j.waiting is not None]
        refused = [j for j in others if not self._grantable(j, j.waiting)]
        if not refused:
            return False
        before, job.held = job.held, held
        try:
            return any(self._grantable(j, j.waiting) for j in refused)
        finally:
            job.held = before

    def _grantable(self, job: JobState, want: Want) -> bool:
        if not self._safe(job, want):
            return False
        if self._preferred(job, want):
            return True
        # The preferences give way when they would leave everyone waiting: then the
        # best ranked safe request goes (one always exists unless stuck_victim says so).
        # A job waiting at the limit counts as waiting, and not as one that could go:
        # the plan may have room for it that the device has not (Engine.wait_at_limit).
        others = [j for j in self.active() if j is not job]
        if any(j.waiting is None and not j.at_limit for j in others):
            return False  # someone can still move
        if any(not j.at_limit and self._preferred(j, j.waiting) and self._safe(j, j.waiting) for j in others):
            return False
        rivals = [j for j in others if not j.at_limit and self._safe(j, j.waiting)]
        return all(self._rank(job) < self._rank(j) for j in rivals)

    def _preferred(self, job: JobState, want: Want) -> bool:
        """The ordering preferences; requests in the middle of a pass always pass."""
        if not want.pass_start:
            return True
        others = [j for j in self.active() if j is not job]
        if want.profile and any(j.held > 0 or j.profiling for j in others):
            return False  # profile alone: let the others' passes drain first
        if not want.profile and any(j.profiling or j.pending_profile for j in others):
            return False  # a profile goes first
        return self._first_in_line(job, want.profile)

    def _first_in_line(self, job: JobState, profile: bool) -> bool:
        """No higher ranked waiting request that could go now instead. A profile is
        behind other profiles only (the other pass starts wait for it)."""
        for other in self.active():
            if other is job or other.waiting is None:
                continue
            if profile:
                ahead = other.pending_profile and self._rank(other) < self._rank(job)
            else:
                ahead = not other.waiting.pass_start or self._rank(other) < self._rank(job)
            if ahead and self._safe(other, other.waiting):
                return False
        return True

    def _safe(self, job: JobState, want: Want) -> bool:
        """Would the state with `want` granted be within capacity and safe?"""
        active = self.active()
        holding = {j.name: j.held for j in active}
        holding[job.name] = want.held
        persistent = sum(j.persistent for j in active)
        if want.persistent is not None:
            persistent += want.persistent - job.persistent
        free = self.capacity - persistent - sum(holding.values())
        if free < 0:
            return False
        # Profiled jobs must all be able to finish, in some order. A job being
        # profiled has no claim: when it runs alone (the others hold nothing) it
        # goes first and hands its bytes back; otherwise it comes last, keeping them.
        pending = [j for j in active if j.claim is not None and not j.profiling]
        if all(holding[j.name] == 0 for j in pending):
            free += sum(holding[j.name] for j in active if j not in pending)
        while pending:
            runnable = next(
                (j for j in pending if max(j.claim, holding[j.name]) - holding[j.name] <= free), None
            )
            if runnable is None:
                return False
            free += holding[runnable.name]
            pending.remove(runnable)
        return True

    # ---- deadlock resolution -------------------------------------------------------
    def others_can_free(self, name: str) -> bool:
        """Whether another running job could free memory for job `name`: one that is
        not waiting, or whose wait could be granted now, or one waiting at the limit
        that came after it: of jobs stuck there the newest gives way first (as in
        stuck_victim), and what it held comes free for the others. Queued jobs free
        nothing, nor does a job that has parked its pages: it waits for room."""
        me = self.jobs[name]

        def frees(j: JobState) -> bool:
            if j.parked:
                return False
            if j.at_limit:
                return j.seq > me.seq  # it gives way before this one does
            return j.waiting is None or self._safe(j, j.waiting)

        return any(frees(j) for j in self.active() if j.name != name)

    def gives_way_to(self, name: str) -> list[str]:
        """The jobs waiting at the limit that came before job `name`, waiting there
        too: of jobs stuck there the newest gives way first, and they count on it."""
        me = self.jobs[name]
        return [j.name for j in self.active() if j.name != name and j.at_limit and j.seq < me.seq]

    def stuck_victim(self) -> str | None:
        """When every active job waits and none can be granted, the job to fail: one
        waiting at the limit, else the newest one being profiled (its size was unknown
        when it started). A job that parked its pages at the limit waits, and is never
        chosen: it has given way."""
        active = [j for j in self.active() if not j.parked]
        if not active or any(j.waiting is None and not j.at_limit for j in active):
            return None
        if any(not j.at_limit and self._safe(j, j.waiting) for j in active):
            return None  # someone can go: with everyone waiting, safety is the only rule
        # One waiting at the limit outgrew its plan: it gives way first (it fails as it
        # would have; the others' plans held). Then the newest being profiled that has
        # not trained yet (started again, one that has would repeat what it did).
        at_limit = [j for j in active if j.at_limit]
        profiling = [j for j in active if (j.profiling or j.pending_profile or j.claim is None) and not j.settled]
        victim = max(at_limit or profiling or active, key=lambda j: j.seq)
        victim.waiting = None
        victim.pending_profile = False
        return victim.name
