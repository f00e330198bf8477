"""The memory-flow allocator on CUDA: the CUDA translation units compile against
the installed torch's headers and the machine's CUDA headers (no GPU needed), and,
on a GPU, the allocator installed into PyTorch serves real training.

GPU tests run each scenario in a fresh interpreter, because the allocator must
be installed before CUDA is initialised and this test process may already have
done so. Run them alone with: PYTHONPATH=$PWD python -m pytest -q -m gpu tests/test_allocator_cuda.py
"""

import importlib.util
import json
import os
import subprocess
import sys
import sysconfig
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from wwrun.memory.allocator import source_dir

CUDA_HOME = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
REPO = Path(__file__).resolve().parents[1]


def cuda_headers() -> Path | None:
    """CUDA's headers: CUDA_HOME's, else those of the nvidia-cuda-runtime and
    nvidia-cuda-crt wheels (.ci/run installs them: CI has no toolkit)."""
    if (CUDA_HOME / "include" / "cuda_runtime_api.h").is_file():
        return CUDA_HOME / "include"
    spec = importlib.util.find_spec("nvidia")
    for root in spec.submodule_search_locations if spec else []:
        for header in sorted(Path(root).glob("*/include/cuda_runtime_api.h")):
            if (header.parent / "crt" / "host_defines.h").is_file():
                return header.parent
    return None


@pytest.mark.skipif(cuda_headers() is None, reason="no CUDA headers")
def test_cuda_sources_compile_against_installed_torch_and_cuda_headers(tmp_path):
    from torch.utils import cpp_extension

    includes = cpp_extension.include_paths() + [
        sysconfig.get_paths()["include"],
        str(cuda_headers()),
        str(source_dir()),
        str(source_dir().parent / "common"),
    ]
    # CPU wheels ship c10/cuda headers but not this one, generated at build time;
    # CUDA wheels have it with the same content.
    macros = Path(includes[0]) / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    if not macros.is_file():
        shim = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
        shim.parent.mkdir(parents=True)
        shim.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
        includes.append(str(tmp_path))
    # C++20, as torch.utils.cpp_extension builds extensions for torch 2.13; to
    # objects, as far as a machine without CUDA torch's libraries can go.
    # -Woverloaded-virtual: an overload of torch's interface left hidden.
    flags = ["-std=c++20", "-c", "-fPIC", "-Wall", "-Woverloaded-virtual", "-Werror"]
    flags += ["-DTORCH_EXTENSION_NAME=check"] + [f"-I{path}" for path in includes]

    def compile_one(name):
        cmd = ["g++", *flags, str(source_dir() / name), "-o", str(tmp_path / f"{name}.o")]
        return name, subprocess.run(cmd, capture_output=True, text=True)

    units = ["allocator_core.cpp", "cuda_backend.cpp", "torch_cuda_allocator.cpp", "cuda_bindings.cpp"]
    with ThreadPoolExecutor(max_workers=2) as pool:
        for name, result in pool.map(compile_one, units):
            assert result.returncode == 0, f"{name}:\n{result.stderr[-4000:]}"


def test_install_and_job_functions_give_clear_errors():
    import torch

    import wwrun.memory.allocator as wa

    with pytest.raises(ValueError, match="CUDA device"):
        wa.install("cpu")
    with pytest.raises(RuntimeError, match="not installed"):
        wa.register_stream(0, "A")
    with pytest.raises(RuntimeError, match="not installed"):
        wa.stats()
    if torch.version.cuda is None:  # never install into this test process on a GPU build
        with pytest.raises(RuntimeError, match="no CUDA support"):
            wa.install()
    assert not wa.is_installed()


class FakeCudaModule:
    """The CUDA extension's stream and job calls, for the Python logic around them."""

    def __init__(self):
        self.made = 0
        self.bound = {}

    def create_job_stream(self, device):
        self.made += 1
        return 0x1000 * self.made

    def register_stream(self, device, handle, job, limit):
        self.bound[handle] = job

    def unregister_job(self, device, job):
        self.bound = {h: j for h, j in self.bound.items() if j != job}
        return True

    def take_dirty_blocks(self, device, job, handle):
        return [], []


@pytest.fixture
def fake_cuda(monkeypatch):
    import torch

    import wwrun.memory.allocator as wa

    module = FakeCudaModule()
    monkeypatch.setattr(wa, "_cuda", lambda: module)
    monkeypatch.setattr(wa, "_scrub_stream", lambda index: type("S", (), {"cuda_stream": 1})())
    monkeypatch.setattr(wa, "_idle_job_streams", {})
    monkeypatch.setattr(wa, "_made_job_streams", set())
    monkeypatch.setattr(wa, "_job_stream_of", {})
    monkeypatch.setattr(
        torch.cuda, "ExternalStream",
        lambda handle, device: type("X", (), {"cuda_stream": handle, "device": device})(),
    )
    return module


def test_every_live_job_gets_its_own_stream_and_an_ended_job_s_goes_to_the_next(fake_cuda):
    """torch.cuda.Stream() would give a sweep's 33rd job the 1st job's stream."""
    import wwrun.memory.allocator as wa

    streams = [wa.new_job_stream(0) for _ in range(40)]
    for number, stream in enumerate(streams):
        wa.register_stream(stream, f"job{number}")
    assert len({s.cuda_stream for s in streams}) == 40 == fake_cuda.made
    wa.unregister_job("job7", device=0)
    again = wa.new_job_stream(0)
    assert again.cuda_stream == streams[7].cuda_stream and fake_cuda.made == 40
    assert wa.new_job_stream(0).cuda_stream not in {s.cuda_stream for s in streams}


class FakeDevice:
    """A CUDA device for measure_headroom on the CPU: each thread's first warm-up
    takes 20 MiB outside the allocator (its handles), the very first 100 MiB more
    (the context, kernels), and, inside the allocator, 66 MiB of workspaces for
    its stream (a fake per-stream fixed cost) in a segment of its own."""

    MiB = 1 << 20

    def __init__(self):
        import threading

        self.free, self.allocated, self.reserved = 8000 * self.MiB, 0, 1000 * self.MiB
        # The threads themselves, kept: an ended thread's ident is reused by the next.
        self.warmed, self.lock = [], threading.Lock()

    def warm_up(self, index):
        import threading

        with self.lock:
            current = threading.current_thread()
            if any(thread is current for thread in self.warmed):
                return False
            self.free -= (20 + (0 if self.warmed else 100) + 66) * self.MiB
            self.reserved += 66 * self.MiB
            self.allocated += 66 * self.MiB
            self.warmed.append(current)
        return False

    def clear_workspaces(self):
        self.allocated = 0  # back to the allocator's cache: reserved stays


def test_device_capacity_measures_what_goes_outside_the_allocator_and_per_stream(monkeypatch):
    import torch

    import wwrun.memory.allocator as wa

    MiB, device = FakeDevice.MiB, FakeDevice()
    monkeypatch.setattr(wa, "_headrooms", {})
    monkeypatch.setattr(wa, "_warm_up_libraries", device.warm_up)
    monkeypatch.setattr(wa, "_allocator_bytes", lambda index: (device.allocated, device.reserved))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (device.free, 8000 * MiB))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda index=None: None)
    monkeypatch.setattr(torch._C, "_cuda_clearCublasWorkspaces", device.clear_workspaces, raising=False)
    assert wa.stream_fixed_cost(0) == 0  # nothing measured yet
    capacity = wa.device_capacity(0, jobs=3)
    measured = wa.measure_headroom(0)
    assert measured == wa.Headroom(process_bytes=120 * MiB, per_thread_bytes=20 * MiB,
                                   threads=wa.HEADROOM_PROBE_THREADS, stream_fixed_bytes=66 * MiB,
                                   triton=False)
    assert wa.stream_fixed_cost(0) == 66 * MiB and device.allocated == 0
    held_and_free = device.free + device.reserved
    assert capacity == held_and_free - wa.CAPACITY_HEADROOM_BYTES - 3 * 20 * MiB
    assert wa.device_capacity(0, headroom=0) == held_and_free  # measured once: no second warm-up
    with pytest.raises(ValueError, match="headroom"):
        wa.device_capacity(0, headroom=-1)
    with pytest.raises(ValueError, match="threads"):
        wa.measure_headroom(0, threads=0)


def run_fresh(body: str) -> dict:
    """Runs `body` in a new interpreter after installing the allocator (there CUDA
    is not yet initialised, so it installs or the test fails: it never measures
    PyTorch's allocator instead); the script prints one JSON object as its last
    line."""
    script = ("import json, threading, torch\nimport wwrun.memory.allocator as wa\nwa.install()\n"
              "assert wa.in_use('cuda') == 'waterwave', wa.in_use('cuda')\n")
    script += textwrap.dedent(body)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
def test_training_step_and_torch_memory_functions_under_the_allocator():
    out = run_fresh("""
        model = torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)).cuda()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        x, y = torch.randn(64, 512, device="cuda"), torch.randint(0, 10, (64,), device="cuda")
        losses = []
        for _ in range(5):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(); loss.backward(); opt.step(); losses.append(loss.item())
        side = torch.cuda.Stream()
        t = torch.empty(1 << 20, device="cuda"); t.record_stream(side); del t
        allocated = torch.cuda.memory_allocated()
        peak = torch.cuda.max_memory_allocated()
        stats = torch.cuda.memory_stats()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.empty_cache()
        print(json.dumps({"losses": losses, "allocated": allocated, "peak": peak,
                          "reserved": torch.cuda.memory_reserved(),
                          "stats_allocated": stats["allocated_bytes.all.current"],
                          "mine": wa.stats()["device"]["allocated_bytes"]["current"]}))
    """)
    assert out["losses"][-1] < out["losses"][0]
    assert 0 < out["allocated"] <= out["peak"] and out["allocated"] == out["stats_allocated"]
    assert out["reserved"] >= out["mine"] > 0


@pytest.mark.gpu
def test_a_job_s_two_streams_reuse_each_other_s_memory_with_rule_c():
    """Blocks pass between the streams of one job behind a device-side wait (a
    script's own streams); between jobs only pages move (Note [Layouts])."""
    out = run_fresh("""
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        wa.register_stream(s1, "A"); wa.register_stream(s2, "A")
        with torch.cuda.stream(s1):
            x = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
            torch.cuda._sleep(200_000_000)  # keeps s1 busy: the free's event stays pending
            ptr = x.data_ptr(); del x
        with torch.cuda.stream(s2):
            y = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        print(json.dumps({"same": y.data_ptr() == ptr, "rules": wa.stats()["rules"]}))
    """)
    assert out["same"] and out["rules"]["c"] >= 1


@pytest.mark.gpu
def test_cudnn_benchmark_mode_works():
    out = run_fresh("""
        torch.backends.cudnn.benchmark = True
        conv = torch.nn.Conv2d(3, 16, 3).cuda()
        out = conv(torch.randn(8, 3, 64, 64, device="cuda")); out.sum().backward()
        print(json.dumps({"shape": list(out.shape)}))
    """)
    assert out["shape"] == [8, 16, 62, 62]


@pytest.mark.gpu
def test_memory_allocated_reports_each_job_s_own_figures():
    out = run_fresh("""
        results = {}
        def job(name, nbytes):
            stream = torch.cuda.Stream()
            wa.register_stream(stream, name)
            with torch.cuda.stream(stream):
                t = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
                results[name] = torch.cuda.memory_allocated()
                barrier.wait()
                barrier.wait()
        barrier = threading.Barrier(3)
        threads = [threading.Thread(target=job, args=a) for a in (("A", 3 << 20), ("B", 5 << 20))]
        for t in threads: t.start()
        barrier.wait(); results["main"] = torch.cuda.memory_allocated(); barrier.wait()
        for t in threads: t.join()
        print(json.dumps(results))
    """)
    assert out == {"A": 3 << 20, "B": 5 << 20, "main": 8 << 20}


def limit_to_room_for(nbytes):
    """Code for run_fresh: the allocator's limit set to what it holds now and
    `nbytes` more (and a page), so that a second such request must take the
    first one's pages."""
    return f"""
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + {nbytes} + (2 << 20)) / total)
    """


@pytest.mark.gpu
def test_a_job_never_reads_memory_another_job_freed():
    """At the limit A's freed pages move to B (rule e, once their event completed),
    zeroed on B's stream."""
    out = run_fresh(limit_to_room_for(64 << 20) + """
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        wa.register_stream(s1, "A"); wa.register_stream(s2, "B")
        n = 16 << 20
        with torch.cuda.stream(s1):
            secret = torch.full((n,), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
            del secret
        with torch.cuda.stream(s2):
            seen = torch.empty(n, dtype=torch.int32, device="cuda")
            zeros = bool((seen.cpu() == 0).all())  # on the host: the limit leaves B no 16 MiB for a mask
        stats = wa.stats()
        print(json.dumps({"zeros": zeros, "moves": stats["device"]["num_page_moves"],
                          "scrubbed": wa.job_stats("B")["scrubbed_bytes"]}))
    """)
    assert out["zeros"] and out["moves"] >= 31 and out["scrubbed"] >= 62 << 20


@pytest.mark.gpu
def test_a_parked_job_keeps_its_bytes_in_host_memory_at_its_addresses_while_its_pages_serve_another():
    """Note [Parking] on CUDA: A's live block moves to pinned host memory mapped at
    its address, once A's kernel still writing it has finished; A's kernels still
    read and write it there, its pages go to B at the limit, zeroed; once B frees
    them A's bytes come back into device pages."""
    out = run_fresh(limit_to_room_for(66 << 20) + """
        if not wa.can_park("cuda"):
            print(json.dumps({"can_park": False})); raise SystemExit
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        wa.register_stream(s1, "A"); wa.register_stream(s2, "B")
        n = 16 << 20  # int32: 64 MiB
        with torch.cuda.stream(s1):
            kept = torch.full((n,), 41, dtype=torch.int32, device="cuda")
            torch.cuda._sleep(200_000_000)  # A's stream is still busy when it parks ...
            kept.add_(1)  # ... and this write must land before the copy
        parked = wa.park_job("A", "cuda")
        stats_a = wa.job_stats("A")
        with torch.cuda.stream(s1):
            kept[:1] = 7  # a kernel writes the host copy
        with torch.cuda.stream(s2):
            seen = torch.empty(n, dtype=torch.int32, device="cuda")
            zeros = bool((seen.cpu() == 0).all())  # on the host: the limit leaves B no 16 MiB for a mask
            early = wa.unpark_job("A", "cuda")  # B holds the pages
            del seen
        torch.cuda.synchronize()
        back = wa.unpark_job("A", "cuda")
        with torch.cuda.stream(s1):
            values = kept.cpu()
        print(json.dumps({"can_park": True, "parked": parked, "held": stats_a["held_bytes"]["current"],
                          "parked_bytes": stats_a["parked_bytes"]["current"], "zeros": zeros,
                          "early": early, "back": back, "first": int(values[0]),
                          "rest": bool((values[1:] == 42).all()),
                          "after": wa.job_stats("A")["parked_bytes"]["current"]}))
    """)
    if not out["can_park"]:
        pytest.skip("this GPU's driver makes no pinned host memory for the virtual memory API")
    assert out["parked"] == 64 << 20 and out["parked_bytes"] == 64 << 20 and out["held"] == 0
    assert out["zeros"] and not out["early"] and out["back"] and out["after"] == 0
    assert out["first"] == 7 and out["rest"]


@pytest.mark.gpu
def test_an_ended_job_s_memory_is_scrubbed_in_one_batch_and_reused_without_memset():
    """Note [Batched scrub] on CUDA: job A's freed secret is zeroed by one Triton
    launch on the scrub stream when A ends; at the limit B then takes its pages
    without a memset, once the host has seen the scrub (held behind A's busy
    stream) complete (rule e)."""
    out = run_fresh(limit_to_room_for(64 << 20) + """
        from triton_kernels import zero_ranges_
        warm = torch.ones(1024, device="cuda")  # compile the kernel before timing matters
        zero_ranges_([warm.data_ptr()], [4096], "cuda"); torch.cuda.synchronize()
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        wa.register_stream(s1, "A"); wa.register_stream(s2, "B")
        n = 16 << 20  # int32: 64 MiB, a segment of its own
        with torch.cuda.stream(s1):
            secret = torch.full((n,), 0x5A5A5A5A, dtype=torch.int32, device="cuda")
            torch.cuda._sleep(1_000_000_000)  # A is still busy with the block when it is freed
            ptr = secret.data_ptr(); del secret
        wa.unregister_job("A")  # the launcher calls it from A's thread; the host does not wait
        with torch.cuda.stream(s2):
            seen = torch.empty(n, dtype=torch.int32, device="cuda")
            zeros = bool((seen.cpu() == 0).all())  # on the host: the limit leaves B no 16 MiB for a mask
        stats = wa.stats()
        print(json.dumps({"zeros": zeros, "moves": stats["device"]["num_page_moves"],
                          "memset": wa.job_stats("B")["scrubbed_bytes"],
                          "batched": stats["device"]["batch_scrubbed_bytes"],
                          "batches": stats["device"]["scrub_batches"], "rules": stats["rules"]}))
    """)
    assert out["zeros"] and out["moves"] >= 31
    assert out["memset"] == 0 and out["batched"] >= 64 << 20 and out["batches"] == 1
    assert out["rules"]["e"] >= 1


@pytest.mark.gpu
def test_a_job_over_its_limit_alone_gets_out_of_memory():
    out = run_fresh("""
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        wa.register_stream(s1, "A", memory_limit=1 << 20); wa.register_stream(s2, "B")
        with torch.cuda.stream(s1):
            try:
                torch.empty(2 << 20, dtype=torch.uint8, device="cuda"); message = ""
            except torch.OutOfMemoryError as error:
                message = str(error)
        with torch.cuda.stream(s2):
            ok = torch.ones(4 << 20, device="cuda").sum().item() == 4 << 20
        print(json.dumps({"message": message, "other_ok": ok}))
    """)
    assert "job 'A'" in out["message"] and "limit" in out["message"] and out["other_ok"]


@pytest.mark.gpu
def test_rule_f_a_job_waits_for_another_s_frees_instead_of_running_out_of_memory():
    """B asks for more than the run's limit has left while A, about to free, holds
    most of it: B waits (rule f) and gets A's memory, instead of
    torch.OutOfMemoryError. B allocates from a thread marked as its job's (as the
    launcher marks a job's thread): rule f never waits in an unmarked one. Under a
    limit, as every run on a GPU is (the device's capacity at most): without one, a
    request the device cannot give asks the driver page by page until it refuses
    (on an H200, A's free landed meanwhile and B got its pages without a wait)."""
    out = run_fresh(limit_to_room_for(1 << 30) + """
        import time
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        wa.register_stream(s1, "A"); wa.register_stream(s2, "B")
        size = 1 << 30
        with torch.cuda.stream(s1):
            held = torch.empty(size, dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        wa.set_expected_releases(["A"], timeout_s=60.0)

        def release():
            global held
            time.sleep(0.5)
            with torch.cuda.stream(s1):
                del held

        threading.Thread(target=release).start()
        wa.mark_job_thread("B")
        start = time.monotonic()
        with torch.cuda.stream(s2):
            got = torch.empty(size, dtype=torch.uint8, device="cuda")
        waited = time.monotonic() - start
        wa.unmark_job_thread()
        print(json.dumps({"waited": waited, "rules": wa.stats()["rules"]}))
    """)
    assert out["rules"]["f"] >= 1 and out["waited"] >= 0.3


@pytest.mark.gpu
def test_cudnn_benchmark_beside_a_job_holding_half_the_device():
    out = run_fresh("""
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        wa.register_stream(s1, "A"); wa.register_stream(s2, "B")
        free, _ = torch.cuda.mem_get_info()
        with torch.cuda.stream(s1):
            half = torch.full((int(free * 0.5) // 4,), 7, dtype=torch.int32, device="cuda")
        torch.backends.cudnn.benchmark = True
        with torch.cuda.stream(s2):
            conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
            x = torch.randn(32, 64, 64, 64, device="cuda", requires_grad=True)
            for _ in range(3):
                conv(x).square().mean().backward()
        torch.cuda.synchronize()
        print(json.dumps({"intact": bool((half == 7).all()), "grad": x.grad is not None}))
    """)
    assert out == {"intact": True, "grad": True}


@pytest.mark.gpu
def test_job_streams_are_dedicated_and_a_live_job_s_stream_is_refused():
    """torch's pool hands out its 32 streams again; new_job_stream never hands out
    a live job's, and register_stream refuses a stream a live job holds."""
    out = run_fresh("""
        pool = [torch.cuda.Stream() for _ in range(33)]
        wa.register_stream(pool[0], "first")
        try:
            wa.register_stream(pool[32], "thirty-third"); refused = pool[32].cuda_stream != pool[0].cuda_stream
        except ValueError:
            refused = True
        streams = [wa.new_job_stream() for _ in range(40)]
        for number, stream in enumerate(streams):
            wa.register_stream(stream, f"job{number}")
        with torch.cuda.stream(streams[5]):
            t = torch.ones(1 << 20, device="cuda"); total = t.sum().item(); del t
        held = wa.job_stats("job5")["allocated_bytes"]["peak"]
        wa.unregister_job("job5")
        reused = wa.new_job_stream().cuda_stream == streams[5].cuda_stream
        print(json.dumps({"refused": refused, "distinct": len({s.cuda_stream for s in streams}),
                          "total": total, "held": held, "reused": reused}))
    """)
    assert out["refused"] and out["distinct"] == 40 and out["reused"]
    assert out["total"] == float(1 << 20) and out["held"] >= 4 << 20


@pytest.mark.gpu
def test_a_job_s_side_stream_counts_to_the_job():
    out = run_fresh("""
        def job():
            stream = wa.new_job_stream(); wa.register_stream(stream, "A"); wa.mark_job_thread("A")
            side = torch.cuda.Stream()
            with torch.cuda.stream(side):
                t = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
                results["mine"] = wa.job_stats("A")["allocated_bytes"]["current"]
                results["seen"] = torch.cuda.memory_allocated()
        results = {}
        thread = threading.Thread(target=job); thread.start(); thread.join()
        results["default"] = wa.job_stats("default")["allocated_bytes"]["peak"]
        print(json.dumps(results))
    """)
    assert out == {"mine": 3 << 20, "seen": 3 << 20, "default": 0}


@pytest.mark.gpu
def test_cudnn_benchmark_stays_within_the_job_s_limit():
    """cacheInfo is capped at the job's headroom: a limited job's benchmark mode
    tries no workspace beyond its limit, so it never fails for it."""
    out = run_fresh("""
        torch.backends.cudnn.benchmark = True
        stream = wa.new_job_stream(); wa.register_stream(stream, "B", memory_limit=512 << 20)
        with torch.cuda.stream(stream):
            conv = torch.nn.Conv2d(64, 64, 3, padding=1).cuda()
            x = torch.randn(16, 64, 64, 64, device="cuda", requires_grad=True)
            for _ in range(3):
                conv(x).square().mean().backward()
            torch.cuda.synchronize()
        stats = wa.job_stats("B")
        print(json.dumps({"peak": stats["allocated_bytes"]["peak"], "ooms": stats["num_ooms"]}))
    """)
    assert out["ooms"] == 0 and out["peak"] <= 512 << 20


@pytest.mark.gpu
def test_a_job_s_empty_cache_leaves_other_jobs_cache():
    out = run_fresh("""
        s1, s2 = wa.new_job_stream(), wa.new_job_stream()
        wa.register_stream(s1, "A"); wa.register_stream(s2, "B")
        with torch.cuda.stream(s1):
            a = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        with torch.cuda.stream(s2):
            b = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")  # a segment each
        with torch.cuda.stream(s1):
            del a
        with torch.cuda.stream(s2):
            del b
            before = torch.cuda.memory_reserved()
            torch.cuda.empty_cache()
            after = torch.cuda.memory_reserved()
        torch.cuda.empty_cache()  # the launcher's thread: every idle segment
        print(json.dumps({"before": before, "after": after, "end": torch.cuda.memory_reserved()}))
    """)
    assert out["before"] - out["after"] == 64 << 20 and out["end"] == 0


@pytest.mark.gpu
def test_memory_snapshot_shows_real_segments():
    """torch.cuda.memory_snapshot() and torch.cuda.memory._snapshot() (the memory
    visualizer's input) read our segments and blocks."""
    out = run_fresh("""
        side = torch.cuda.Stream()
        keep = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
        small = torch.empty(1000, dtype=torch.uint8, device="cuda")
        pending = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        pending.record_stream(side)
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
        del pending
        segments = torch.cuda.memory_snapshot()
        full = torch.cuda.memory._snapshot()
        states = sorted({b["state"] for s in segments for b in s["blocks"]})
        ok = all(sum(b["size"] for b in s["blocks"]) == s["total_size"] and
                 s["blocks"][0]["address"] == s["address"] for s in segments)
        print(json.dumps({"n": len(segments), "ok": ok, "states": states,
                          "types": sorted({s["segment_type"] for s in segments}),
                          "allocated": sum(s["allocated_size"] for s in segments),
                          "keys": sorted(full), "history": torch._C._cuda_isHistoryEnabled(),
                          "reserved": torch.cuda.memory_reserved(),
                          "total": sum(s["total_size"] for s in segments)}))
    """)
    assert out["n"] >= 2 and out["ok"] and out["types"] == ["large", "small"]
    assert "active_allocated" in out["states"] and "active_pending_free" in out["states"]
    assert out["allocated"] == (3 << 20) + 1024 and out["total"] == out["reserved"]
    assert {"segments", "device_traces"} <= set(out["keys"]) and out["history"] is False


@pytest.mark.gpu
def test_tensors_alive_at_exit_free_quietly():
    """A DataPtr deleter never throws; at exit, with the CUDA runtime unloading,
    a free is a no-op, not an error."""
    script = textwrap.dedent("""
        import torch, wwrun.memory.allocator as wa
        wa.install()
        kept = [torch.ones(1 << 20, device="cuda") for _ in range(4)]
        side = torch.cuda.Stream()
        kept[0].record_stream(side)
    """)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            env=env, timeout=600)
    assert result.returncode == 0 and "leaking" not in result.stderr, result.stderr[-2000:]


@pytest.mark.gpu
def test_device_capacity_after_warm_up():
    out = run_fresh("""
        capacity = wa.device_capacity()
        free, total = torch.cuda.mem_get_info()
        print(json.dumps({"capacity": capacity, "free": free, "total": total,
                          "reserved": torch.cuda.memory_reserved(),
                          "headroom": wa.capacity_headroom(wa.measure_headroom())}))
    """)
    assert 0 < out["capacity"] <= out["total"] - out["headroom"]
    assert out["capacity"] == out["free"] + out["reserved"] - out["headroom"]


# -- fixed costs, headroom, side threads, CUDA graphs (issue 22: 5, 6, 7, 9) ----------


@pytest.mark.gpu
def test_cublas_workspaces_are_per_stream_fixed_costs_not_the_job_s():
    """torch keeps a cuBLAS workspace per (thread's handle, stream) for good: a job's
    stream gets two (its thread's, the autograd thread's). Made before the stream is
    the job's, they count to no job; the budget plans for them instead."""
    out = run_fresh("""
        from wwrun.memory import Memory
        memory = Memory("cuda", None, "concurrent", jobs_at_once=2)  # no engine: nothing else held
        def job():
            with memory.session("A"):
                model = torch.nn.Linear(256, 256).cuda()
                x = torch.randn(64, 256, device="cuda")
                model(x).sum().backward()
                del model, x
                torch.cuda.current_stream().synchronize()
                results["job"] = wa.job_stats("A")["allocated_bytes"]["current"]
        results = {}
        thread = threading.Thread(target=job); thread.start(); thread.join(300)
        planned = Memory("cuda", None, "waterwave", jobs_at_once=2)
        results.update(fixed=wa.stream_fixed_cost(), limit=planned.limit, budget=planned.engine.capacity,
                       default=wa.job_stats("default")["allocated_bytes"]["current"],
                       report=memory.run_report()["stream_fixed_bytes"])
        print(json.dumps(results))
    """)
    assert out["job"] == 0
    assert out["fixed"] >= 1 << 20 and out["default"] >= out["fixed"]
    assert out["budget"] == out["limit"] - 2 * out["fixed"] == out["limit"] - out["report"]


@pytest.mark.gpu
def test_headroom_is_measured_and_a_job_at_the_limit_gets_out_of_memory_not_a_cuda_error():
    """measure_headroom sees memory outside the allocator (threads' handles, kernels);
    with the capacity it sizes, a job that fills the run's limit gets
    torch.OutOfMemoryError, and a new thread's first cuBLAS, cuDNN and Triton use
    (memory outside the allocator) still works beside it."""
    out = run_fresh("""
        from triton_kernels import zero_ranges_
        measured = wa.measure_headroom()
        capacity = wa.device_capacity(jobs=2)
        torch.cuda.set_per_process_memory_fraction(capacity / torch.cuda.mem_get_info()[1])
        stream = wa.new_job_stream(); wa.register_stream(stream, "A")
        held, oom = [], ""
        with torch.cuda.stream(stream):
            try:
                while True:
                    held.append(torch.empty(256 << 20, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError as error:
                oom = str(error)
            del held[-2:]  # back to the allocator's cache: room for B's tensors, not the driver's
        results = {}
        def other():  # a new thread: new cuBLAS and cuDNN handles, outside the allocator
            try:
                s = wa.new_job_stream(); wa.register_stream(s, "B")
                with torch.cuda.stream(s):
                    x, z = torch.ones(64, 64, device="cuda"), torch.ones(1024, device="cuda")
                    conv = torch.nn.functional.conv2d(torch.ones(1, 3, 16, 16, device="cuda"),
                                                      torch.ones(4, 3, 3, 3, device="cuda"))
                    zero_ranges_([z.data_ptr()], [4096], "cuda")
                    results["ok"] = ((x @ x).sum().item() == 64 * 64 * 64 and conv.sum().item() == 14 * 14 * 4 * 27
                                     and z.sum().item() == 0)
            except Exception as error:
                results["ok"], results["error"] = False, repr(error)
        thread = threading.Thread(target=other); thread.start(); thread.join(300)
        print(json.dumps({"process": measured.process_bytes, "per_thread": measured.per_thread_bytes,
                          "triton": measured.triton, "oom": oom, "held": len(held), **results}))
    """)
    assert out["process"] > 0 and out["per_thread"] >= 0 and out["triton"]
    assert "job 'A'" in out["oom"] and out["held"] > 0 and out["ok"], out.get("error")


@pytest.mark.gpu
def test_a_thread_the_job_starts_is_ordered_with_the_job_s_stream(tmp_path):
    """Job streams do not wait for the legacy default stream: a side thread's fill,
    queued behind a long sleep, must be seen by the job's thread right after join."""
    script = tmp_path / "side_thread.py"
    script.write_text(textwrap.dedent("""
        import json, sys, threading, torch
        t = torch.zeros(1 << 20, device="cuda")
        torch.cuda.synchronize()
        def side():
            torch.cuda._sleep(1_000_000_000)  # about half a second of GPU time
            t.fill_(1.0)
        worker = threading.Thread(target=side); worker.start(); worker.join()
        seen = t.sum().item()
        with open(sys.argv[1], "w") as out:
            json.dump({"seen": seen, "n": t.numel()}, out)
    """))
    result_file, report = tmp_path / "seen.json", tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--device", "cuda", "--quiet", "--log-dir", str(tmp_path / "logs"),
         "--report", str(report), str(script), str(result_file)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    assert json.loads(report.read_text())["run"]["allocator"] == "waterwave"
    out = json.loads(result_file.read_text())
    assert out["seen"] == out["n"]


@pytest.mark.gpu
def test_cuda_graphs_fail_at_once_in_the_job_with_wwrun_s_message():
    """Note [No private pools]: torch.cuda.graph, torch.cuda.MemPool and
    torch.compile(mode="reduce-overhead") are refused before any capture begins,
    with wwrun's message and its ways out; the job's stream still works after."""
    out = run_fresh("""
        results = {}
        def job():
            stream = wa.new_job_stream(); wa.register_stream(stream, "A"); wa.mark_job_thread("A")
            torch.cuda.set_stream(stream)
            x = torch.ones(1024, device="cuda")
            try:
                with torch.cuda.graph(torch.cuda.CUDAGraph()):
                    y = x * 2
                results["graph"] = "captured"
            except RuntimeError as error:
                results["graph"] = str(error)
            torch.cuda.set_stream(stream)  # torch.cuda.graph left its capture stream current
            try:
                torch.cuda.MemPool(); results["pool"] = "made"
            except RuntimeError as error:
                results["pool"] = str(error)
            try:
                f = torch.compile(lambda t: (t * 3).sum(), mode="reduce-overhead")
                results["compiled"] = [f(x).item() for _ in range(3)]
            except Exception as error:
                results["compiled"] = str(error)
            results["after"] = (x + 1).sum().item()
        thread = threading.Thread(target=job); thread.start(); thread.join(600)
        print(json.dumps(results))
    """)
    for key in ("graph", "pool"):
        assert "wwrun: CUDA graphs" in out[key] and "job 'A'" in out[key] and "cudaMallocAsync" in out[key]
    compiled = out["compiled"]
    assert compiled == [3 * 1024.0] * 3 or "wwrun: CUDA graphs" in compiled, compiled
    assert out["after"] == 2 * 1024.0
