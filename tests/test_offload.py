"""Activation offload: a job too large for the budget trains, to the same losses, with
what its forward saves in host memory; and stashing tensors in one host buffer.

On the CPU the budget stands for device memory (wwrun's CPU allocator enforces it)
and the offload pool lives outside it. The Triton kernels run in the interpreter
(tests/conftest.py): a pass's chunks are packed through them in one test
(offload.CPU_TRITON); jobs use the plain copy the CPU takes (the interpreter costs
~0.4 s per MiB), through the same chunks. The GPU test moves device tensors to pinned host memory and back.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
from pathlib import Path

import pytest
import torch

from wwrun import JobSpec, JobState, LaunchConfig, launch
from wwrun.memory import offload
from wwrun.memory.offload import HostPool, Offloader, stash

SCRIPT = str(Path(__file__).parent / "scripts" / "offload_job.py")
MiB = 2**20


def _tensors(device: str) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [
        torch.randn(3, 5, generator=g).to(device),
        torch.randint(-100, 100, (7,), generator=g, dtype=torch.int8).to(device),
        torch.randn(2, 2, 3, generator=g).to(torch.float16).to(device),
        torch.tensor([True, False, True], device=device),
        torch.empty(0, 4, device=device),
    ]


def test_restore_gives_back_equal_tensors():
    originals = _tensors("cpu")
    stashed = stash(originals)
    assert stashed.nbytes == sum(t.numel() * t.element_size() for t in originals)
    for _ in range(2):  # restoring twice gives two equal, independent copies
        restored = stashed.restore()
        assert len(restored) == len(originals)
        for before, after in zip(originals, restored):
            assert after.dtype == before.dtype and after.shape == before.shape
            assert torch.equal(after, before)
            assert after.data_ptr() != before.data_ptr() or before.numel() == 0


def test_stash_copies_so_later_writes_to_the_originals_do_not_leak_in():
    original = torch.arange(10, dtype=torch.float32)
    stashed = stash([original])
    original.fill_(-1)
    assert torch.equal(stashed.restore()[0], torch.arange(10, dtype=torch.float32))


def test_empty_and_bad_input():
    assert stash([]).restore() == []
    with pytest.raises(ValueError, match="not contiguous"):
        stash([torch.randn(4, 4).t()])


@pytest.mark.gpu
def test_device_tensors_leave_device_memory_and_come_back_bit_exact():
    originals = _tensors("cuda")
    expected = [t.cpu() for t in originals]
    stashed = stash(originals)
    assert stashed._buffer.is_pinned()
    before = torch.cuda.memory_allocated()
    del originals
    assert torch.cuda.memory_allocated() < before  # the device memory is free now
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # another stream restores: the event orders it
        restored = stashed.restore()
    torch.cuda.synchronize()
    for want, got in zip(expected, restored):
        assert got.device.type == "cuda" and torch.equal(got.cpu(), want)


# ---- the pool and one pass, directly ------------------------------------------------
def test_host_pool_reuses_buffers_and_keeps_its_limit():
    pool = HostPool(100, pinned=False)
    a, _ = pool.take(60)
    assert a.numel() == 60 and pool.held == 60
    assert pool.take(50) == (None, None)  # over the limit: the tensors would stay on the device
    pool.give(a)
    assert pool.take(60)[0].data_ptr() == a.data_ptr()  # the same size again: the same buffer
    pool.give(a)
    b, _ = pool.take(70)  # a new size evicts the free buffer to stay within the limit
    assert b is not None and pool.held == 70 and pool.peak == 70


def test_host_pool_counts_parked_pages_within_its_limit_and_keeps_its_buffers_when_it_refuses():
    """A job's pages parked at the limit take the offload's host budget (Note
    [Parking]): reserved before, settled at what was made, released after."""
    pool = HostPool(100, pinned=False)
    a, _ = pool.take(60)
    pool.give(a)
    assert not pool.reserve(101)  # not even without its free buffers: they stay
    assert pool.take(60)[0].data_ptr() == a.data_ptr()
    pool.give(a)
    assert pool.reserve(80) and pool.held == 80 and pool.peak == 60  # the free buffer went for it
    pool.settle(80, 70)  # 70 made
    assert pool.held == pool.peak == 70
    assert pool.take(40) == (None, None)  # activations and parked pages: one limit
    pool.release(70)
    assert pool.held == 0 and pool.reserve(100)


def test_pool_memory_counts_to_no_job_of_the_cpu_allocator():
    from wwrun.memory import allocator

    allocator.install_cpu_allocator(64 * MiB)
    try:
        allocator.mark_job_thread("j", None)
        before = allocator.cpu_job_stats("j")["allocated_bytes"]["current"]
        buffer, _ = HostPool(8 * MiB, pinned=False).take(4 * MiB)
        torch_side = torch.empty(MiB, dtype=torch.uint8)
        after = allocator.cpu_job_stats("j")["allocated_bytes"]["current"]
        assert after - before == MiB  # the tensor counts, the pool's 4 MiB do not
        del buffer, torch_side
    finally:
        allocator.unmark_job_thread()
        allocator.uninstall_cpu_allocator()


@pytest.mark.parametrize("triton", [True, False], ids=["triton", "plain"])
def test_a_pass_stashes_whole_chunks_and_backward_gets_the_same_tensors(monkeypatch, triton):
    monkeypatch.setattr(offload, "CPU_TRITON", triton)  # the kernels (interpreted), or a plain copy
    offloader = Offloader("always", 64 * MiB, "cpu")
    run = offloader.begin_pass("j", room=8 * offload.MIN_CHUNK_BYTES, device="cpu")
    x = torch.randn(64, 256)  # 64 KiB: one chunk each
    y = torch.randn(64, 256)
    kept = [run.keep(x), run.keep(x), run.keep(y), run.keep(x.t()), run.keep(x[:2])]
    assert kept[0] is kept[1]  # one storage saved twice is one entry
    assert kept[3] is not None and isinstance(kept[3], torch.Tensor)  # a view stays on the device
    assert isinstance(kept[4], torch.Tensor)
    run.boundary()
    assert not run.pending and offloader.report("j")["offloaded_bytes"] == 2 * 64 * 1024
    expected_x, expected_y = x.clone(), y.clone()
    del x, y
    got_y = kept[2].get()  # backward starts with the latest chunk: a stall, and a prefetch
    assert torch.equal(got_y, expected_y) and torch.equal(kept[0].get(), expected_x)
    report = offloader.report("j")
    assert report["fetched_bytes"] == report["offloaded_bytes"] and report["fetch_stall_s"] > 0


def test_a_parkable_pass_keeps_its_tensors_on_the_device_until_it_parks():
    offloader = Offloader("auto", 64 * MiB, "cpu")
    assert offloader.begin_pass("j", room=8 * offload.MIN_CHUNK_BYTES, device="cpu") is None  # auto: nothing to do
    run = offloader.begin_pass("j", room=8 * offload.MIN_CHUNK_BYTES, device="cpu", parkable=True)
    small = torch.randn(16)
    assert run.keep(small) is not small
    del small
    assert run.parkable_bytes() == 0  # too little to be worth a copy
    tensors = [torch.randn(64, 256) for _ in range(3)]  # 64 KiB each
    kept = [run.keep(t) for t in tensors]
    run.boundary()  # a parkable pass stashes nothing on its own
    assert offloader.report("j")["offloaded_bytes"] == 0 and kept[0].tensor is tensors[0]
    expected = [t.clone() for t in tensors]
    # Held elsewhere (here, by the test): copying them away would free nothing.
    assert run.parkable_bytes() == 0
    view = tensors[1].view(-1)
    del tensors
    assert run.parkable_bytes() == 2 * 64 * 1024 + 64  # not the one a view still holds
    del view
    assert run.parkable_bytes() == 3 * 64 * 1024 + 64
    assert run.park() == 3 * 64 * 1024 + 64 and not run.pending and run.parkable_bytes() == 0
    assert all(torch.equal(k.get(), e) for k, e in zip(kept, expected))
    report = offloader.report("j")
    assert report["parked_bytes"] == report["offloaded_bytes"] == report["fetched_bytes"] == 3 * 64 * 1024 + 64


def test_the_copy_rate_is_measured_once():
    offloader = Offloader("auto", 64 * MiB, "cpu")
    seconds = offloader.copy_seconds(100 << 20)
    rate = offloader.copy_rate
    assert rate > 0 and seconds == pytest.approx(2 * (100 << 20) / rate)
    assert offloader.copy_seconds(50 << 20) == pytest.approx(seconds / 2) and offloader.copy_rate == rate


def test_never_offloads_nothing():
    assert Offloader("never", MiB, "cpu").begin_pass("j", room=MiB, device="cpu") is None
    with pytest.raises(ValueError, match="offload mode"):
        Offloader("sometimes", MiB, "cpu")


# ---- jobs too large for the budget ---------------------------------------------------
def _reference(args: list[str]) -> str:
    """The script's output run as `python script args` would (in this process)."""
    out = io.StringIO()
    argv = sys.argv
    sys.argv = [SCRIPT, *args]
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_path(SCRIPT, run_name="__main__")
    finally:
        sys.argv = argv
    return out.getvalue()


def _run(tmp_path, jobs, **options):
    options.setdefault("quiet", True)
    options.setdefault("policy", "waterwave")
    return launch(LaunchConfig(jobs=jobs, log_dir=str(tmp_path / "logs"), **options))


def _output(job) -> str:
    return (Path(job.log_dir) / "stdout.log").read_text()


# Persistent: 12 blocks of 128x128 (~0.8 MiB) and their gradients. Each block saves
# two batch x 128 float tensors: at batch 1024 (0.5 MiB each) an iteration peaks at
# ~16 MiB, twice an 8 MiB budget. Smaller budgets are all allocator segments
# (2 MiB each) and slack: the job's own room is its budget less what stays less a
# segment's headroom.
LIMIT = 8 * MiB
BIG = ["--batch", "1024", "--depth", "12", "--steps", "2"]


def test_a_job_twice_too_large_trains_to_the_same_losses_under_the_limit(tmp_path):
    alone = _run(tmp_path, [JobSpec(name="big", script=SCRIPT, args=BIG)], offload="never")
    claim = alone.jobs[0].extra["peak_memory_bytes"]
    assert claim >= 1.9 * LIMIT  # about twice the limit
    never = _run(tmp_path, [JobSpec(name="big", script=SCRIPT, args=BIG)], memory_limit=LIMIT, offload="never")
    assert never.jobs[0].state == JobState.FAILED  # without offload it cannot run
    result = _run(tmp_path, [JobSpec(name="big", script=SCRIPT, args=BIG)], memory_limit=LIMIT)  # auto
    job = result.jobs[0]
    assert job.state == JobState.SUCCEEDED, job.error
    assert _output(job) == _output(alone.jobs[0]) == _reference(BIG)
    assert result.extra["peak_reserved_bytes"] <= LIMIT  # the pool is outside the budget
    assert job.extra["offloaded_bytes"] > LIMIT and job.extra["fetched_bytes"] == job.extra["offloaded_bytes"]
    assert job.extra["fetch_stall_s"] > 0
    assert 0 < result.extra["offload_host_peak_bytes"] <= result.extra["offload_limit_bytes"]
    # Host memory for no chunk (each holds a 0.5 MiB tensor at least): it fails as without offload.
    capped = _run(tmp_path, [JobSpec(name="big", script=SCRIPT, args=BIG)], memory_limit=LIMIT,
                  offload_limit=256 * 1024)
    assert capped.jobs[0].state == JobState.FAILED and capped.jobs[0].extra["offloaded_bytes"] == 0


def test_a_job_that_fits_offloads_nothing_once_measured(tmp_path):
    """Issue 23: auto offloads only where the job could not fit otherwise. This one
    (claim ~13.2 MiB, ~15.3 MiB in all, blocks of up to 1 MiB) fits 20 MiB with a
    page to spare: its profiled pass may stash on trial,
    but once it is measured no step stashes, and the losses are never's."""
    def run(mode, steps):
        args = [*BIG, "--steps", str(steps)]
        result = _run(tmp_path, [JobSpec(name="fits", script=SCRIPT, args=args)], memory_limit=20 * MiB,
                      offload=mode)
        assert result.jobs[0].state == JobState.SUCCEEDED, result.jobs[0].error
        assert result.extra["peak_reserved_bytes"] <= 20 * MiB
        return result.jobs[0]

    never, profiled, steady = run("never", 4), run("auto", 1), run("auto", 4)
    assert never.extra["offloaded_bytes"] == 0
    assert steady.extra["offloaded_bytes"] == profiled.extra["offloaded_bytes"]  # none after the first step
    assert steady.extra["fetched_bytes"] == steady.extra["offloaded_bytes"]
    assert _output(steady) == _output(never)


def test_a_first_step_s_optimizer_state_counts_when_auto_decides_the_job_fits(tmp_path):
    """Adam's state (twice the parameters, 8 MiB here) appears in the first step,
    after the profiled pass's peak. Weighed against it, the job seemed to fit 36 MiB
    without offload, stopped stashing and ran out in its second pass (it needs 38)."""
    args = ["--adam", "--width", "512", "--depth", "4", "--batch", "1024", "--steps", "3"]
    alone = _run(tmp_path, [JobSpec(name="adam", script=SCRIPT, args=args)], offload="never")
    assert alone.jobs[0].extra["peak_memory_bytes"] > 36 * MiB
    result = _run(tmp_path, [JobSpec(name="adam", script=SCRIPT, args=args)], memory_limit=36 * MiB)  # auto
    job = result.jobs[0]
    assert job.state == JobState.SUCCEEDED, job.error
    assert _output(job) == _output(alone.jobs[0])
    assert result.extra["peak_reserved_bytes"] <= 36 * MiB
    assert job.extra["fetched_bytes"] == job.extra["offloaded_bytes"] > 0


def test_the_unstashed_meter_counts_what_is_on_the_host_as_held():
    held, peak = [0], [0]

    def allocator_window(restart):
        window = (held[0], max(peak[0], held[0]))
        if restart:
            peak[0] = held[0]
        return window

    def take(nbytes):
        held[0] += nbytes
        peak[0] = max(peak[0], held[0])

    meter = offload.UnstashedMeter(allocator_window)
    take(8)  # forward saves 8 bytes
    take(-8)  # stashed: the device lets them go...
    meter.moved(8)  # ...and the host holds them
    take(4)  # forward saves 4 more
    assert meter(restart=True) == (4, 8)  # the allocator's figures, as before
    assert meter.peak == 12  # what the job would hold unstashed
    meter.moved(-8)  # backward fetches them back
    take(8)
    assert meter(restart=False) == (12, 12) and meter.peak == 12
    take(-12)
    assert meter.restart_peak() == 12 and meter.peak == 0  # the next iteration starts from nothing


@pytest.mark.parametrize("flags", [["--checkpoint"], ["--eval"], ["--shapes"], ["--thread"]])
def test_offload_with_checkpointing_no_grad_passes_new_shapes_and_side_threads(tmp_path, flags):
    args = [*BIG, "--steps", "3", *flags]
    result = _run(tmp_path, [JobSpec(name="big", script=SCRIPT, args=args)], memory_limit=LIMIT,
                  trace=str(tmp_path / "t.json"))
    job = result.jobs[0]
    assert job.state == JobState.SUCCEEDED, job.error
    assert _output(job) == _reference(args)
    assert result.extra["peak_reserved_bytes"] <= LIMIT
    assert job.extra["offloaded_bytes"] > 0 and job.extra["fetched_bytes"] == job.extra["offloaded_bytes"]
    events = json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    moved = {label: sum(e["args"]["bytes"] for e in events if e["name"] == label) for label in ("offload", "fetch")}
    assert moved == {"offload": job.extra["offloaded_bytes"], "fetch": job.extra["fetched_bytes"]}


def test_checkpointed_blocks_are_not_offloaded(tmp_path):
    """What torch.utils.checkpoint recomputes is never saved: less goes to the host."""
    figures = {}
    for flags in ([], ["--checkpoint"]):
        args = [*BIG, "--steps", "1", *flags]
        result = _run(tmp_path, [JobSpec(name="j", script=SCRIPT, args=args)], memory_limit=LIMIT, offload="always")
        assert result.jobs[0].state == JobState.SUCCEEDED, result.jobs[0].error
        figures[bool(flags)] = result.jobs[0].extra["offloaded_bytes"]
    assert 0 < figures[True] < figures[False]


def test_three_jobs_oversubscribing_the_budget_finish_with_offload_where_needed(tmp_path):
    """Claims summing to about 3x the limit (16 + 2 x 3.4 MiB): with auto every job
    finishes and only the job too large alone offloads; with never that job fails
    alone, the others finish, and no figure moves."""
    limit = LIMIT
    jobs = [JobSpec(name="big", script=SCRIPT, args=BIG),
            *(JobSpec(name=f"small{i}", script=SCRIPT, args=["--batch", "256", "--steps", "2"]) for i in (1, 2))]
    auto = _run(tmp_path, jobs, memory_limit=limit, offload="auto")
    never = _run(tmp_path, jobs, memory_limit=limit, offload="never")
    for job in auto.jobs:
        assert job.state == JobState.SUCCEEDED, job.error
        assert _output(job) == _reference(job.args)
        stashed = job.extra["offloaded_bytes"] - job.extra["parked_bytes"]  # parked: while waiting at a gate
        assert (stashed > 0) == (job.name == "big")
    assert auto.extra["peak_reserved_bytes"] <= limit
    for job in never.jobs:
        assert job.state == (JobState.FAILED if job.name == "big" else JobState.SUCCEEDED)
        assert job.extra.get("offloaded_bytes", 0) == job.extra.get("fetched_bytes", 0) == 0


@pytest.mark.gpu
def test_a_pass_on_cuda_frees_device_memory_and_backward_gets_it_back_on_another_stream():
    offloader = Offloader("always", 64 * MiB, "cuda")
    run = offloader.begin_pass("j", room=8 * offload.MIN_CHUNK_BYTES, device="cuda")
    tensors = [torch.randn(64, 256, device="cuda") for _ in range(4)]  # 64 KiB each: a chunk each
    expected = [t.cpu() for t in tensors]
    handles = [run.keep(t) for t in tensors]
    before = torch.cuda.memory_allocated()
    run.boundary()
    del tensors
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() < before  # the device memory is free once copied
    assert offloader.pool.pinned
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # backward's stream: events order the copies
        restored = [h.get() for h in reversed(handles)][::-1]
    torch.cuda.synchronize()
    for want, got in zip(expected, restored):
        assert got.is_cuda and torch.equal(got.cpu(), want)
    assert offloader.report("j")["fetched_bytes"] == offloader.report("j")["offloaded_bytes"] == 4 * 64 * 1024


# ---- the options ---------------------------------------------------------------------
def test_offload_options_from_the_command_line_and_a_recipe(tmp_path, capsys):
    from wwrun.cli import config_from_args, main, parse_args
    from wwrun.recipe import load_recipe

    config = config_from_args(parse_args(["--offload", "always", "--offload-limit", "1GiB", SCRIPT]))
    assert (config.offload, config.offload_limit) == ("always", 2**30)
    assert config_from_args(parse_args([SCRIPT])).offload == "auto"  # the default
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"defaults:\n  offload: never\n  offload_limit: 10%\njobs:\n  - script: {SCRIPT}\n")
    loaded = load_recipe(recipe)
    assert (loaded.offload, loaded.offload_limit) == ("never", 0.1)
    with pytest.raises(SystemExit) as exit_:
        main(["--offload", "sometimes", SCRIPT])
    assert exit_.value.code == 2 and "invalid choice: 'sometimes'" in capsys.readouterr().err
    recipe.write_text(f"defaults:\n  offload: sometimes\njobs:\n  - script: {SCRIPT}\n")
    assert main([str(recipe), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip()
    assert "offload" in err and "never, auto, always" in err and len(err.splitlines()) == 1


def test_offload_always_needs_the_engine(tmp_path):
    from wwrun.config import ConfigError, preflight

    def config(**options):
        return LaunchConfig(jobs=[JobSpec(name="j", script=SCRIPT)], log_dir=str(tmp_path), **options)

    with pytest.raises(ConfigError, match="offload: always needs the waterwave policy .* not sequential"):
        preflight(config(policy="sequential", offload="always"))
    preflight(config(policy="sequential"))  # auto, the default: off without the engine
