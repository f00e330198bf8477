"""NodeGroups: a model cut into contiguous groups of modules of similar memory.

Waterwave (Peng et al., "Waterwave: A GPU Memory Flow Engine for Concurrent DNN
Training", IEEE TC 72(10), 2023) partitions each model, in execution order, into
contiguous "node groups" of roughly equal memory, so that the memory one job's
backward frees group by group is likely to fit the next group another job asks for.

Glossary
    node     one module call in a forward pass, in call order (a parent's call comes
             before its children's). A node's bytes are the activation bytes saved for
             backward between its entry and the next node's entry.
    profile  the nodes of one forward pass of one model for one input signature.
    group    a contiguous run of nodes; it starts at its *entry* node, whose module
             the engine hooks to gate the group's forward.

The partition minimises the largest group's retained bytes (the "linear partition"
problem): binary search on the answer with a greedy feasibility check, exact for
integer sizes. Only modules called once per pass may start a group, so a group's
entry hook fires exactly once per pass.

This module has no torch dependency: the engine records profiles, this cuts them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_AUTO_GROUPS = 8
"""Groups per model when the user does not say. Each group costs one gate (a few µs)
per forward; beyond ~8 the flow of memory between jobs gains little (see
benchmarks/waterwave.py for the measured gate cost)."""


@dataclass(slots=True)
class Node:
    """One module call of a profiled forward pass."""

    module: str
    """Qualified name within the model ('' is the model itself)."""
    retained_bytes: int = 0
    """Activation bytes saved for backward while this node was the latest entered."""
    transient_bytes: int = 0
    """Bytes of the module's outputs: a lower bound of the memory it needs at once."""
    calls: int = 1
    """How often this module was called in the pass (entries only at calls == 1)."""
    peak_bytes: int = 0
    """The most the job's allocator held above its pass-start bytes while this node
    was the latest entered: saved activations, temporaries and all (0 unmeasured)."""


@dataclass(slots=True)
class Group:
    """A contiguous run of nodes, gated as one unit."""

    modules: list[str]
    retained_bytes: int
    transient_bytes: int
    peak_bytes: int = 0
    """The most the job held above its pass-start bytes within the group (measured)."""
    backward_peak_bytes: int = 0
    """The most it held above them during the group's backward: the gradients in flight
    come on top of what the group saved (measured once a backward went through it)."""

    @property
    def entry(self) -> str:
        return self.modules[0]

    def as_dict(self) -> dict:
        return {"modules": list(self.modules), "bytes": self.retained_bytes}


@dataclass(slots=True)
class Plan:
    """The groups of one model for one input signature, with the growth each asks for."""

    groups: list[Group]
    entry_index: dict[str, int] = field(default_factory=dict)
    """Entry module name -> group index."""
    # A group's forward figures are fixed once the plan is made (its backward's are
    # not): what they decide is worked out once, not at every gate of every pass.
    _measured: bool = field(default=False, init=False, repr=False)
    _targets: tuple[int, ...] = field(default=(), init=False, repr=False)

    def __post_init__(self):
        self.entry_index = {g.entry: i for i, g in enumerate(self.groups)}
        self._measured = any(g.peak_bytes for g in self.groups)
        targets, reach = [], 0
        for group in self.groups:
            reach = max(reach, group.peak_bytes) if self._measured else reach + group.retained_bytes
            targets.append(reach)
        self._targets = tuple(targets)

    @property
    def retained_bytes(self) -> int:
        return sum(g.retained_bytes for g in self.groups)

    @property
    def transient_bytes(self) -> int:
        return max((g.transient_bytes for g in self.groups), default=0)

    @property
    def measured(self) -> bool:
        """Whether the allocator measured the pass (then targets come from it)."""
        return self._measured

    def targets(self) -> list[int]:
        """The bytes above its pass-start memory a job may hold once it enters each
        group: the most measured up to there, or, unmeasured, the activations the
        groups so far retain."""
        return list(self._targets)

    def keeps(self) -> list[int]:
        """What the job may still need once backward has gone through each group: the
        forward target of the groups before it, or the most their backward measured,
        whichever is more (the first group's entry is 0: the optimizer step's need
        is the engine's)."""
        keeps, targets, backward = [0], self.targets(), 0
        for i in range(1, len(self.groups)):
            backward = max(backward, self.groups[i - 1].backward_peak_bytes)
            keeps.append(max(targets[i - 1], backward))
        return keeps


def partition(sizes: list[int], groups: int) -> list[range]:
    """Cut `sizes` into min(groups, len(sizes)) contiguous non-empty ranges whose
    largest sum is as small as possible.

    >>> partition([4, 1, 1, 4], 2)
    [range(0, 2), range(2, 4)]
    """
    if groups < 1:
        raise ValueError(f"groups must be at least 1, got {groups}")
    if any(s < 0 for s in sizes):
        raise ValueError("sizes must not be negative")
    n = len(sizes)
    if n == 0:
        return []
    k = min(groups, n)
    low, high = max(sizes), sum(sizes)
    while low < high:  # smallest largest-group bound that k groups can meet
        mid = (low + high) // 2
        if _groups_needed(sizes, mid) <= k:
            high = mid
        else:
            low = mid + 1
    return _cut(sizes, low, k)


def _groups_needed(sizes: list[int], bound: int) -> int:
    count, current = 1, 0
    for s in sizes:
        if current + s > bound:
            count, current = count + 1, s
        else:
            current += s
    return count


def _cut(sizes: list[int], bound: int, k: int) -> list[range]:
    """Greedy fill up to `bound`, cutting early only to leave one item per group still
    to make; every group then stays within `bound` (single items are <= bound)."""
    ranges, start, current = [], 0, 0
    for i, s in enumerate(sizes):
        groups_left = k - len(ranges)  # including the one being filled
        items_left = len(sizes) - i  # including item i
        if i > start and (current + s > bound or items_left < groups_left):
            ranges.append(range(start, i))
            start, current = i, 0
        current += s
    ranges.append(range(start, len(sizes)))
    return ranges


def auto_groups(nodes: list[Node]) -> int:
    """The default number of groups: one per node that retains memory, at most
    MAX_AUTO_GROUPS (one when nothing is retained, e.g. under no_grad)."""
    total = sum(n.retained_bytes for n in nodes)
    nonzero = sum(1 for n in nodes if n.retained_bytes > 0)
    if total == 0:
        return 1
    return max(1, min(MAX_AUTO_GROUPS, nonzero))


def make_plan(nodes: list[Node], groups: int | None = None) -> Plan:
    """The NodeGroups of a profiled pass: `groups` of them (None: `auto_groups`)."""
    if not nodes:
        return Plan(groups=[])
    # Segments start at modules called once per pass; a repeated module (a shared
    # activation, a looped cell) stays with the segment before it.
    segments: list[list[Node]] = []
    for node in nodes:
        if segments and node.calls > 1:
            segments[-1].append(node)
        else:
            segments.append([node])
    wanted = auto_groups(nodes) if groups is None else groups
    sizes = [sum(n.retained_bytes for n in seg) for seg in segments]
    result = []
    for cut in partition(sizes, wanted):
        members = [n for seg in segments[cut.start:cut.stop] for n in seg]
        modules = list(dict.fromkeys(n.module for n in members))
        result.append(
            Group(
                modules=modules,
                retained_bytes=sum(n.retained_bytes for n in members),
                transient_bytes=max(n.transient_bytes for n in members),
                peak_bytes=max(n.peak_bytes for n in members),
            )
        )
    return Plan(groups=result)


def explain_plan(model: str, plan: Plan, persistent_bytes: int) -> str:
    """Human-readable groups, for `wwrun --explain` and the logs."""
    from wwrun.config import format_size

    lines = [
        f"{model}: {len(plan.groups)} NodeGroups, {format_size(plan.retained_bytes)} retained"
        f" activations, {format_size(persistent_bytes)} persistent (the job's)"
    ]
    for i, group in enumerate(plan.groups):
        shown = ", ".join(m or "<root>" for m in group.modules[:6])
        more = f", ... (+{len(group.modules) - 6})" if len(group.modules) > 6 else ""
        lines.append(f"  group {i}: {format_size(group.retained_bytes):>9}  {shown}{more}")
    return "\n".join(lines)
