"""Partition balance and plan building (wwrun/memory/nodegroups.py)."""

import itertools
import random

import pytest

from wwrun.memory.nodegroups import Group, Node, Plan, make_plan, partition


def brute_force_best(sizes, k):
    """Smallest largest-group sum over every way to cut `sizes` into k pieces."""
    n = len(sizes)
    best = None
    for cuts in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cuts, n)
        worst = max(sum(sizes[a:b]) for a, b in itertools.pairwise(bounds))
        best = worst if best is None else min(best, worst)
    return best


def test_partition_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(1, 9)
        sizes = [rng.choice([0, 1, 2, 5, 10, 100, rng.randint(0, 1000)]) for _ in range(n)]
        k = rng.randint(1, n)
        ranges = partition(sizes, k)
        assert len(ranges) == k
        assert [i for r in ranges for i in r] == list(range(n)), "contiguous, complete, in order"
        assert all(len(r) > 0 for r in ranges)
        assert max(sum(sizes[i] for i in r) for r in ranges) == brute_force_best(sizes, k)


def test_partition_small_cases():
    assert partition([4, 1, 1, 4], 2) == [range(0, 2), range(2, 4)]
    assert partition([1, 1, 1], 5) == [range(0, 1), range(1, 2), range(2, 3)]
    assert partition([], 3) == []
    with pytest.raises(ValueError):
        partition([1], 0)


def test_plan_never_starts_a_group_at_a_repeated_module():
    # 'act' is one ReLU reused after each layer: it may never be an entry.
    nodes = [Node("", 0)]
    for i in range(4):
        nodes += [Node(f"fc{i}", 100), Node("act", 50, calls=4)]
    plan = make_plan(nodes, groups=4)
    assert len(plan.groups) == 4
    assert all(g.entry != "act" for g in plan.groups)
    assert [g.retained_bytes for g in plan.groups] == [150, 150, 150, 150]
    assert plan.retained_bytes == 600
    assert plan.entry_index == {"": 0, "fc1": 1, "fc2": 2, "fc3": 3}


def test_plan_defaults_and_no_grad_pass():
    nodes = [Node(f"m{i}", 10 * (i + 1)) for i in range(12)]
    assert len(make_plan(nodes).groups) == 8
    silent = make_plan([Node("", 0), Node("a", 0), Node("b", 0)])
    assert len(silent.groups) == 1 and silent.retained_bytes == 0


def test_backward_keeps_what_the_groups_before_measured_in_their_backward():
    """Once backward is through a group, the job keeps the most the groups before it
    need: their forward target, or the gradients in flight on top of what they saved
    (their measured backward), whichever is more; unmeasured, the forward target."""
    plan = Plan(groups=[Group(["a"], 10, 0, peak_bytes=10), Group(["b"], 10, 0, peak_bytes=20),
                        Group(["c"], 10, 0, peak_bytes=30)])
    assert plan.keeps() == [0, 10, 20]
    plan.groups[0].backward_peak_bytes = 25
    plan.groups[1].backward_peak_bytes = 15
    assert plan.keeps() == [0, 25, 25]
