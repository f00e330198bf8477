"""The memory-flow engine: finds each job's models, profiles them, cuts them into
NodeGroups and gates each group's forward so that the jobs' memory flows between
them under one budget (Waterwave, IEEE TC 72(10), 2023, "NodeGroup pipeline
execution"; the admission rule is in wwrun/memory/scheduler.py).

How it hooks into unmodified scripts (see ../shared/facts.md, "Hooks"): through
torch's *global* module forward hooks only, installed while a job runs, so nothing is
stored on the user's modules: pickling, `torch.save` of a whole model,
`copy.deepcopy` (the copy is a plain model), `torch.jit.script` and `torch.export`
behave as without wwrun. Which module plays which part is in
weak maps on the engine (module -> model root, module -> group entry). They return
at once in threads of no job, and in a thread that dynamo, `torch.jit.trace`/`script`
or `torch.export` is tracing.

1. Discovery. While a job has not finished its first optimizer step, the hooks track
   the call depth per thread; the outermost module a job's thread calls is one of
   its models.
2. Profiling. The first forward pass of a model for an input signature (shapes,
   dtypes, grad mode) treats each submodule call as a node, and
   `saved_tensors_hooks` attribute the activation bytes saved for backward to the
   latest node, counted once per storage (parameters excluded). The pass's groups
   come from wwrun/memory/nodegroups.py. A new signature (a smaller last batch) is
   profiled again.
3. Gating. Afterwards the model's call and each group's entry module matter: the
   entry asks the scheduler for the group's growth and waits, on the job's own
   thread. Backward is never gated (on CUDA all jobs' backward runs on one autograd
   thread): it only hands memory back, group by group, as the saved tensors die, and
   that wakes the waiting jobs.

Memory is the allocator's (`meter`, on both devices: every byte a job's tensors
take, temporaries, gradients in flight and optimizer-step buffers included), read at
NodeGroup boundaries, never per tensor:
- persistent bytes P: the most the job holds when a pass starts with nothing saved
  for backward (parameters, gradients, optimizer state, its data), and at least
  what its parameters, gradients and optimizer state take;
- a group's target: the most the job held above its pass-start bytes up to the end
  of that group in the profiling pass (`Plan.targets`); the last group's target is
  the job's claim A, the most it held above them over a whole iteration (forward,
  backward, optimizer step), re-measured at every pass start;
- backward keeps the target of the groups it has yet to free, then what the
  optimizer step needs, until the step ends. Gradients count as persistent bytes
  (zero_grad may free them, but backward makes them again).
Saved-tensor accounting (what autograd keeps) remains only to choose the partition
(profiling passes) and to see backward's progress (afterwards one stand-in per group,
see _push_sentinel). Without a meter (PyTorch's allocator), the engine
counts persistent tensors and saved activations itself, as the groups' targets.

The allocator enforces the budget (a job that would overrun it waits for the
frees other jobs' backward is about to make, rule f, then fails alone); the engine
plans so that it need not. Three things are measured only as they happen: a
profiling pass (it checks after each module call and asks for room for the next
module to grow as much as the largest growth so far; its backward and step,
unmeasured until they end, run with no other pass started beside them: the claim
reaches the scheduler when the iteration ends, `_end_profile`), a newcomer's model
and data (built by its script before wwrun sees it, counted at its first pass; a
job is admitted, at its first device allocation (`admit`, called by the allocator's
gate: its setup before it runs beside the others), only when a model as small as
the smallest seen so far leaves room for every running job's iteration) and
optimizer state beyond the guess made before the first step (Adam's two buffers per
parameter). Gradients are reserved when the
model is found. A newcomer's first pass asks for the claim of a settled job with the
same parameters and inputs (one of a sweep) before it starts, so that alike jobs
wait for room rather than start a pass that cannot finish.

Passes under `no_grad` keep nothing for backward, but their temporaries take memory
(an evaluation set in one batch): each waits for the job's claim, and the first of an
input signature is measured as a profile is (`_begin_evaluation`), a job's first pass
too (nanoGPT evaluates before it trains: its model is reserved first). Such a job is
sized for newcomers by its first optimizer step, as any job that trains, or, when no
parameter of its models requires grad, by its second evaluation.

Our saved-tensor hooks keep an alias of each tensor without its autograd history
(`_kept`), so that a graph no backward frees dies with its output, as without them.

Offload (wwrun/memory/offload.py; `offload` is never, auto or always): a job whose
request can never be granted (its claim beyond the budget less what stays) stashes
what its passes save for backward in host memory instead of failing with JobTooLarge,
and its requests are capped at that room; while a pass is profiled, auto watches the
allocator's figure at each module call and starts stashing, on trial, before the
budget is reached. When that iteration ends its claim as if nothing had been stashed
decides: a job that fits without offload stops stashing and its stashed profiles are
made again, unstashed (`_settle_offload`). Such a pass keeps per-tensor saved-tensor
hooks (no stand-ins). While the jobs oversubscribe the budget, their passes keep
per-tensor hooks too, so that a job waiting at a gate can park what its pass saved on
the host when another waiting job could then go and the copies cost less than one
of its forwards (`_worth_parking`, offload.py's rule 6): the other job runs now.

Limitations: models first called after a job's first optimizer step are not found;
a model called inside someone else's saved-tensor hooks (a checkpointed model) is
gated but its activations are not counted, so as not to defeat those hooks.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.nn.modules import module as torch_module
from torch.optim import optimizer as torch_optimizer

from wwrun import forksafe, libstate
from wwrun.memory.nodegroups import Node, Plan, explain_plan, make_plan
from wwrun.memory.scheduler import Decision, Scheduler
from wwrun.memory.trace import Timeline

WAIT_POLL_S = 0.5
"""A waiting gate re-checks at least this often: a safety net, wake-ups are notified."""


LIMIT_RETRY_S = 60.0
"""At the limit a job waits (Engine.wait_at_limit) while the jobs' memory falls: once
it has not fallen below its lowest so far for this long (every job stalled, or one
held up by a lock the waiting job holds inside torch), its request fails, as without
wwrun."""

PERSISTENT_EVERY = 64
"""Persistent bytes are measured at the first two optimizer steps, then every this many."""


class JobTooLarge(RuntimeError):
    """The job cannot run within the memory limit, even alone.

    Raised in the job's own thread, from inside its model's forward, before the
    iteration that would not fit runs; the launcher reports it as that job's failure.
    """


class NoRoomYet(JobTooLarge):
    """The job fits alone but not beside the running jobs, and no job can go on (its
    model turned out larger than the jobs admitted so far). Raised in its thread
    before its first step; the launcher starts it again once another job has ended."""


@dataclass(eq=False)
class _Model:
    module: torch.nn.Module | None  # None once its job ended
    label: str  # for the report: the class name, numbered when a job has several
    plans: dict[tuple, Plan] = field(default_factory=dict)
    entries: set[str] = field(default_factory=set)  # names of modules that start a group
    evaluated: set[tuple] = field(default_factory=set)  # signatures of its measured no_grad passes
    # Signatures profiled again with nothing stashed: their stashed profile showed the
    # job fits without offload (Engine._settle_offload).
    fits_unstashed: set[tuple] = field(default_factory=set)


@dataclass(eq=False)
class _Pass:
    model: _Model
    signature: tuple
    plan: Plan | None  # None while profiling
    began: float = 0.0
    group: int = 0
    group_started: float = 0.0
    nodes: list[Node] = field(default_factory=list)
    node_names: dict = field(default_factory=dict)  # while profiling: submodule -> its name
    saved_hooks: object = None
    hooks_thread: int = 0  # the thread whose saved-tensor hooks stack holds saved_hooks
    sentinel_hooks: tuple | None = None  # measured steady state: our pushed (pack, unpack)
    profile_held: int = 0  # while profiling: held when the latest module began
    profile_step: int = 0  # while profiling: the most one module grew above that
    offload: object = None  # wwrun.memory.offload.PassOffload: its saved tensors may go to the host
    whole_claim: bool = False  # granted the job's whole claim at its start: its groups need no gate


@dataclass(eq=False)
class _Job:
    name: str
    priority: int
    index: int
    started: float = 0.0
    admitted: float | None = None  # left the queue
    queued_s: float = 0.0
    ended: float | None = None
    models: list[_Model] = field(default_factory=list)
    optimizers: list = field(default_factory=list)  # weak references
    param_keys: set[int] = field(default_factory=set)
    discovering: bool = True
    current: _Pass | None = None
    saved: dict[object, int] = field(default_factory=dict)  # storage (or offload handle) -> live saved tensors
    retained: int = 0
    persistent: int = 0  # measured now
    persistent_peak: int = 0  # most measured
    persistent_reserved: int = 0  # what the scheduler holds: the peak, or a prediction
    reserved: int = 0  # granted activation bytes of the forward in progress
    parked: int = 0  # of `retained`, the bytes parked on the host in the forward in progress
    release_marks: list[tuple[int, int, str, int]] = field(default_factory=list)  # (retained, group, label, keep)
    last_release: float = 0.0
    peak: int = 0
    wait_s: float = 0.0
    iterations: int = 0  # optimizer steps
    passes: int = 0
    trained_passes: int = 0  # training passes whose forward ended: its iterations while it takes no step
    window_stepped: bool = False  # an optimizer step ended since the latest pass started
    profiles: int = 0
    failed: str | None = None
    no_room: bool = False  # failed for want of room beside the others, not alone
    waiting_since: float = 0.0  # nonzero while a request of the job waits
    limit_wait: tuple[float, int] | None = None  # at the limit: since when, and the most room seen
    limit_parked: float = 0.0  # since when it has given way at the limit, its pages parked (Note [Parking])
    parked_persistent: int = 0  # its persistent bytes in the plan before it parked
    parked_this_request: bool = False  # its request at the limit parks at most once
    parked_bytes: int = 0  # host memory its parked pages take (of the offload limit's)
    not_parked: str = ""  # why it could not park, said when it gives way
    # The allocator's view (see the module's docstring); meter(restart) -> (now, window peak).
    meter: Callable[[bool], tuple[int, int]] | None = None
    baseline: int | None = None  # bytes when the current iteration's pass started
    claim: int = 0  # the most held above `baseline` over an iteration
    unstashed_claim: int = 0  # the same, as if nothing had been offloaded (with an offload meter)
    stashed_profiles: list[tuple[_Model, tuple]] = field(default_factory=list)  # measured stashing on trial
    step_need: int = 0  # the most held above `baseline` from backward's end through the step
    backward: Plan | None = None  # the measured plan whose backward is in progress (_measure_backward)
    iter_peak: int = 0  # the most held since `baseline` was taken
    # A profiled pass's claim, told the scheduler once its iteration is over: until
    # then its backward and step, still unmeasured, run with no other pass beside them.
    profile_claim: int | None = None
    evaluating: tuple | None = None  # a no_grad pass: (model, signature, baseline or None, reserved before)


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """What a pack hook of ours keeps of a saved tensor: an alias without its autograd
    history. A tensor a node saves may be that node's own output: kept as it is, it
    holds its grad_fn, which holds what our hook returned, a cycle through C++ that
    Python's collector cannot see. A graph that no backward frees (a pass that failed,
    a validation forward outside no_grad) then lived for good. Autograd gives the
    unpacked alias its edge back, so gradients, double backward too, are unchanged."""
    return tensor if tensor.is_leaf else tensor.detach()


class _Saved:
    """What autograd keeps for a saved tensor: the tensor, plus the accounting that
    ends when autograd drops it (after backward, or with the graph)."""

    __slots__ = ("tensor", "engine", "job", "key", "nbytes")

    def __init__(self, tensor, engine, job, key, nbytes):
        self.tensor, self.engine, self.job, self.key, self.nbytes = tensor, engine, job, key, nbytes

    def __del__(self):
        self.engine._unsave(self.job, self.key, self.nbytes)


class Engine:
    """Waterwave for one run. The launcher creates one, and in each job's thread calls
    `job_started(name)` before the script runs and `job_finished(name)` after it ends.

    capacity_bytes  the budget (device memory or --memory-limit); None: no limit
    policy          'waterwave' gates NodeGroups; other policies only measure
    nodegroups      groups per model (None: automatic, see nodegroups.auto_groups)
    queue           order of waiting jobs: 'fifo' or 'las'
    device          'cpu' or 'cuda'
    trace           record spans for write_trace
    current_job     thread -> job name (default: set by job_started in that thread)
    meter           job name -> its allocator meter (wwrun.memory.allocator.job_meter:
                    its held bytes, the pages under its blocks), called when the job
                    starts, after its thread is bound; None: no allocator to read,
                    the engine counts tensors itself
    page_bytes      the allocator's page, with a meter: the budget is planned in them
    offload         never | auto | always: whether a job's saved activations may go
                    to host memory (wwrun/memory/offload.py); offload_limit: host bytes
    """

    def __init__(
        self,
        capacity_bytes: int | None,
        policy: str = "waterwave",
        nodegroups: int | None = None,
        queue: str = "fifo",
        device: str = "cpu",
        trace: bool = False,
        *,
        current_job: Callable[[], str | None] | None = None,
        meter: Callable[[str], Callable[[bool], tuple[int, int]]] | None = None,
        page_bytes: int = 1,
        offload: str = "never",
        offload_limit: int = 0,
    ):
        if capacity_bytes is not None and capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        if nodegroups is not None and nodegroups < 1:
            raise ValueError(f"nodegroups must be at least 1, got {nodegroups}")
        self.capacity = capacity_bytes
        self.limit_bytes = capacity_bytes  # for the report: the budget planned at the start (set_capacity)
        self.policy = policy
        self.gating = policy == "waterwave"
        self.nodegroups = nodegroups
        self.device = device
        self._meter_of = meter  # the allocator's: then the budget is pages
        self.page_bytes = page_bytes if meter is not None else 1
        self.scheduler = Scheduler(self._budget if self.gating else None, queue=queue)
        self._local = threading.local()
        self._current_job = current_job or (lambda: getattr(self._local, "job", None))
        self._offload_options = (offload, offload_limit)
        self._offloader = None  # made at first need (Memory makes it at start-up)
        self._parking_pool = None  # with --offload never: the host memory parked pages take (_host_pool)
        # Critical sections take the lock itself, not the condition: Condition's
        # __enter__/__exit__ are Python code, and a job's Ctrl-C (an asynchronous
        # exception, often landing in a saved tensor's finalizer here) raised at the
        # start of __exit__ left the lock held for good, and every other job and the
        # launcher waited on it. The lock's own are C: nothing lands between them.
        self._lock = forksafe.RLock()
        self._cond = forksafe.Condition(self._lock)
        self._jobs: dict[str, _Job] = {}
        self._total = 0
        self._sentinels = 0  # group sentinels made (their keys)
        self.peak_total = 0
        self.timeline = Timeline(time.perf_counter(), spans=trace)
        self._global_handles: list = []
        # What a module is to the engine, without a mark on the module itself.
        self._roots: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> _Model
        self._entries: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # -> (_Model, name)
        self._step_handles: list = []
        # Release listeners hear (job, bytes held) as a group is granted and as
        # backward frees memory: the allocator uses it to know who is about to free
        # (its rule f).
        self.release_listeners: list[Callable[[str, int], None]] = []
        # State listeners hear (job, 'queued' | 'waiting' | 'running') as a job waits
        # for admission, its next NodeGroup waits for memory, or it goes on.
        self.state_listeners: list[Callable[[str, str], None]] = []
        # Called (under the lock) as a job ends, once its models are let go: the budget
        # from now on, measured (memory held for no live job stays out of it), or None.
        self.capacity_source: Callable[[], int | None] | None = None
        # The allocator's park_job and unpark_job for a job's name (Note [Parking] in
        # csrc/allocator/allocator_core.cpp), or None: a job that gives way at the
        # limit parks its pages on the host and waits, where it would fail.
        self.pages_parking: tuple[Callable[[str], int], Callable[[str], bool]] | None = None

    # ---- the launcher's contract ------------------------------------------------------
    def set_capacity(self, capacity_bytes: int) -> None:
        """The budget the jobs may plan for is now `capacity_bytes` (memory held for
        no live job changed: `capacity_source`)."""
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, got {capacity_bytes}")
        with self._lock:
            self.capacity = capacity_bytes
            if self.gating:
                self.scheduler.capacity = self._budget
            self._cond.notify_all()  # more room, or a waiter that now never fits: look again

    @property
    def _budget(self) -> int | None:
        """The capacity the scheduler plans in: under the allocator, whole pages (the
        quickstart under 23.7 MiB planned 1.7 MiB no request could have). A bound the
        engine sets on a job's need is checked against it too, so that it never makes
        the job "too large" by the part of a page the scheduler cannot plan."""
        return None if self.capacity is None else self._whole_pages(self.capacity)

    def _whole_pages(self, nbytes: int) -> int:
        """The whole pages in `nbytes`, at least one."""
        return max(self.page_bytes, nbytes - nbytes % self.page_bytes)

    def job_started(self, name: str, priority: int = 0, *, admit: bool = True) -> None:
        """In the job's thread, before its script runs. With `admit`, waits here while
        the job does not fit beside the running ones (`admit`); without, the job is
        admitted at its first use of memory: its first device allocation (the
        allocator's gate calls `admit`), else its first forward or optimizer step."""
        self._local.job = name
        self._local.depth = 0
        with self._lock:
            earlier = self._jobs.get(name)
            if earlier is not None and earlier.ended is None:  # an ended job may start again (a retry)
                raise ValueError(f"job {name!r} was already started")
            job = _Job(name, priority, len(self._jobs), started=time.perf_counter())
            if self._meter_of is not None:
                job.meter = self._meter_of(name)
            self._jobs[name] = job
            if self._offloader is not None:
                self._offloader.forget(name)
            if job.meter is not None and self.capacity is not None and self.offloader is not None:
                job.meter = self.offloader.job(name).measure(job.meter)
            self.timeline.track(name)
            self._install_global_hooks()
        if admit:
            self.admit(name)

    def admit(self, name: str) -> None:
        """Waits while the job does not fit beside the running ones (queued in arrival
        order, FIFO or LAS, then priority: scheduler.try_start); at once for a job
        admitted, ended or unknown. Any thread of the job may ask, several at once."""
        with self._lock:
            job = self._jobs.get(name)
            if job is None or job.admitted is not None or job.ended is not None:
                return
            if name not in self.scheduler.jobs:
                self.scheduler.enqueue(name, job.priority)
            waited_from = time.perf_counter()
            if not self.scheduler.try_start(name):
                self._tell(name, "queued")
                while job.ended is None and not self.scheduler.try_start(name):
                    self._cond.wait(WAIT_POLL_S)
                self._tell(name, "running")
            if job.admitted is None and job.ended is None:  # not by another of its threads meanwhile
                self._waited(job, "queued", waited_from)
                job.admitted = time.perf_counter()
                job.queued_s = job.admitted - waited_from

    def job_finished(self, name: str) -> None:
        """In the job's thread after its script ended (also on failure): every byte it
        reserved is handed back and waiting jobs wake."""
        with self._lock:
            job = self._jobs.get(name)
            if job is None or job.ended is not None:
                return
            job.ended = time.perf_counter()
            if job.parked_bytes:  # its copies went with its tensors
                self._host_pool().release(job.parked_bytes)
                job.parked_bytes = 0
            if job.current is not None:
                self._end_pass(job, failed=True)
            for model in job.models:
                self._forget(model)
                model.module = None  # its plans stay for the report; its memory goes with the job
            job.optimizers.clear()
            self._set_persistent(job, 0)
            job.discovering = False
            self.scheduler.finish(name)
        # A model and its optimizer are reference cycles (a module's class and
        # methods, its script's namespace): held here when the job's namespaces were
        # collected, they are freed only by a collection, or the budget measured
        # below counts them as held for good (2.5 MiB of a makemore MLP's, under a
        # 20 MiB limit).
        gc.collect()
        with self._lock:
            self._measure_budget()
            self._install_global_hooks()
            self._cond.notify_all()
            for listener in self.release_listeners:  # nothing more to free: rule f stops waiting for it
                listener(name, 0)
        if getattr(self._local, "job", None) == name:
            self._local.job = None

    def _tell(self, name: str, state: str) -> None:
        for listener in self.state_listeners:
            listener(name, state)

    def memory_of(self, name: str) -> int | None:
        """The job's live bytes now (for the live table); None for an unknown job."""
        job = self._jobs.get(name)
        if job is None:
            return None
        return self._live(job)

    def job_report(self, name: str) -> dict:
        job = self._jobs[name]
        groups = []
        for model in job.models:
            plan = self._main_plan(model)
            if plan is not None:
                groups += [
                    {"modules": [f"{model.label}.{m}" if m else model.label for m in g.modules],
                     "bytes": g.retained_bytes}
                    for g in plan.groups
                ]
        return {
            "peak_memory_bytes": job.peak,
            "wait_s": round(job.wait_s, 6),
            "queued_s": round(job.queued_s, 6),
            "iterations": job.iterations or job.trained_passes,
            "nodegroups": groups,
            **self._offload_report(name),
        }

    def run_report(self) -> dict:
        report = {"peak_memory_bytes": self.peak_total, "memory_limit_bytes": self.limit_bytes}
        pool = self._offloader.pool if self._offloader is not None else self._parking_pool
        if pool is not None:  # the host pool: the most it held, and its limit
            report.update(offload_host_peak_bytes=pool.peak, offload_limit_bytes=pool.limit)
        if self._offloader is not None:
            report.update(offload_copy_bytes_per_s=round(self._offloader.copy_rate or 0))
        return report

    def write_trace(self, path: str) -> None:
        self.timeline.write_trace(path, self.limit_bytes)

    def write_memory_plot(self, path: str, run_id: str | None = None) -> None:
        self.timeline.write_memory_plot(path, self.limit_bytes, run_id=run_id, device=self.device)

    def explain(self) -> str:
        lines = []
        for job in self._jobs.values():
            if not job.models:
                lines.append(f"[{job.name}] no model found yet")
            for model in job.models:
                plan = self._main_plan(model)
                if plan is not None:
                    lines.append(f"[{job.name}] " + explain_plan(model.label, plan, job.persistent_peak))
        return "\n".join(lines)

    # ---- discovery --------------------------------------------------------------------
    def _job(self) -> _Job | None:
        name = self._current_job()
        if name is None:
            return None
        job = self._jobs.get(name)
        return job if job is not None and job.ended is None else None

    def _forget(self, model: _Model) -> None:
        self._roots.pop(model.module, None)
        for module, (owner, _) in list(self._entries.items()):
            if owner is model:
                del self._entries[module]

    def _install_global_hooks(self) -> None:
        """The global hooks and the optimizer-step hooks, while some job runs."""
        active = any(j.ended is None for j in self._jobs.values())
        if active and not self._global_handles:
            # torch warns a compiled module's hooks would fire twice: ours are the only
            # global ones and know the compiled wrapper; the script should not hear of it.
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when there are global hooks")
            self._global_handles = [
                torch_module.register_module_forward_pre_hook(self._global_pre),
                torch_module.register_module_forward_hook(self._global_post, always_call=True),
            ]
        elif not active and self._global_handles:
            for handle in self._global_handles:
                handle.remove()
            self._global_handles = []
        if active and not self._step_handles:
            self._step_handles = [
                torch_optimizer.register_optimizer_step_pre_hook(self._before_step),
                torch_optimizer.register_optimizer_step_post_hook(self._after_step),
            ]
        elif not active and self._step_handles:
            for handle in self._step_handles:
                handle.remove()
            self._step_handles = []

    def _global_pre(self, module, args):
        if torch.compiler.is_dynamo_compiling() or libstate.tracing():
            return  # traced or exported graphs hold none of ours (dynamo traces hooks too)
        job = self._job()
        if job is None:
            return
        if job.discovering:  # (until its first step: the steady state's module calls skip both)
            if job.admitted is None:  # no device memory taken yet (a model trained on the host)
                self.admit(job.name)
            depth = getattr(self._local, "depth", 0)
            self._local.depth = depth + 1
            if depth == 0 and module not in self._roots:
                self._adopt(job, module)
        model = self._roots.get(module)
        if model is not None and job.current is None:
            self._root_pre(job, model, args, _call_kwargs())
            return
        current = job.current  # a model called inside another is one of its nodes
        if current is None:
            return
        if current.offload is not None:
            current.offload.boundary(current.profile_step)
        if current.plan is None:
            name = current.node_names.get(module)
            if name is not None:
                self._profile_node(job, current, name)
            return
        entry = self._entries.get(module)
        if entry is not None:
            self._enter_group(job, *entry)

    def _global_post(self, module, args, output):
        if torch.compiler.is_dynamo_compiling() or libstate.tracing():
            return
        job = self._job()
        if job is None:
            return
        if job.discovering:
            self._local.depth = max(0, getattr(self._local, "depth", 1) - 1)
        if job.evaluating is not None and job.evaluating[0].module is module:
            self._end_evaluation(job)
        current = job.current
        if current is None:
            return
        if current.model.module is module:
            self._root_post(job, current.model)
        elif current.plan is None and module in current.node_names:
            self._profile_output(current, output)

    def _adopt(self, job: _Job, module: torch.nn.Module) -> _Model:
        label = type(module).__name__
        if any(m.label == label for m in job.models):
            label = f"{label}{len(job.models)}"
        model = _Model(module, label)
        self._roots[module] = model
        with self._lock:
            job.models.append(model)
            job.param_keys |= {_storage_key(t) for t in _tensors_of(module) if _nbytes(t)}
        measured, missing_grads = self._measure_persistent(job)
        # Everything the script made before its first pass (its data too) stays:
        # with the allocator's figure, the newcomer's bytes are known before it grows.
        live = job.meter(False)[0] if job.meter is not None else measured
        with self._lock:  # requested (and waited for) before the model's first pass
            job.persistent_reserved = max(job.persistent_reserved, max(measured, live) + self._pages(missing_grads))
        return model

    # ---- passes -----------------------------------------------------------------------
    def _root_pre(self, job: _Job, model: _Model, args, kwargs) -> None:
        """A model's forward starts in `job`'s thread with no pass of the job in progress."""
        if not torch.is_grad_enabled():
            self._end_profile(job)  # a profiled iteration (that never stepped) is over
            state = self.scheduler.jobs.get(job.name)
            if state is None or job.evaluating is not None or model not in job.models:
                return
            if job.meter is not None:
                # Measured as a profile is, also as a job's first pass (nanoGPT
                # evaluates before it trains): taken for one keeping nothing, it ran
                # beside the others' passes and its temporaries did not fit.
                signature = _signature(args, kwargs)
                if (state.claim is not None and not state.settled and signature in model.evaluated
                        and not any(p.requires_grad for m in job.models for p in m.module.parameters())):
                    # A second evaluation of a model that cannot train: sized, so that
                    # newcomers need not wait for a job that only evaluates. One that may
                    # train (nanoGPT and Lightning evaluate first) is sized by its first
                    # step: newcomers let in on its evaluation's size left its training
                    # passes and optimizer state no room.
                    with self._lock:
                        self.scheduler.settle(job.name)
                        self._cond.notify_all()
                self._begin_evaluation(job, model, signature)
            elif state.claim is None and not state.profiling and not state.pending_profile:
                # Unmeasured (PyTorch's allocator): a job that has only run passes that
                # retain nothing is sized, so that newcomers need not wait for it.
                with self._lock:
                    self.scheduler.end_profile(job.name, 0)
                    self._cond.notify_all()
            return
        if torch._C._current_graph_task_id() != -1:
            return  # a forward re-run inside backward (checkpointing): never block there
        if model not in job.models:
            return
        if job.passes and job.name in self.scheduler.jobs and not self.scheduler.jobs[job.name].settled:
            with self._lock:  # a second pass: whatever its first iteration created exists
                self.scheduler.settle(job.name)
                self._cond.notify_all()
        signature = _signature(args, kwargs)
        now = time.perf_counter()
        self._iteration_begins(job)
        self._end_profile(job)  # a profiled iteration without an optimizer step ends here
        plan = model.plans.get(signature)  # after _end_profile: it may drop a stashed profile
        job.current = current = _Pass(model, signature, plan, began=now, group_started=now)
        job.passes += 1
        try:
            if plan is None:
                self._begin_profile(job, current)
            elif plan.groups:
                targets = self._targets(job, plan)
                current.whole_claim = self._gate(job, 0, target=targets[0], pass_start=True,
                                                 whole_claim=targets[-1] if plan.measured else None)
        except BaseException:
            self._end_pass(job, failed=True)
            raise
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            # Someone else's saved-tensor hooks (activation checkpointing, offloading)
            # decide what this pass keeps: ours on top would bypass them.
            return
        current.offload = self._begin_offload(job, current)
        if plan is not None and plan.measured and job.meter is not None and current.offload is None:
            self._push_sentinel(job, current, 0)
            return
        current.saved_hooks = torch.autograd.graph.saved_tensors_hooks(
            lambda t: self._pack(job, t, current.offload), _unpack
        )
        current.saved_hooks.__enter__()
        current.hooks_thread = threading.get_ident()

    def _begin_evaluation(self, job: _Job, model: _Model, signature: tuple) -> None:
        """A no_grad pass keeps nothing for backward, but its temporaries (a whole
        evaluation set in one batch) take memory: it waits for the job's claim. The
        first of an input signature is measured as a profile is, with no other job's
        pass started beside it; the claim then covers it."""
        first = signature not in model.evaluated
        kept = job.reserved  # between a forward and its backward: what the backward needs
        if first:
            with self._lock:  # a newcomer's model and data, as before a profiled pass
                self._persistent_admission(job)
        self._gate(job, 0, target=max(job.claim, kept), pass_start=True, profile=first)
        baseline = self._read(job, restart=True) if first else None
        job.evaluating = (model, signature, baseline, kept)

    def _end_evaluation(self, job: _Job) -> None:
        model, signature, baseline, kept = job.evaluating
        job.evaluating = None
        with self._lock:
            self._pass_fits_again(job)
            if baseline is not None:
                now, peak = job.meter(True)
                job.iter_peak = max(job.iter_peak, peak)
                job.claim = max(job.claim, peak - max(baseline, now))
                model.evaluated.add(signature)
                state = self.scheduler.jobs.get(job.name)
                if state is not None:
                    self.scheduler.end_profile(job.name, job.claim, settled=False)
            job.reserved = kept  # it keeps nothing
            self._report_held(job)

    def _root_post(self, job: _Job, model: _Model) -> None:
        """The forward of `job`'s pass in progress, of `model`, ended."""
        failed = sys.exc_info()[0] is not None  # always_call hooks run from an except
        self._end_pass(job, failed=failed)

    def _end_pass(self, job: _Job, failed: bool) -> None:
        current, now = job.current, time.perf_counter()
        job.current = None
        # Forward is over: what it left on the device stays for backward.
        offload, current.offload = current.offload, None
        # Saved-tensor hooks are per thread: a job abandoned mid-forward is ended from
        # the launcher's thread, whose stack does not hold them (torch asserts).
        if current.saved_hooks is not None and current.hooks_thread == threading.get_ident():
            current.saved_hooks.__exit__(None, None, None)
        self._pop_sentinel(current)
        current.node_names = {}
        with self._lock:
            self._pass_fits_again(job)
            if current.plan is None and not failed:
                self._finish_profile(job, current)
                if offload is not None and offload.job.provisional:
                    job.stashed_profiles.append((current.model, current.signature))
            elif current.plan is None:
                self.scheduler.abort_profile(job.name)
            self.scheduler.add_service(job.name, now - current.began)
            job.trained_passes += not failed
            plan = current.plan
            keep = 0  # what the job still needs once forward ends: backward and the step
            if plan is not None and plan.groups:
                if self.timeline.record_spans:
                    label = f"fwd {current.model.label} g{current.group}"
                    self.timeline.span(job.name, label, current.group_started, now)
                # Backward hands the groups back last to first; each crossing wakes
                # waiters and lowers what the job keeps to what the groups before need.
                keeps = plan.keeps()
                marks, remaining = [], job.retained
                for i in range(len(plan.groups) - 1, -1, -1):
                    remaining -= plan.groups[i].retained_bytes
                    after = keeps[i] if i > 0 else job.step_need
                    marks.append((max(remaining, 0), i, current.model.label, after if plan.measured else 0))
                job.release_marks = marks
                if plan.measured and not failed:
                    keep = self._targets(job, plan)[-1]
                    if job.meter is not None and job.baseline is not None:
                        self._read(job, restart=True)  # the last group's backward starts
                        job.backward = plan
            job.last_release = now
            job.reserved = keep  # the whole claim: backward fetches what was parked back
            self._total += job.parked
            job.parked = 0
            self._report_held(job)

    def _begin_profile(self, job: _Job, current: _Pass) -> None:
        with self._lock:
            self._persistent_admission(job)
            # A settled job of its kind lends its claim: the pass is planned with it.
            guess = self._profile_guess(job, current)
            self._gate(job, 0, target=guess, pass_start=True, profile=not guess)
        job.profiles += 1
        model = current.model
        current.nodes.append(Node(""))
        current.node_names = {sub: name for name, sub in model.module.named_modules() if sub is not model.module}

    def _profile_guess(self, job: _Job, current: _Pass) -> int:
        """What a job's first pass of this input asks for before it starts: the claim of
        a settled job with the same parameters and inputs (one of a sweep), else
        nothing (its growth is asked for as it is measured)."""
        state = self.scheduler.jobs.get(job.name)
        if state is None or self.capacity is None:
            return 0
        params = sum(_nbytes(p) for model in job.models for p in model.module.parameters())
        return self.scheduler.alike_claim(job.name, (params, current.signature))

    def _profile_node(self, job: _Job, current: _Pass, name: str) -> None:
        if job.current is not current or self._job() is not job:
            return
        self._measure_node(job, current)
        # Growth is measured, not predicted, in a profiling pass: ask for the most held
        # so far, and room for the next module to grow as much as the largest growth
        # of one module so far (its temporaries come before it can be measured).
        held = self._held_now(job)
        if current.nodes:
            current.profile_step = max(current.profile_step, current.nodes[-1].peak_bytes - current.profile_held)
        current.profile_held = held
        peak = max((node.peak_bytes for node in current.nodes), default=0)
        current.nodes.append(Node(name))
        target = max(peak, held + current.profile_step)
        state = self.scheduler.jobs.get(job.name)
        if self.capacity is not None and state is not None:
            target = min(target, max(held, self._budget - state.persistent))  # never "too large" by the margin
        self._gate(job, 0, target=target, profile=True)

    def _profile_output(self, current: _Pass, output) -> None:
        nbytes = sum(_nbytes(t) for t in _flat_tensors(output))
        node = current.nodes[-1]
        node.transient_bytes = max(node.transient_bytes, nbytes)

    def _measure_node(self, job: _Job, current: _Pass) -> None:
        """The allocator's most since the latest node began, as that node's peak."""
        if job.meter is None or job.baseline is None or not current.nodes:
            return
        _, peak = job.meter(True)
        node = current.nodes[-1]
        node.peak_bytes = max(node.peak_bytes, peak - job.baseline, 1)

    def _finish_profile(self, job: _Job, current: _Pass) -> None:
        self._measure_node(job, current)
        counts: dict[str, int] = {}
        for node in current.nodes:
            counts[node.module] = counts.get(node.module, 0) + 1
        for node in current.nodes:
            node.calls = counts[node.module]
        plan = make_plan(current.nodes, self.nodegroups)
        current.plan = plan
        model = current.model
        model.plans[current.signature] = plan
        for index, group in enumerate(plan.groups):
            if index > 0 and group.entry not in model.entries:
                model.entries.add(group.entry)
                self._entries[model.module.get_submodule(group.entry)] = (model, group.entry)
        if plan.measured:
            job.claim = max(job.claim, plan.targets()[-1])
            claim = job.claim
        else:  # PyTorch's allocator on CUDA: its transients are there too
            claim = job.retained + (plan.transient_bytes if self.device != "cpu" else 0)
        job.profile_claim = claim  # the scheduler hears it when the iteration ends (_end_profile)
        self.timeline.span(job.name, f"profile {model.label}", current.group_started, time.perf_counter())
        current.group = len(plan.groups) - 1

    def _end_profile(self, job: _Job) -> None:
        """A profiled iteration is over (its step, or the next pass): the scheduler
        gets its claim, the most it held over the whole iteration where the allocator
        measures, and other jobs' passes may start beside it again. Settled once its
        optimizer state exists (the first step) or, without one, at its next pass."""
        if job.profile_claim is None:
            return
        with self._lock:
            self._settle_offload(job)
            claim, job.profile_claim = job.profile_claim, None
            if job.meter is not None:
                claim = max(claim, job.claim)
            if job.name in self.scheduler.jobs:
                self.scheduler.end_profile(job.name, claim, settled=False)
            self._cond.notify_all()

    def _enter_group(self, job: _Job, model: _Model, entry: str) -> None:
        current = job.current
        if current.model is not model:
            return
        index = current.plan.entry_index.get(entry) if current.plan is not None else None
        if index is None or index <= current.group:
            return
        now = time.perf_counter()
        if self.timeline.record_spans:
            self.timeline.span(job.name, f"fwd {model.label} g{current.group}", current.group_started, now)
        target = self._targets(job, current.plan)[index]
        covered = current.whole_claim and target <= job.reserved  # granted already, unless backward
        if not covered:                                            # of an older graph gave some back
            self._gate(job, index, target=target)
            now = time.perf_counter()
        current.group, current.group_started = index, now
        if current.saved_hooks is None and not covered:
            # Under a whole claim the first group's stand-in alone follows backward: it
            # dies as backward ends, and the claim goes back then (no one waits for a
            # group's share sooner while every iteration fits).
            self._push_sentinel(job, current, index)

    # ---- admission ----------------------------------------------------------------------
    def _targets(self, job: _Job, plan: Plan) -> list[int]:
        """What the job may hold above its pass-start bytes once in each group; the
        last group holds the job's whole claim (backward and the step are not gated)."""
        targets = plan.targets()
        if targets and plan.measured:
            targets[-1] = max(targets[-1], job.claim)
        return targets

    def _gate(self, job: _Job, group: int, *, target: int = 0, pass_start=False, profile=False,
              whole_claim: int | None = None) -> bool:
        """Wait, on the job's thread, until the scheduler lets the job hold `target`
        activation bytes (at least what it holds already). A pass start given its
        `whole_claim` asks for all of it at once while every job's iteration fits
        beside the others' (Scheduler.roomy: nothing is refused then), so that its
        groups need no gate of their own; returns whether it did."""
        if not self.gating:
            return False
        with self._lock:
            if pass_start and not profile:
                job.reserved = 0
            whole = whole_claim is not None and not self._stashing(job) and self.scheduler.roomy()
            if whole:
                target = max(target, whole_claim)
            want = self._offload_cap(job, max(job.retained, job.reserved, target))
            started = time.perf_counter()
            try:
                while True:
                    decision = self.scheduler.request(job.name, want, pass_start=pass_start, profile=profile)
                    if decision is Decision.GRANT:
                        break
                    if decision is Decision.TOO_LARGE and self._start_offload(job, want):
                        want = self._offload_cap(job, want)
                        continue
                    if decision is Decision.TOO_LARGE:
                        job.failed = self._too_large_message(job, want)
                    elif not pass_start and not profile and self._worth_parking(job):
                        self._park(job)
                        continue
                    self._wait_for_memory(job)
            except BaseException:
                self._abandon_wait(job)
                raise
            self._stop_waiting(job)
            job.reserved = want
            self._waited(job, "wait g", started, group)
            self._sample(job)
            # It holds activations now, to be freed within the iteration: another job
            # the allocator cannot serve (fragmentation, a late model) may wait for them.
            for listener in self.release_listeners:
                listener(job.name, want)
            return whole

    def _persistent_admission(self, job: _Job) -> None:
        """A newly found model's persistent bytes, before its first profiled pass."""
        if not self.gating:
            return
        try:
            while True:
                decision = self.scheduler.request_persistent(job.name, job.persistent_reserved)
                if decision is Decision.GRANT:
                    self._stop_waiting(job)
                    return
                if decision is Decision.TOO_LARGE and self._start_offload(job, 0):
                    continue
                if decision is Decision.TOO_LARGE:
                    state = self.scheduler.jobs[job.name]
                    job.failed = self._too_large_message(job, max(state.claim or 0, state.held))
                self._wait_for_memory(job)
        except BaseException:
            self._abandon_wait(job)
            raise

    def wait_at_limit(self, name: str, nbytes: int, attempt: int = 0) -> bool | str:
        """The allocator cannot serve a request of `nbytes` of job `name`'s at the
        limit (Note [Waiting at the limit] in csrc/allocator/python_wait_hooks.h), for
        the `attempt`th time: the job outgrew what it was planned with (an evaluation
        on a larger batch than it trains on, late in its run). A job that fits alone
        waits here, on its thread, as a refused request does, until the plan has room
        for what it holds and asks for and the jobs hold less than ever since the
        request came; True: it tries again. False: the request fails, as without
        wwrun: no budget is planned, the job cannot fit even alone (in the budget the
        run started with), no other running job can free memory (memory ended jobs
        left, still dying, is waited for), the jobs' memory did not fall for
        LIMIT_RETRY_S, or every job waits and this one, having trained, gives way (one
        that has not starts again: NoRoomYet, raised here). Where a budget is planned
        the str that says why is returned instead of False: the allocator's message
        ends with it (Note [Waiting at the limit])."""
        job = self._jobs.get(name)
        if not self.gating or self.capacity is None or job is None or job.ended is not None or job.meter is None:
            return False
        with self._lock:
            state = self.scheduler.jobs.get(name)
            if state is None or job.admitted is None:
                return False
            need = job.meter(False)[0] + self._pages(nbytes)  # every page it holds, and the request's
            if need > self._whole_pages(self.limit_bytes):  # out of memory, as under python
                from wwrun.config import format_size

                return f"it would hold {format_size(need)} with what it holds: it cannot fit even alone"
            # Before its first pass what grows is its model and data: persistent bytes.
            setup = not job.passes and job.evaluating is None
            want = max(self._holding(job), need - state.persistent)
            started = time.perf_counter()
            if attempt == 0:
                job.parked_this_request, job.not_parked = False, ""
            if attempt == 0 or job.limit_wait is None:
                job.limit_wait = (started, self._room_now())
            since, most = job.limit_wait
            state.at_limit = state.outgrown = True  # the one to give way if every job waits
            try:
                while True:
                    # The budget as it is now: what ended jobs held as they ended is
                    # measured again (their last tensors die after them). While it is
                    # what keeps the job out, it waits for it, within the bound.
                    self._measure_budget()
                    outlived = need > self._budget
                    room, now = self._room_now(), time.perf_counter()
                    fell = room > most  # the jobs hold less than ever since it came
                    if fell:
                        since, most = now, room
                    if job.limit_parked:
                        # It gave way, its pages parked: once the jobs leave room for
                        # all it held and asks for, measured, and the plan too, it
                        # takes them back. Until then it asks for nothing.
                        decision = Decision.WAIT
                        if room >= need:
                            state.persistent = job.parked_persistent
                            decision = (self.scheduler.request_persistent(name, need) if setup
                                        else self.scheduler.request(name, want))
                            state.waiting = None
                        if decision is Decision.GRANT and self._unpark(job):
                            break
                        state.persistent = 0  # still parked: not in the others' way
                        self.scheduler.release(name, 0)
                    else:
                        if outlived:
                            decision = Decision.WAIT
                        elif setup:
                            decision = self.scheduler.request_persistent(name, need)
                        else:
                            decision = self.scheduler.request(name, want)
                        if decision is Decision.TOO_LARGE:
                            return self._give_up_at_limit(job, started, self._budget_too_small(need))
                        if decision is Decision.GRANT and (attempt == 0 or fell):
                            break
                    if now - since > LIMIT_RETRY_S:
                        return self._give_up_at_limit(job, started, (
                            f"no job's memory fell for {LIMIT_RETRY_S:g} s while it waited"
                            f" ({self._fits_alone(need)})"))
                    if not (outlived or job.limit_parked or self.scheduler.others_can_free(name)):
                        # None can free: the queued jobs wait for this one, and it
                        # would wait for them, or it gives way to a job waiting here:
                        # then it parks, once a request (its pages would help that job).
                        if self.scheduler.gives_way_to(name) and self._park_at_limit(job, state, attempt):
                            continue
                        return self._give_up_at_limit(job, started, self._none_can_free(name, need))
                    try:
                        if decision is Decision.GRANT or outlived or job.limit_parked:
                            self._cond.wait(WAIT_POLL_S)  # room the device has not freed yet
                            if job.failed:  # chosen to give way meanwhile (stuck_victim)
                                raise (NoRoomYet if job.no_room else JobTooLarge)(job.failed)
                        else:
                            self._wait_for_memory(job)
                    except NoRoomYet:
                        if not job.iterations:
                            raise  # nothing done yet: it starts again once a job has ended
                        # Every job waits and this one gives way. Started again, a job
                        # that has trained would repeat what it did: it parks, or its
                        # request fails.
                        job.failed, job.no_room = None, False
                        if job.limit_parked or self._park_at_limit(job, state, attempt):
                            continue  # it gives way parked (it may have parked meanwhile)
                        return self._give_up_at_limit(job, started, self._none_can_free(name, need))
                    if job.ended is not None or self._jobs.get(name) is not job:
                        return False  # abandoned meanwhile (a retry may hold the name)
            except BaseException:  # Ctrl-C, or NoRoomYet: it starts again
                self._give_up_at_limit(job, started, "")
                raise
            finally:
                state.at_limit = False
                self._cond.notify_all()  # it no longer counts as waiting here
            job.limit_wait = (since, most)
            self._stop_waiting(job)
            if not setup:
                job.reserved = max(job.reserved, want)
            self._waited(job, "wait limit", started)
            return True

    def _measure_budget(self) -> None:
        """Under the lock: the budget as it is now (capacity_source), measured."""
        capacity = self.capacity_source() if self.capacity_source is not None else None
        if capacity is not None and capacity != self.capacity:
            self.set_capacity(capacity)

    def _room_now(self) -> int:
        """The budget less every page the running jobs hold, measured."""
        return self._budget - sum(job.meter(False)[0] for job in self._jobs.values()
                                  if job.ended is None and job.meter is not None)

    def _give_up_at_limit(self, job: _Job, started: float, why: str) -> str:
        """wait_at_limit's end without room: the job's request fails (out of memory, as
        under python), what it asked for goes back, and it is no longer waiting.
        Returns `why`, which the allocator's message ends with."""
        self._waited(job, "wait limit", started)
        job.limit_wait = None
        if why and job.not_parked:
            why = f"{why}; it could not park: {job.not_parked}"
        job.not_parked = ""
        try:
            if job.limit_parked and not self._unpark(job):  # its pages come back at its next wait here
                self._back_in_plan(job)  # planned as if there
        finally:
            self._abandon_wait(job)
            self._pass_fits_again(job)
            self._report_held(job)
        return why

    def _park_at_limit(self, job: _Job, state, attempt: int) -> bool:
        """Under the lock: job `job`, waiting at the limit, gives way: the pages under
        its live blocks go to host memory, at the same addresses, and to the budget
        (Note [Parking] in csrc/allocator/allocator_core.cpp), and it waits, no longer
        counted on by the others (at_limit) nor asking the scheduler for anything,
        while newcomers stay out (outgrown). False where they cannot be parked, or
        where this request parked before (`attempt`: the allocator's count of its
        tries): its pages came back and it still did not fit, so parking again would
        copy them out and back until the bound."""
        if self.pages_parking is None or job.limit_parked or job.parked_this_request:
            return False
        # Its copies are host memory: counted against the offload limit, as offloaded
        # activations are (pinned memory past it would starve the machine).
        holds, pool = job.meter(False)[0], self._host_pool()
        if pool is None or not pool.reserve(holds):
            from wwrun.config import format_size

            room = max(0, pool.limit - pool.held) if pool is not None else 0
            job.not_parked = (f"its {format_size(holds)} would not fit in the {format_size(room)} of host"
                              f" memory --offload-limit leaves")
            return False
        try:
            parked = self.pages_parking[0](job.name)
        except BaseException:  # Ctrl-C, a device error: nothing is counted
            pool.settle(holds, 0)
            raise
        pool.settle(holds, parked)  # what it parked: the pages under its live blocks
        job.parked_bytes = parked
        if not parked:
            return False
        job.parked_this_request = True
        job.limit_parked = time.perf_counter()
        job.failed, job.no_room = None, False  # told to give way meanwhile: it has
        state.at_limit, state.waiting, state.parked = False, None, True
        # Off the device, its model and activations are not in the others' way.
        job.parked_persistent, state.persistent = state.persistent, 0
        self.scheduler.release(job.name, 0)
        self._cond.notify_all()
        return True

    def _unpark(self, job: _Job) -> bool:
        """Under the lock: the job's parked pages back in the budget, all or none."""
        if not self.pages_parking[1](job.name):
            return False
        self._host_pool().release(job.parked_bytes)
        job.parked_bytes = 0
        self.timeline.span(job.name, "parked", job.limit_parked, time.perf_counter())
        job.limit_parked = 0.0
        self._back_in_plan(job)
        return True

    def _back_in_plan(self, job: _Job) -> None:
        """Under the lock: the job is no longer a parked one to the scheduler, and its
        model is planned again (as a grant raised it, when its model grew; else as
        before it parked)."""
        state = self.scheduler.jobs.get(job.name)
        if state is not None:
            state.parked, state.persistent = False, max(state.persistent, job.parked_persistent)

    def _fits_alone(self, need: int) -> str:
        """Said of a request that fails at the limit although the job fits alone."""
        from wwrun.config import format_size

        return (f"alone it would fit: it would hold {format_size(need)} of the {format_size(self._budget)} planned;"
                " --retries runs a failed job again once memory frees up")

    def _budget_too_small(self, need: int) -> str:
        from wwrun.config import format_size

        return (f"the {format_size(need)} it would hold exceeds the {format_size(self.capacity)} the"
                f" jobs are planned in, the limit less what no running job holds")

    def _none_can_free(self, name: str, need: int) -> str:
        """Why no job will free memory for job `name`, waiting at the limit: the jobs
        that could are waiting there too and came first (it gives way to them), or
        they wait for this one (queued, or refused)."""
        others = [j for j in self.scheduler.active() if j.name != name]
        first = self.scheduler.gives_way_to(name)
        if first:
            return (f"every job that could free memory for it waits at the limit too, and it gives way to"
                    f" {', '.join(map(repr, first))}, there first ({self._fits_alone(need)})")
        return (f"no running job can free memory for it ({', '.join(repr(j.name) for j in others) or 'none'}"
                f" wait for it; {self._fits_alone(need)})")

    def _pass_fits_again(self, job: _Job) -> None:
        """Under the lock: the pass in which the job came to the limit is over (or
        it gave way there): newcomers may start again (Scheduler.try_start)."""
        state = self.scheduler.jobs.get(job.name)
        if state is not None and state.outgrown:
            state.outgrown = False
            self._cond.notify_all()

    def _abandon_wait(self, job: _Job) -> None:
        """Under the lock: a wait for memory ended in an exception (Ctrl-C, a job told
        to give way, one too large): the job no longer waits, nor asks for anything,
        whether its script ends now or catches the exception and goes on."""
        self._stop_waiting(job)
        state = self.scheduler.jobs.get(job.name)
        if state is not None:
            state.waiting = None
        self._cond.notify_all()

    def _stop_waiting(self, job: _Job) -> None:
        """Under the lock: the job's request was granted, or failed; it goes on."""
        if job.waiting_since:
            self._tell(job.name, "running")
        job.waiting_since = 0.0

    def _wait_for_memory(self, job: _Job) -> None:
        """One wait of a refused request (under the lock); raises if the job failed."""
        if job.failed:
            raise (NoRoomYet if job.no_room else JobTooLarge)(job.failed)
        if not job.waiting_since:
            # A new waiter changes what the others may do (the scheduler's preferences
            # give way when everyone waits): let them look again.
            job.waiting_since = time.perf_counter()
            self._tell(job.name, "waiting")
            self._cond.notify_all()
        victim = self.scheduler.stuck_victim()
        if victim is not None:
            self._jobs[victim].failed = self._no_room_message(victim)
            self._jobs[victim].no_room = True
            self._cond.notify_all()
            if victim == job.name:
                raise NoRoomYet(job.failed)
        # Waits even when another job was made to give way: it needs the lock to see
        # that, and one waiting at the limit is chosen again until it has (a newcomer
        # choosing it in a loop held the lock for good).
        self._cond.wait(WAIT_POLL_S)

    def _too_large_message(self, job: _Job, held: int) -> str:
        from wwrun.config import format_size

        room = f"the memory limit is {format_size(self.capacity)}: it cannot fit even alone"
        if self.limit_bytes is not None and self.capacity < self.limit_bytes:
            # Said as it is, not "the limit is 1.5MiB" under --memory-limit 2MiB.
            room = (f"the jobs have {format_size(self.capacity)} of the {format_size(self.limit_bytes)} budget"
                    f" ({format_size(self.limit_bytes - self.capacity)} is what ended jobs left allocated):"
                    " it cannot fit in the rest even alone")
        return (
            f"job {job.name!r} needs at least {format_size(job.persistent_reserved + held)}"
            f" ({format_size(job.persistent_reserved)} persistent + {format_size(held)} activations)"
            f" but {room} (use a smaller batch or model, or raise --memory-limit)"
        )

    def _no_room_message(self, name: str) -> str:
        from wwrun.config import format_size

        others = [j for j in self._jobs.values() if j.name != name and j.ended is None]
        held = format_size(sum(j.persistent_reserved for j in others))
        return (
            f"job {name!r} does not fit beside the running jobs"
            f" ({', '.join(j.name for j in others)} hold {held}"
            f" persistent) within {format_size(self.capacity)}; run it with fewer jobs at once"
            " (--max-concurrent) or a larger --memory-limit"
        )

    def _waited(self, job: _Job, label: str, since: float, group: int | None = None) -> None:
        now = time.perf_counter()
        if now - since > 1e-4:
            job.wait_s += now - since
            self.timeline.span(job.name, label if group is None else f"{label}{group}", since, now)

    def _host_pool(self):
        """The host memory the offload limit allows, for offloaded activations and
        parked pages alike: the offloader's pool, or with --offload never one for
        parked pages alone; None with a limit of 0."""
        if self.offloader is not None:
            return self.offloader.pool
        _mode, limit = self._offload_options
        if self._parking_pool is None and limit:
            from wwrun.memory.offload import HostPool

            self._parking_pool = HostPool(limit, pinned=False)
        return self._parking_pool

    # ---- offload (wwrun/memory/offload.py) ---------------------------------------------
    # A job whose iteration cannot fit what it can ever have stashes the tensors its
    # forward saves in host memory instead of failing: its requests are then capped at
    # that room (the offload keeps its bytes under it), and it never is "too large".
    @property
    def offloader(self):
        mode, limit = self._offload_options
        if self._offloader is None and mode != "never" and limit:  # a limit of 0: no host memory
            from wwrun.memory.offload import Offloader

            self._offloader = Offloader(mode, limit, self.device, span=self._offload_span)
        return self._offloader

    def _offload_span(self, name: str, label: str, start: float, end: float, nbytes: int) -> None:
        self.timeline.span(name, label, start, end, bytes=nbytes)

    def _offload_room(self, job: _Job) -> int:
        """The activation bytes the job can ever have: the budget less what stays."""
        state = self.scheduler.jobs.get(job.name)
        persistent = max(job.persistent_reserved, state.persistent if state else 0, job.baseline or 0)
        return self._budget - persistent

    def _stashing(self, job: _Job) -> bool:
        offloader = self._offloader
        return offloader is not None and self.capacity is not None and offloader.job(job.name).stashing

    def _offload_cap(self, job: _Job, held: int) -> int:
        return min(held, max(0, self._offload_room(job))) if self._stashing(job) else held

    def _start_offload(self, job: _Job, want: int) -> bool:
        """The job is too large: it stashes from now on (auto), if it may, and its
        claim is what it can have (the offload keeps it within). False when offload
        cannot help (what stays is too large already): it fails as before."""
        room = self._offload_room(job) if self.capacity is not None else 0
        state = self.scheduler.jobs.get(job.name)
        if room <= 0 or state is None or self.offloader is None:
            return False
        offload = self.offloader.job(job.name)
        if offload.stashing and max(want, state.claim or 0, state.held) <= room:
            return False
        stashing, offload.stashing, offload.provisional = offload.stashing, True, False
        if state.claim is not None:
            state.claim = min(state.claim, room)
        # What it holds, capped at this room from now on (a first step's optimizer
        # state makes the room smaller than the claim its profile kept).
        self._report_held(job)
        return not stashing or state.held <= room

    def _begin_offload(self, job: _Job, current: _Pass):
        """A grad pass's offload: stashing (always, or a job that needs it), watching
        (auto, a profiled pass, with the allocator's figures; not where a stashed profile
        of it showed the job fits), parkable (a planned pass while the jobs
        oversubscribe the budget), else None."""
        if self.capacity is None or self.offloader is None:
            return None
        watch = None
        if (current.plan is None and job.meter is not None and job.baseline is not None
                and current.signature not in current.model.fits_unstashed):
            watch = lambda: job.meter(False)[0] - job.baseline  # noqa: E731
        with self._lock:
            active, budget = self.scheduler.active(), self.scheduler.capacity
            parkable = (current.plan is not None and budget is not None and len(active) > 1
                        and sum(j.footprint for j in active) > budget)
        return self.offloader.begin_pass(job.name, self._offload_room(job), self.device, held=watch,
                                         parkable=parkable)

    def _worth_parking(self, job: _Job) -> bool:
        """Under the lock, the job waiting at a gate in the middle of its forward:
        whether parking what its pass saved lets another waiting job go, for less than
        one forward of the job in copies (rule 6 of offload.py): its forwards so far,
        as they ran. The other job would otherwise wait at least that long: until
        this one has been granted, run on and handed its bytes back in backward."""
        offload = job.current.offload if job.current is not None else None
        parked = offload.parkable_bytes() if offload is not None else 0
        if not parked:
            return False
        if not self.scheduler.unblocked_by(job.name, max(0, self._holding(job) - parked)):
            return False
        state = self.scheduler.jobs[job.name]
        forward_s = state.attained_s / max(1, job.passes - 1)  # the passes before this one
        return self.offloader.copy_seconds(parked) < forward_s

    def _park(self, job: _Job) -> None:
        """Parks the job's saved tensors on the host (its thread, at a gate): the copies
        run with the lock released, then the scheduler hears what the job still holds."""
        offload = job.current.offload
        self._lock.release()
        try:
            parked = offload.park()
        finally:
            self._lock.acquire()
        job.parked += parked
        self._total -= parked  # the saved tensors' count (without a meter) is the device's
        job.reserved = max(0, job.reserved - parked)
        self._report_held(job)

    def _settle_offload(self, job: _Job) -> None:
        """A profiled iteration is over. Where auto stashed in it on trial, what the job
        would have held with nothing stashed decides: if that fits beside what stays,
        the job stops stashing and the passes profiled stashing are profiled again
        (their figures were lowered by the offload); else it stashes from now on."""
        profiles, job.stashed_profiles = job.stashed_profiles, []
        offload = self._offloader.job(job.name) if self._offloader is not None else None
        if offload is None or not offload.provisional:
            return
        offload.provisional = False
        now = job.meter(False)[0]
        self._note_unstashed_claim(job, now, restart=False)
        # The scheduler's "fits alone". The bytes that were on the host are not pages:
        # a page more for where they would have ended.
        fits = max(job.persistent_peak, now) + job.unstashed_claim + self.page_bytes
        if fits <= self.capacity:
            offload.stashing = False
            job.claim = max(job.claim, job.unstashed_claim)
            for model, signature in profiles:
                model.plans.pop(signature, None)
                model.fits_unstashed.add(signature)

    def _note_unstashed_claim(self, job: _Job, now: int, restart: bool) -> None:
        """The iteration's claim as if nothing had been offloaded, where the job's
        meter weighs it (`job.claim`'s twin)."""
        offload = self._offloader.job(job.name) if self._offloader is not None else None
        meter = offload.meter if offload is not None else None
        if meter is None:
            return
        peak = meter.restart_peak() if restart else meter.peak
        if job.baseline is not None:
            job.unstashed_claim = max(job.unstashed_claim, self._above(job, peak, now))

    def _offload_report(self, name: str) -> dict:
        if self._offloader is None:
            return {"offloaded_bytes": 0, "fetched_bytes": 0, "fetch_stall_s": 0.0, "parked_bytes": 0}
        return self._offloader.report(name)

    # ---- measurement --------------------------------------------------------------------
    def _pack(self, job: _Job, tensor: torch.Tensor, offload=None):
        key, nbytes = _storage_of(tensor)
        if nbytes == 0:
            return _kept(tensor)
        if key in job.param_keys:
            return tensor
        stored = tensor if offload is None else offload.keep(tensor)
        if stored is not tensor:  # offloaded, its address may serve another storage: keyed by its handle
            key = ("offloaded", id(stored))
        else:
            stored = _kept(tensor)
        with self._lock:
            count = job.saved.get(key, 0)
            job.saved[key] = count + 1
            if count == 0:
                job.retained += nbytes
                self._total += nbytes
                current = job.current
                if current is not None and current.nodes:
                    current.nodes[-1].retained_bytes += nbytes
                if job.meter is None:  # the allocator's figures are read at group boundaries
                    self._note_peaks(job)
        return _Saved(stored, self, job, key, nbytes)

    # A measured pass (the allocator counts the bytes) needs no per-tensor accounting,
    # only backward's progress: the first tensor each group saves stands for the
    # group's planned bytes, and its death (backward has gone through the group's
    # first op) hands them back. Our hooks are pushed at a group's entry and popped
    # at its first save, so the rest of the pass runs with no Python call per saved
    # tensor in forward or backward (under contention, each costs a GIL hand-over).
    def _push_sentinel(self, job: _Job, current: _Pass, group: int) -> None:
        self._pop_sentinel(current)
        if torch._C._autograd._top_saved_tensors_default_hooks(False) is not None:
            return  # someone else's hooks (checkpointing) decide what this group keeps
        planned = current.plan.groups[group].retained_bytes
        if not planned:
            return

        def pack(tensor):
            key, nbytes = _storage_of(tensor)
            if current.sentinel_hooks is None or not nbytes or key in job.param_keys:
                return _kept(tensor)
            self._pop_sentinel(current)
            with self._lock:
                self._sentinels += 1
                key = -self._sentinels  # storages have positive keys
                job.saved[key] = 1
                job.retained += planned
                self._total += planned
            return _Saved(_kept(tensor), self, job, key, planned)

        current.sentinel_hooks = (pack, _unpack)
        torch._C._autograd._push_saved_tensors_default_hooks(pack, _unpack)

    @staticmethod
    def _pop_sentinel(current: _Pass) -> None:
        hooks, current.sentinel_hooks = current.sentinel_hooks, None
        if hooks is not None and torch._C._autograd._top_saved_tensors_default_hooks(False) == hooks:
            torch._C._autograd._pop_saved_tensors_default_hooks()

    def _unsave(self, job: _Job, key: int, nbytes: int) -> None:
        with self._lock:
            count = job.saved.get(key, 0) - 1
            if count > 0:
                job.saved[key] = count
                return
            job.saved.pop(key, None)
            job.retained -= nbytes
            self._total -= nbytes
            crossed = False
            while job.release_marks and job.retained <= job.release_marks[0][0]:
                _, group, label, after = job.release_marks.pop(0)
                # Never below what it holds now: gradients in flight, tensors fetched
                # back from the host.
                job.reserved = max(min(job.reserved, after), self._measure_backward(job, group))
                now = time.perf_counter()
                if self.timeline.record_spans:
                    self.timeline.span(job.name, f"bwd {label} g{group}", job.last_release, now)
                job.last_release, crossed = now, True
            if crossed or job.retained == 0:
                self._report_held(job)

    def _measure_backward(self, job: _Job, group: int) -> int:
        """Backward has gone through `group`: the most the job held meanwhile (since
        the group after it was through, or forward ended) is that group's backward
        need, which later passes keep until backward is through it (Plan.keeps).
        Returns what it holds now above what stays (0 unmeasured)."""
        plan = job.backward
        if plan is None or job.baseline is None:
            return 0
        now, peak = job.meter(True)
        job.iter_peak = max(job.iter_peak, peak)
        stays = max(job.baseline, job.persistent_peak)
        plan.groups[group].backward_peak_bytes = max(plan.groups[group].backward_peak_bytes, peak - stays)
        if group == 0:
            job.backward = None
        return max(0, now - stays)

    @staticmethod
    def _holding(job: _Job) -> int:
        """Activation bytes the job holds for the scheduler: its grant, or what its
        saved tensors on the device take, whichever is more."""
        return max(job.retained - job.parked, job.reserved)

    def _report_held(self, job: _Job) -> None:
        if job.ended is not None or self._jobs.get(job.name) is not job:
            return  # an ended attempt's late frees: a retry of the same name holds its own
        held = self._offload_cap(job, self._holding(job))
        self.scheduler.release(job.name, held)
        self._sample(job)
        self._cond.notify_all()
        for listener in self.release_listeners:
            listener(job.name, held)

    def _before_step(self, optimizer, args, kwargs) -> None:
        """An optimizer's first step creates its state: reserve it first (and wait
        for room), guessing Adam's two buffers per parameter; measured right after."""
        job = self._job()
        if job is None:
            return
        if job.admitted is None:  # a step before any forward or device memory
            self.admit(job.name)
        if job.meter is not None:
            now = self._read(job, restart=True)  # the step's own window starts
            if job.baseline is not None:
                with self._lock:
                    # Forward and backward are over: their peak is weighed against what
                    # stays now, before a first step's optimizer state stays too. That
                    # state was not there at the peak: weighed against it after the step,
                    # the claim lacked Adam's two buffers per parameter, and a job told it
                    # fit without offload ran out in its second pass.
                    job.claim = max(job.claim, self._above(job, job.iter_peak, now))
                    self._note_unstashed_claim(job, now, restart=False)
        if any(ref() is optimizer for ref in job.optimizers):
            return
        job.optimizers.append(weakref.ref(optimizer))
        stateless = sum(
            p.numel() * p.element_size()
            for group in optimizer.param_groups for p in group["params"]
            if p.requires_grad and not optimizer.state.get(p)
        )
        self._measure_persistent(job)
        with self._lock:
            if job.meter is not None:  # what it holds now, in pages: backward is over
                job.persistent_peak = max(job.persistent_peak, self._read(job, restart=False))
            guess = self._pages(2 * stateless)
            state = self.scheduler.jobs.get(job.name)
            if self.capacity is not None and state is not None:
                # A guess must never make a job "too large": keep it within the room
                # the job would have alone.
                guess = min(guess, max(0, self._budget - job.persistent_peak - (state.claim or 0)))
            job.persistent_reserved = job.persistent_peak + guess
            self._persistent_admission(job)

    def _after_step(self, optimizer, args, kwargs) -> None:
        job = self._job()
        if job is None:
            return
        job.iterations += 1
        job.window_stepped = True
        after_step = 0
        if job.meter is not None:
            after_step, step_peak = job.meter(True)
            job.iter_peak = max(job.iter_peak, step_peak)
            if job.baseline is not None:
                job.step_need = max(job.step_need, self._above(job, step_peak, after_step))
                job.claim = max(job.claim, self._above(job, job.iter_peak, after_step))
            if job.current is None and job.reserved:
                with self._lock:  # the step is over: until its next pass it needs nothing more
                    job.reserved = 0
                    self._report_held(job)
        self._end_profile(job)
        # Gradients and optimizer state appear in the first steps; afterwards a
        # periodic look is enough (a full walk costs ~0.2 ms on a small MLP).
        if job.iterations <= 2 or job.iterations % PERSISTENT_EVERY == 0:
            self._measure_persistent(job)
            with self._lock:
                if job.meter is not None:
                    # What it holds between steps, gradients included (as persistent:
                    # zero_grad may free them, but backward makes them again).
                    job.persistent_peak = max(job.persistent_peak, after_step)
                job.persistent_reserved = job.persistent_peak
                if job.claim and job.name in self.scheduler.jobs:
                    self.scheduler.raise_claim(job.name, job.claim)
                if job.name in self.scheduler.jobs:
                    self.scheduler.set_persistent(job.name, job.persistent_reserved)
                    self.scheduler.settle(job.name)
                    self._cond.notify_all()  # a queued job may fit now
        if job.discovering:
            with self._lock:
                job.discovering = False
                self._install_global_hooks()

    def _measure_persistent(self, job: _Job) -> tuple[int, int]:
        """Parameters, buffers, gradients and optimizer state, once per storage.
        Returns (bytes, bytes of the gradients backward has yet to create)."""
        seen: dict[int, int] = {}
        missing_grads = 0
        for model in job.models:
            for tensor in _tensors_of(model.module):
                if _nbytes(tensor):
                    seen[_storage_key(tensor)] = _nbytes(tensor)
                grad = getattr(tensor, "grad", None)
                if grad is not None and _nbytes(grad):
                    seen[_storage_key(grad)] = _nbytes(grad)
                elif isinstance(tensor, torch.nn.Parameter) and tensor.requires_grad:
                    missing_grads += tensor.numel() * tensor.element_size()
        for ref in job.optimizers:
            optimizer = ref()
            for state in optimizer.state.values() if optimizer is not None else ():
                for value in state.values():
                    if isinstance(value, torch.Tensor) and _nbytes(value):
                        seen[_storage_key(value)] = _nbytes(value)
        measured = sum(seen.values())
        with self._lock:
            self._set_persistent(job, measured)
            job.persistent_peak = max(job.persistent_peak, measured)
        return measured, missing_grads

    def _pages(self, nbytes: int) -> int:
        """Bytes of tensors still to come as what they will hold of the budget: under
        the allocator, whole pages, and one more for a partly used one (a newcomer's
        gradients measured in bytes once made it plan 0.9 MiB short of its pages)."""
        page = self.page_bytes
        return (-(-nbytes // page) + 1) * page if nbytes and page > 1 else nbytes

    def _set_persistent(self, job: _Job, nbytes: int) -> None:
        self._total += nbytes - job.persistent
        job.persistent = nbytes
        self._note_peaks(job)
        self._sample(job)

    def _live(self, job: _Job) -> int:
        if job.meter is not None:
            return job.meter(False)[0]
        return job.persistent + job.retained - job.parked

    def _read(self, job: _Job, restart: bool) -> int:
        """The job's bytes now from the allocator, keeping the iteration's peak."""
        now, peak = job.meter(restart)
        job.iter_peak = max(job.iter_peak, peak)
        return now

    def _iteration_begins(self, job: _Job) -> None:
        """A pass starts with nothing saved for backward: the previous iteration's
        peak becomes the job's claim, and what it holds now its persistent bytes.

        What a step left (optimizer state, gradients) stays from then on: the peak
        counts above it. Without a step since the last pass started (LBFGS's passes
        within its step, weights updated by hand) what grew meanwhile came after the
        peak (LBFGS's history) and the next pass starts on top of it: the peak counts
        above the last pass's start, or the claim falls short by that growth."""
        if job.meter is None or job.retained:
            return
        now = self._read(job, restart=True)
        with self._lock:
            if job.baseline is not None:
                stays = now if job.window_stepped else 0
                job.claim = max(job.claim, self._above(job, job.iter_peak, stays))
                if job.name in self.scheduler.jobs and self.scheduler.jobs[job.name].claim is not None:
                    self.scheduler.raise_claim(job.name, job.claim)
            self._note_unstashed_claim(job, now, restart=True)  # and the new iteration's starts
            job.baseline = job.iter_peak = now
            job.window_stepped = False
            if now > job.persistent_peak:
                job.persistent_peak = now
                if job.name in self.scheduler.jobs:
                    job.persistent_reserved = max(job.persistent_reserved, now)
                    self.scheduler.set_persistent(job.name, job.persistent_reserved)

    @staticmethod
    def _above(job: _Job, peak: int, now: int) -> int:
        """The most held over what stays: above the iteration's start, its end (`now`;
        0 where what grew by then came after the peak) or the job's persistent bytes,
        whichever is more (its first iteration creates optimizer state and gradients,
        persistent bytes, not the claim)."""
        return max(0, peak - max(job.baseline, now, job.persistent_peak))

    def _held_now(self, job: _Job) -> int:
        """Activation bytes the job holds now: the allocator's above its pass start,
        or the saved tensors without one."""
        if job.meter is None or job.baseline is None:
            return job.retained
        return max(job.retained, self._read(job, restart=False) - job.baseline)

    def _note_peaks(self, job: _Job) -> None:
        live = self._live(job)
        if live > job.peak:
            job.peak = live
        total = self._total if job.meter is None else sum(
            self._live(j) for j in self._jobs.values() if j.ended is None)
        if total > self.peak_total:
            self.peak_total = total

    def _sample(self, job: _Job) -> None:
        if self.timeline.record_spans:  # recorded for the trace and the memory plot, which read samples
            self.timeline.sample(time.perf_counter(), job.name, self._live(job))

    def _main_plan(self, model: _Model) -> Plan | None:
        """The plan of the signature seen first (the steady-state batch)."""
        return next(iter(model.plans.values()), None)


def _unpack(saved):
    tensor = saved.tensor if isinstance(saved, _Saved) else saved
    return tensor if isinstance(tensor, torch.Tensor) else tensor.get()  # an offloaded one's handle


def _nbytes(tensor: torch.Tensor) -> int:
    """Bytes of the tensor's storage; 0 for tensors without one (sparse, nested, meta)."""
    return _storage_of(tensor)[1]


def _storage_key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def _storage_of(tensor: torch.Tensor) -> tuple[int, int]:
    """(_storage_key, _nbytes) from one look at the storage; (0, 0) without one."""
    try:
        storage = tensor.untyped_storage()
    except (RuntimeError, NotImplementedError, TypeError):
        return 0, 0
    return storage.data_ptr(), storage.nbytes()


def _tensors_of(module: torch.nn.Module):
    yield from module.parameters()
    yield from module.buffers()


def _flat_tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _flat_tensors(item)
    elif isinstance(value, dict):
        for item in value.values():
            yield from _flat_tensors(item)


def _call_kwargs() -> dict:
    """The keyword arguments of the module call being hooked. Global forward pre-hooks
    are not given them (torch has `with_kwargs` for module-level ones only), so they
    are read from `Module._call_impl`'s frame, a few frames up; {} if not found."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        if frame.f_code.co_name == "_call_impl":
            kwargs = frame.f_locals.get("kwargs")
            return kwargs if isinstance(kwargs, dict) else {}
        frame = frame.f_back
    return {}


def _signature(args, kwargs) -> tuple:
    """What makes a profile valid: the tensor inputs' shapes and dtypes."""
    parts = []
    for value in (*args, *kwargs.values()):
        for tensor in _flat_tensors(value):
            parts.append((tuple(tensor.shape), tensor.dtype, tensor.device.type))
    return tuple(parts)
