"""Per-job random state: each job draws from its own torch, `random` and numpy state,
and seeded scripts run beside others reproduce their solo losses bit for bit."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from wwrun import rng

SCRIPTS = Path(__file__).parent / "scripts"
TRAINING = str(SCRIPTS / "seeded_training.py")


def in_job(fn, *args):
    """Run `fn` in a fresh thread that is a job's main thread; return its result."""
    result, error = {}, {}

    def main():
        rng.enter_job()
        try:
            result["value"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            error["exc"] = exc
        finally:
            rng.leave_job()

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    if error:
        raise error["exc"]
    return result["value"]


def torch_draws(seed):
    torch.manual_seed(seed)
    layer = torch.nn.Linear(4, 4)
    return torch.cat([
        layer.weight.flatten(),
        torch.randn(3),
        torch.nn.functional.dropout(torch.ones(6), 0.5),
        torch.randperm(5).float(),
        torch.empty((), dtype=torch.int64).random_(0, 1000).float().reshape(1),
    ])


# -- the acceptance test ----------------------------------------------------------------


def _solo_losses(tmp_path, seed, variant):
    out = tmp_path / f"solo-{seed}-{variant}.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run([sys.executable, TRAINING, str(seed), variant, str(out)], check=True, env=env, timeout=120)
    return json.loads(out.read_text())["losses"]


def test_seeded_scripts_beside_each_other_reproduce_their_solo_losses(tmp_path):
    runs = [(1, "mlp"), (2, "mlp"), (1, "conv")]
    command = [sys.executable, "-m", "wwrun", "--quiet", "--log-dir", str(tmp_path / "logs")]
    for i, (seed, variant) in enumerate(runs):
        command += ([":"] if i else []) + [TRAINING, str(seed), variant, str(tmp_path / f"together-{i}.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    for i, (seed, variant) in enumerate(runs):
        together = json.loads((tmp_path / f"together-{i}.json").read_text())["losses"]
        assert together == _solo_losses(tmp_path, seed, variant), (seed, variant)


# -- torch ---------------------------------------------------------------------------------


def test_a_job_draws_what_the_same_seed_draws_outside_jobs():
    assert torch.equal(in_job(torch_draws, 5), torch_draws(5))


def test_manual_seed_in_one_job_leaves_another_alone():
    seeded, reseeded = threading.Barrier(2), threading.Barrier(2)

    def first():
        torch.manual_seed(1)
        seeded.wait()
        reseeded.wait()  # the other job has seeded meanwhile
        return torch.randn(4)

    def second():
        seeded.wait()
        torch.manual_seed(2)
        reseeded.wait()
        return torch.randn(4)

    results = {}
    threads = [
        threading.Thread(target=lambda: results.update(first=in_job(first))),
        threading.Thread(target=lambda: results.update(second=in_job(second))),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert torch.equal(results["first"], torch.randn(4, generator=torch.Generator().manual_seed(1)))
    assert torch.equal(results["second"], torch.randn(4, generator=torch.Generator().manual_seed(2)))


def test_jobs_leave_torchs_own_generator_alone():
    torch.manual_seed(11)
    before = torch.default_generator.get_state()
    in_job(torch_draws, 3)
    assert torch.equal(torch.default_generator.get_state(), before)
    assert torch.initial_seed() == 11


def test_rng_state_round_trip_and_initial_seed_are_per_job():
    def job():
        torch.manual_seed(21)
        state = torch.get_rng_state()
        first = torch.rand(3)
        torch.set_rng_state(state)
        return torch.initial_seed(), torch.equal(first, torch.rand(3))

    assert in_job(job) == (21, True)


def test_fork_rng_restores_the_jobs_state():
    def job():
        torch.manual_seed(4)
        with torch.random.fork_rng():
            torch.manual_seed(99)
            torch.rand(5)
        return torch.rand(3)

    assert torch.equal(in_job(job), torch.rand(3, generator=torch.Generator().manual_seed(4)))


def test_unseeded_jobs_start_from_different_seeds():
    assert in_job(torch.initial_seed) != in_job(torch.initial_seed)


def test_threads_a_job_starts_draw_from_its_generator():
    def job():
        torch.manual_seed(8)
        drawn = {}
        worker = threading.Thread(target=lambda: drawn.update(x=torch.rand(2)))
        worker.start()
        worker.join()
        return drawn["x"], torch.rand(2)

    in_worker, after = in_job(job)
    reference = torch.Generator().manual_seed(8)
    assert torch.equal(in_worker, torch.rand(2, generator=reference))
    assert torch.equal(after, torch.rand(2, generator=reference))


def test_passing_torchs_default_generator_draws_from_the_jobs():
    # random_split's default argument is torch.default_generator, bound at import.
    def job():
        torch.manual_seed(6)
        return torch.randperm(8, generator=torch.default_generator)

    assert torch.equal(in_job(job), torch.randperm(8, generator=torch.Generator().manual_seed(6)))


class _Passthrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_draws_inside_a_dispatch_mode_follow_the_job():
    # Inside __torch_dispatch__ every dispatch key above Python is excluded: the
    # overloads without a generator must still draw from the job's state.
    def job():
        torch.manual_seed(12)
        with _Passthrough():
            return torch.cat([torch.rand(3), torch.randint(0, 9, (3,)).float(), torch.randn(2)])

    reference = torch.Generator().manual_seed(12)
    expected = torch.cat([
        torch.rand(3, generator=reference),
        torch.randint(0, 9, (3,), generator=reference).float(),
        torch.randn(2, generator=reference),
    ])
    assert torch.equal(in_job(job), expected)


def in_jobs(*fns, timeout: float = 120):
    """Run each `fn` at once in its own job thread; return their results in order."""
    results, errors = {}, {}

    def main(index, fn):
        rng.enter_job()
        try:
            results[index] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test's thread
            errors[index] = exc
        finally:
            rng.leave_job()

    threads = [threading.Thread(target=main, args=(i, fn)) for i, fn in enumerate(fns)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout)
        assert not thread.is_alive(), "a job did not finish"
    if errors:
        raise next(iter(errors.values()))
    return [results[i] for i in range(len(fns))]


def test_a_swapped_draw_waiting_for_memory_does_not_stall_another_jobs_draws():
    # Note [Swapped draws]: job A's draw inside a dispatch mode (a swapped draw, as
    # dropout on CUDA) waits for job B's free (rule f); B's own swapped draw goes on
    # meanwhile, then B frees. Were the swap lock held across A's wait, B would
    # block behind it, never free, and A would run out of memory at its bound.
    from wwrun.memory import allocator as wwalloc

    mib = 1 << 20
    holding = threading.Event()

    def job_a():
        wwalloc.mark_job_thread("A")
        try:
            assert holding.wait(60)
            torch.manual_seed(0)
            with _Passthrough():
                return torch.rand(30 * mib // 4)[:8].clone()  # 30 MiB: only once B frees
        finally:
            wwalloc.unmark_job_thread()

    def job_b():
        wwalloc.mark_job_thread("B")
        try:
            torch.manual_seed(1)
            held = torch.empty(30 * mib, dtype=torch.uint8)
            holding.set()
            deadline = time.monotonic() + 60
            while wwalloc.cpu_stats()["device"]["num_release_waits"] == 0:
                assert time.monotonic() < deadline, "job A never waited for memory"
                time.sleep(0.01)
            with _Passthrough():
                drawn = torch.rand(4)
            del held
            return drawn
        finally:
            wwalloc.unmark_job_thread()

    wwalloc.install_cpu_allocator(40 * mib)
    try:
        wwalloc.cpu_set_expected_releases(["B"], timeout_s=30.0)
        a, b = in_jobs(job_a, job_b)
    finally:
        wwalloc.uninstall_cpu_allocator()
    assert torch.equal(a, torch.rand(30 * mib // 4, generator=torch.Generator().manual_seed(0))[:8])
    assert torch.equal(b, torch.rand(4, generator=torch.Generator().manual_seed(1)))


@pytest.mark.parametrize("first_to_wait_resumes_first", [True, False])
def test_swapped_draws_waiting_for_memory_draw_as_alone_whichever_resumes_first(first_to_wait_resumes_first):
    # Note [Swapped draws]: job A's swapped draw waits for memory after it has drawn
    # (native_dropout: the mask, then the output), then job B's waits before it
    # draws (rand in a dispatch mode). Job C's frees decide who resumes first: C
    # first frees room for the smaller request only, and the rest once that job is
    # done. Each job must draw, then and after, what it draws alone, and torch's
    # generator must be left as it was.
    from wwrun.memory import allocator as wwalloc

    mib, floats_per_mib = 1 << 20, (1 << 20) // 4
    a_mib, b_mib = (16, 48) if first_to_wait_resumes_first else (48, 16)
    first_room_mib, spare_mib, capacity_mib = 24, 12, 160  # spare: below either request
    a_ready, go_a, go_b = threading.Event(), threading.Event(), threading.Event()
    done = {"A": threading.Event(), "B": threading.Event()}
    first, second = ("A", "B") if first_to_wait_resumes_first else ("B", "A")

    def draws_a():
        torch.manual_seed(1)
        x = torch.ones(a_mib * floats_per_mib)
        a_ready.set()
        assert go_a.wait(60)
        output, mask = torch.native_dropout(x, 0.5, True)
        # rand: the job's generator must have advanced past the mask.
        drawn = mask[:256].clone(), mask[-256:].clone(), torch.rand(4)
        done["A"].set()
        return drawn

    def draws_b():
        torch.manual_seed(2)
        assert go_b.wait(60)
        with _Passthrough():
            head = torch.rand(b_mib * floats_per_mib)[:8].clone()
        drawn = head, torch.rand(4)
        done["B"].set()
        return drawn

    def as_job(name, draws):
        def run():
            wwalloc.mark_job_thread(name)
            try:
                return draws()
            finally:
                wwalloc.unmark_job_thread()
        return run

    def waits_reach(count):
        deadline = time.monotonic() + 60
        while wwalloc.cpu_stats()["device"]["num_release_waits"] < count:
            assert time.monotonic() < deadline, "a job never waited for memory"
            time.sleep(0.005)

    def job_c():
        assert a_ready.wait(60)
        # Room for A's mask and `spare` more: A's next block and B's request wait.
        held_mib = capacity_mib - 2 * a_mib - spare_mib
        held = {"room": torch.empty(first_room_mib * mib, dtype=torch.uint8),
                "rest": torch.empty((held_mib - first_room_mib) * mib, dtype=torch.uint8)}
        try:
            waits = wwalloc.cpu_stats()["device"]["num_release_waits"]
            go_a.set()
            waits_reach(waits + 1)
            go_b.set()
            waits_reach(waits + 2)
            del held["room"]  # spare + room: the smaller request fits, the larger does not
            assert done[first].wait(60), f"job {first} did not resume"
            assert not done[second].is_set(), f"job {second} resumed first"
        finally:
            held.clear()  # a failure here must not leave the other jobs waiting

    go_a.set()
    go_b.set()
    solo_a, solo_b = in_job(draws_a), in_job(draws_b)
    for event in (a_ready, go_a, go_b, *done.values()):
        event.clear()
    process_state = torch.default_generator.get_state()
    wwalloc.install_cpu_allocator(capacity_mib * mib)
    try:
        wwalloc.cpu_set_expected_releases(["C"], timeout_s=30.0)
        a, b, _ = in_jobs(as_job("A", draws_a), as_job("B", draws_b), as_job("C", job_c))
    finally:
        wwalloc.uninstall_cpu_allocator()
    assert all(torch.equal(got, alone) for got, alone in zip(a, solo_a)), "job A drew other draws"
    assert all(torch.equal(got, alone) for got, alone in zip(b, solo_b)), "job B drew other draws"
    assert torch.equal(torch.default_generator.get_state(), process_state)


def checkpointed_training(seed: int, backward=lambda loss: loss.backward(), before_backward=lambda: None,
                          device: str = "cpu"):
    """A few steps of a block with dropout under torch.utils.checkpoint: the dropout
    masks of each forward and of its recompute, the losses and the gradients."""
    torch.manual_seed(seed)
    first, second = torch.nn.Linear(16, 16).to(device), torch.nn.Linear(16, 1).to(device)
    masks, losses = [], []

    def block(x):
        time.sleep(0.002)  # another job's recompute may restore its own RNG state now
        hidden = torch.nn.functional.dropout(first(x), 0.5)
        masks.append((hidden != 0).cpu())
        return second(hidden)

    for _ in range(4):
        x = torch.randn(32, 16, device=device)
        loss = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).pow(2).mean()
        before_backward()
        backward(loss)
        losses.append(loss.item())
    return masks, losses, [p.grad.cpu() for p in (*first.parameters(), *second.parameters())]


def assert_recomputed_as_forward_and_as_solo(results, solo) -> None:
    for (masks, losses, grads), (solo_masks, solo_losses, solo_grads) in zip(results, solo):
        for forward, recomputed in zip(masks[0::2], masks[1::2]):
            assert torch.equal(forward, recomputed)
        assert all(torch.equal(a, b) for a, b in zip(masks, solo_masks))
        assert losses == solo_losses
        assert all(torch.equal(a, b) for a, b in zip(grads, solo_grads))


def test_checkpoint_recompute_on_torchs_worker_thread_draws_forwards_masks():
    # On CUDA a job's backward runs on torch's shared autograd thread, which is
    # given the job's thread-local torch state (at::ThreadLocalState) but not its
    # Python thread-locals, and torch.utils.checkpoint recomputes there, restoring
    # the RNG state saved in forward. run_as_worker does what the engine does; two
    # jobs' backwards run there at once.
    solo = [checkpointed_training(seed) for seed in (1, 2)]
    together = threading.Barrier(2, timeout=60)

    def job(seed):
        return checkpointed_training(seed, lambda loss: rng._extension.run_as_worker(loss.backward),
                                     together.wait)

    assert_recomputed_as_forward_and_as_solo(in_jobs(lambda: job(1), lambda: job(2)), solo)


@pytest.mark.gpu
def test_checkpoint_recompute_on_the_cuda_autograd_thread_draws_forwards_masks():
    # The case itself: two jobs' backwards on torch's CUDA autograd thread, their
    # recomputed dropout (native_dropout, a swapped draw) beside each other's.
    solo = [checkpointed_training(seed, device="cuda") for seed in (1, 2)]
    together = threading.Barrier(2, timeout=60)

    def job(seed):
        return checkpointed_training(seed, before_backward=together.wait, device="cuda")

    assert_recomputed_as_forward_and_as_solo(in_jobs(lambda: job(1), lambda: job(2)), solo)


# -- Python's random and numpy ------------------------------------------------------------


def test_python_random_and_numpy_are_per_job():
    def job(seed):
        random.seed(seed)
        np.random.seed(seed)
        # numpy.random's functions and the RandomState they draw from, which
        # scikit-learn's check_random_state(None) reads directly: one stream.
        return ([random.random() for _ in range(3)], np.random.rand(3).tolist(), np.random.permutation(5).tolist(),
                np.random.mtrand._rand.rand(3).tolist())

    random.seed(0)
    np.random.seed(0)
    outside = random.getstate(), np.random.get_state()[1].copy()
    assert in_job(job, 3) == job(3)
    random.seed(0)
    np.random.seed(0)
    in_job(job, 4)
    assert random.getstate() == outside[0]
    assert (np.random.get_state()[1] == outside[1]).all()


def test_unseeded_python_random_differs_between_jobs():
    assert in_job(random.random) != in_job(random.random)


@pytest.mark.gpu
def test_cuda_draws_follow_the_job():
    def job():
        torch.cuda.manual_seed(3)
        return torch.rand(4, device="cuda").cpu(), torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).cpu()

    torch.cuda.manual_seed(3)
    expected = torch.rand(4, device="cuda").cpu(), torch.nn.functional.dropout(torch.ones(64, device="cuda"), 0.5).cpu()
    torch.cuda.manual_seed(77)
    got = in_job(job)
    assert all(torch.equal(a, b) for a, b in zip(got, expected))


def test_seeding_follows_the_job_when_dynamo_was_imported_first():
    """torch._dynamo wraps torch.manual_seed; a job's seed must still reach its own
    generator when dynamo was imported before wwrun (a fresh interpreter)."""
    code = (
        "import sys, torch, torch._dynamo\n"
        f"sys.path.insert(0, {str(Path(__file__).parent)!r})\n"
        "from test_rng import in_job\n"
        "def draw():\n    torch.manual_seed(5)\n    return torch.rand(3)\n"
        "print(torch.equal(in_job(draw), draw()))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == "True"
