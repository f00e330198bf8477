"""Third-party globals seen per job: tqdm's bars, rich's console, Hydra's singletons,
accelerate's state and torch.compile's flag."""

from __future__ import annotations

import fcntl
import os
import pty
import select
import struct
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).parent / "scripts"


def _run_on_a_terminal(args: list[str], timeout: float = 120.0) -> tuple[int, bytes]:
    """Run `python -m wwrun args` with stdout and stderr on a pseudo-terminal (120x40,
    so wwrun draws its live table); returns its exit code and everything it wrote."""
    main, side = pty.openpty()
    fcntl.ioctl(side, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
    env = {**os.environ, "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen([sys.executable, "-m", "wwrun", *args], stdin=subprocess.DEVNULL,
                               stdout=side, stderr=side, env=env)
    os.close(side)
    written, deadline = bytearray(), time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([main], [], [], 1.0)
            if not ready:
                if process.poll() is not None:
                    break
                continue
            try:
                chunk = os.read(main, 65536)
            except OSError:  # the terminal's other side closed: wwrun has ended
                break
            if not chunk:
                break
            written += chunk
        else:
            pytest.fail(f"wwrun did not end within {timeout} s; it wrote {bytes(written[-2000:])!r}")
        return process.wait(timeout=30), bytes(written)
    finally:
        if process.poll() is None:
            process.kill()
        os.close(main)


def test_tqdm_in_three_jobs_draws_as_alone_and_control_sequences_stay_out_of_the_table(tmp_path):
    pytest.importorskip("tqdm")
    script = str(SCRIPTS / "progress.py")
    code, terminal = _run_on_a_terminal(
        ["--tee", "--log-dir", str(tmp_path), "--policy", "concurrent",
         script, ":", script, ":", script, "--control"])
    assert code == 0, terminal.decode(errors="replace")[-3000:]
    (run,) = [p for p in tmp_path.iterdir() if p.name != "latest"]
    for job in ("progress", "progress-2", "progress-3"):
        stderr = (run / job / "stderr.log").read_bytes()
        # What `python progress.py 2> file` holds: each bar on row 0, redrawn with '\r'
        # only; a bar on another row would move the cursor up (ESC [A).
        assert b"30/30" in stderr and b"\x1b" not in stderr, (job, stderr[-300:])
    # The log keeps what the job wrote; the terminal shows the line without it.
    assert b"tick\x1b[7A" in (run / "progress-3" / "stdout.log").read_bytes()
    assert b"tick" in terminal
    assert b"\x1b[7A" not in terminal and b"\x1b[A" not in terminal


def _side_by_side(tmp_path, script: str, **role_by_job: str):
    """One job per name, each running `script ROLE tmp_path`, at once; (the result,
    each job's stdout)."""
    from wwrun import JobSpec, LaunchConfig, launch

    result = launch(LaunchConfig(
        jobs=[JobSpec(name=name, script=script, args=[role, str(tmp_path)]) for name, role in role_by_job.items()],
        policy="concurrent", log_dir=str(tmp_path / "logs"), quiet=True,
    ))
    return result, {job.name: (Path(result.log_dir) / job.name / "stdout.log").read_text() for job in result.jobs}


def test_a_compile_in_one_job_leaves_another_jobs_optimizer_as_alone(tmp_path):
    """torch.compiler.is_compiling() was one process-wide flag, true for a whole compile
    session: AdamW beside another job's compile took its compiled path (a tensor step
    count) and ended a few ulps away from `python` alone."""
    script = str(SCRIPTS / "compile_session.py")
    alone = subprocess.run([sys.executable, script, "train", str(tmp_path)],
                           capture_output=True, text=True, timeout=120, check=True).stdout
    (tmp_path / "done").unlink()
    result, logs = _side_by_side(tmp_path, script, compile="compile", train="train-beside")
    assert result.exit_code == 0, logs
    assert "compiling: is_compiling True" in logs["compile"]  # as when alone: its own session
    assert "training: is_compiling False" in logs["train"]
    assert logs["train"] == alone


def test_a_job_reconfiguring_rich_s_console_leaves_another_job_s_live_bar_alone(tmp_path):
    """rich keeps one global console. Lightning's RichProgressBar reconfigures it as it
    starts: another job's bar, live on it, lost its place and failed as it stopped
    ("IndexError: pop from empty list"). Each job has its own."""
    rich = pytest.importorskip("rich")
    from wwrun import JobSpec, LaunchConfig, launch

    script = str(SCRIPTS / "rich_live.py")
    files = [str(tmp_path / "held"), str(tmp_path / "done")]
    result = launch(LaunchConfig(
        jobs=[JobSpec(name=role, script=script, args=[role, *files]) for role in ("hold", "reconfigure")],
        policy="concurrent", log_dir=str(tmp_path / "logs"), quiet=True,
    ))
    logs = {job.name: (Path(result.log_dir) / job.name / "stdout.log").read_text() for job in result.jobs}
    assert result.exit_code == 0, [job.error for job in result.jobs]
    assert logs["hold"].endswith("hold: reconfigured False\n")
    assert logs["reconfigure"].endswith("reconfigure: reconfigured True\n")
    assert rich.get_console().width != 123  # the launcher's console is rich's own, untouched


def test_hydra_s_singletons_of_the_run_in_progress_are_each_job_s_and_its_registries_shared(tmp_path, monkeypatch):
    """Hydra keeps `GlobalHydra` (and `HydraConfig`, `JobRuntime`) as singletons of one
    metaclass: a second job's `@hydra.main` failed at once, "GlobalHydra is already
    initialized". Its registries (the config store) stay shared, as modules fill them
    at import. The metaclass here is Hydra's shape with our view of its instances."""
    from wwrun import JobSpec, LaunchConfig, launch

    monkeypatch.syspath_prepend(str(SCRIPTS / "imports" / "shared"))
    monkeypatch.delitem(sys.modules, "singletons", raising=False)
    script = str(SCRIPTS / "imports" / "singletons_job.py")
    result = launch(LaunchConfig(jobs=[JobSpec(name=n, script=script) for n in ("one", "two")],
                                 policy="sequential", log_dir=str(tmp_path / "logs"), quiet=True))
    logs = [(Path(result.log_dir) / n / "stdout.log").read_text() for n in ("one", "two")]
    assert result.exit_code == 0, [job.error for job in result.jobs]
    assert logs == ["run 1 registry 2\n", "run 3 registry 2\n"]


def test_hydra_runs_in_two_jobs_at_once(tmp_path):
    """The real library, where it is installed (it is not one of wwrun's dependencies)."""
    pytest.importorskip("hydra")
    from wwrun import JobSpec, LaunchConfig, launch

    (tmp_path / "conf").mkdir()
    (tmp_path / "conf" / "config.yaml").write_text("seed: 0\n")
    script = tmp_path / "hydra_job.py"
    script.write_text(
        "import os\nimport hydra\nfrom hydra.core.hydra_config import HydraConfig\n\n"
        "@hydra.main(version_base=None, config_path='conf', config_name='config')\n"
        "def main(cfg):\n"
        "    print('seed', cfg.seed, 'env', type(os.environ).__name__ != 'dict', HydraConfig.get().run.dir)\n\n"
        "main()\n")
    jobs = [JobSpec(name=f"h{seed}", script=str(script), args=[f"seed={seed}", f"hydra.run.dir={tmp_path}/runs/h{seed}"])
            for seed in (1, 2)]
    result = launch(LaunchConfig(jobs=jobs, policy="concurrent", log_dir=str(tmp_path / "logs"), quiet=True))
    assert result.exit_code == 0, [job.error for job in result.jobs]
    for seed in (1, 2):
        assert (Path(result.log_dir) / f"h{seed}" / "stdout.log").read_text() == \
            f"seed {seed} env True {tmp_path}/runs/h{seed}\n"


def met_at_a_rendezvous(tmp_path, monkeypatch, library: str, script: str, args_by_job: dict) -> Path:
    """Runs the jobs of `args_by_job` at once, each given its args, then a rendezvous
    folder where they wait for each other and their number, with the library module
    `imports/shared/<library>.py` fresh on the launcher's path; the run's log folder."""
    from wwrun import JobSpec, LaunchConfig, launch

    monkeypatch.syspath_prepend(str(SCRIPTS / "imports" / "shared"))
    monkeypatch.delitem(sys.modules, library, raising=False)
    rendezvous = tmp_path / "rendezvous"
    rendezvous.mkdir()
    jobs = [JobSpec(name=name, script=str(SCRIPTS / "imports" / script),
                    args=[*args, str(rendezvous), str(len(args_by_job))]) for name, args in args_by_job.items()]
    result = launch(LaunchConfig(jobs=jobs, policy="concurrent", log_dir=str(tmp_path / "logs"), quiet=True))
    assert result.exit_code == 0, [job.error for job in result.jobs]
    return Path(result.log_dir)


def test_accelerate_s_state_is_each_job_s_own(tmp_path, monkeypatch):
    """accelerate's `PartialState`, `AcceleratorState` and `GradientState` are Borgs
    (every instance's `__dict__` is one class attribute dict): two jobs' Accelerators
    were one, each job's `accumulate()` synced on the other's steps, and both trained
    to other losses than under `python`. The class here is that shape with our view."""
    logs = met_at_a_rendezvous(tmp_path, monkeypatch, "borg", "borg_job.py", {f"s{n}": [str(n)] for n in (2, 4)})
    for steps in (2, 4):
        assert (logs / f"s{steps}" / "stdout.log").read_text() == \
            f"accumulation steps {steps} shared {{'accumulation_steps': {steps}}}\n"


def test_wandb_s_run_in_progress_is_each_job_s_own(tmp_path, monkeypatch):
    """`wandb.init` puts its run in wandb's module globals (`wandb.run`, `.config`,
    `.log`, `.summary`): a second job's init took the first job's over, whose
    `wandb.config.seed` then read the other's and whose `wandb.summary` lacked its own
    metrics (KeyError). The module here is that shape with our view."""
    logs = met_at_a_rendezvous(tmp_path, monkeypatch, "run_globals", "run_globals_job.py",
                               {name: [name] for name in ("a", "b")})
    for name in ("a", "b"):
        assert (logs / name / "stdout.log").read_text() == f"{name} {{'name': '{name}'}}\n"
    import run_globals

    assert (run_globals.run, run_globals.config) == (None, {})  # a thread of no job: the module's own


def test_a_script_s_functions_pickle_with_cloudpickle_as_alone(tmp_path):
    """cloudpickle (what joblib, Ray and dask send work with) reduces a module by its exact
    type: a function naming `os`, `sys`, `threading` or numpy's `mtrand`, whose types
    wwrun subclasses, failed with "cannot pickle 'module' object"."""
    pytest.importorskip("cloudpickle")
    pytest.importorskip("numpy")
    from wwrun import JobSpec, LaunchConfig, launch

    result = launch(LaunchConfig(jobs=[JobSpec(name="p", script=str(SCRIPTS / "pickles_functions.py"))],
                                 policy="concurrent", log_dir=str(tmp_path / "logs"), quiet=True))
    assert result.exit_code == 0, result.jobs[0].error
    assert (Path(result.log_dir) / "p" / "stdout.log").read_text() == "True\n"


def test_joblib_runs_two_jobs_work_in_its_workers_and_each_job_ends(tmp_path):
    """joblib's loky executor is one for the process (a module global), and its manager
    thread is not a daemon: Python's exit stops it through a `threading._register_atexit`
    hook. A job's end waited for it for good; the run's end ended loky's processes before
    that hook ran (its resource tracker then "died unexpectedly")."""
    pytest.importorskip("joblib")
    script = tmp_path / "joblib_job.py"
    script.write_text(
        "import os, sys\nfrom joblib import Parallel, delayed\n"
        "def work(i):\n    return i * i, os.getpid() != PARENT\n"
        "PARENT = os.getpid()\n"
        "for _ in range(int(sys.argv[1])):\n"
        "    out = Parallel(n_jobs=2)(delayed(work)(i) for i in range(4))\n"
        "print(out)\n")
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--quiet", "--timeout", "120s", "--log-dir", str(tmp_path / "logs"),
         str(script), "1", ":", str(script), "5"],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    expected = "[(0, True), (1, True), (4, True), (9, True)]\n"
    for name in ("joblib_job", "joblib_job-2"):
        assert (tmp_path / "logs" / "latest" / name / "stdout.log").read_text() == expected
    assert "resource_tracker" not in done.stderr and "Traceback" not in done.stderr, done.stderr


def test_joblib_runs_each_job_s_work_in_its_own_workers_folder_and_environment(tmp_path):
    """loky's reusable executor was one per process: the second job's tasks ran in the
    first job's workers, in that job's folder and environment, printing into its log."""
    pytest.importorskip("joblib")
    script = tmp_path / "where.py"
    script.write_text(
        "import os, sys\nfrom joblib import Parallel, delayed\n"
        # One write a line: two workers' prints can interleave, as in any process.
        "def where(i):\n    os.write(1, f\"task {i} in {os.environ['TAG']}\\n\".encode())\n"
        "    return os.path.basename(os.getcwd()), os.environ['TAG']\n"
        "print(sorted(set(Parallel(n_jobs=2)(delayed(where)(i) for i in range(4)))))\n"
        # Other arguments: loky replaces the job's executor, calling itself again.
        "print(sorted(set(Parallel(n_jobs=2, max_nbytes='2M')(delayed(where)(i) for i in range(4)))))\n")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("jobs:\n" + "".join(
        f"  - script: {script}\n    name: {name}\n    cwd: 'runs/{{job}}'\n    env: {{TAG: from-{name}}}\n"
        for name in ("a", "b")))
    done = subprocess.run(
        [sys.executable, "-m", "wwrun", "--quiet", "--timeout", "120s", "--policy", "concurrent",
         "--max-concurrent", "1", "--log-dir", str(tmp_path / "logs"), str(recipe)],
        capture_output=True, text=True, timeout=240, cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)})
    assert done.returncode == 0, done.stdout + done.stderr
    for name in ("a", "b"):  # b after a: a's executor, were it shared, would serve b's tasks
        out = (tmp_path / "logs" / "latest" / name / "stdout.log").read_text().splitlines()
        results = [line for line in out if not line.startswith("task")]
        assert results == [f"[('{name}', 'from-{name}')]"] * 2
        assert sorted(line for line in out if line.startswith("task")) == sorted(
            [f"task {i} in from-{name}" for i in range(4)] * 2)


def test_a_forked_child_draws_a_tqdm_bar_while_another_thread_held_tqdm_s_lock():
    """tqdm's write lock is a process-shared lock, then a thread lock. A DataLoader worker
    forked while another job's thread drew a bar took the shared one and then waited
    for good on the thread lock (held by a thread it does not have), and every job's
    workers and bars then waited on the shared one (`datasets` formats a batch with a
    tqdm call in each worker). A child forked with plain `os.fork()` (multiprocessing
    resets the shared lock's count of holds only in its own children) kept the shared
    one when done with it, and the parent's next bar waited for good."""
    tqdm = pytest.importorskip("tqdm")
    from tests.forking import exit_code_of, holding
    from wwrun import libstate

    libstate.install()
    with holding(tqdm.tqdm.get_lock()) as release:
        pid = os.fork()
        if pid == 0:
            try:
                with tqdm.tqdm.get_lock():  # its acquire returns None: a `with` says it was taken
                    pass
                os._exit(0)  # after its release: the process-shared lock is this process's too
            finally:
                os._exit(2)
        release()  # the process-shared lock is free again for the child; the thread lock is its own
    assert exit_code_of(pid, "taking tqdm's lock") == 0
    shared, own = tqdm.tqdm.get_lock().locks
    assert shared.acquire(timeout=5), "the child kept the process-shared lock"
    shared.release()


def test_wandb_logs_two_jobs_at_once_as_alone(tmp_path):
    """The real library, where it is installed (it is not one of wwrun's dependencies),
    offline: each job's config and summary are its own, and a run the script leaves
    open is finished by wandb's teardown, before the run's end ends wandb's service."""
    pytest.importorskip("wandb")
    from wwrun import JobSpec, LaunchConfig, launch

    script = tmp_path / "wandb_job.py"
    script.write_text(
        "import sys\nimport wandb\nseed = int(sys.argv[1])\n"
        "run = wandb.init(mode='offline', project='p', name=f'job{seed}', config={'seed': seed})\n"
        "for step in range(5):\n    wandb.log({'loss': seed * step})\n"
        "print(wandb.config.seed, wandb.summary['loss'])\n")  # no wandb.finish(): the teardown's
    result = launch(LaunchConfig(
        jobs=[JobSpec(name=f"w{seed}", script=str(script), args=[str(seed)], cwd=str(tmp_path),
                      env={"WANDB_SILENT": "true"}) for seed in (1, 2)],
        policy="concurrent", log_dir=str(tmp_path / "logs"), quiet=True))
    assert result.exit_code == 0, [job.error for job in result.jobs]
    for seed in (1, 2):
        assert (Path(result.log_dir) / f"w{seed}" / "stdout.log").read_text() == f"{seed} {seed * 4}\n"
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and all(run.stat().st_size > 1000 for run in runs), [r.stat().st_size for r in runs]


def test_accelerate_trains_two_jobs_at_once_as_alone(tmp_path):
    """The real library, where it is installed (it is not one of wwrun's dependencies):
    gradient accumulation's syncs are each job's own."""
    pytest.importorskip("accelerate")
    from wwrun import JobSpec, LaunchConfig, launch

    script = tmp_path / "accelerate_job.py"
    script.write_text(
        "import sys\nimport torch\nfrom accelerate import Accelerator\n"
        "accelerator = Accelerator(cpu=True, gradient_accumulation_steps=int(sys.argv[1]))\n"
        "torch.manual_seed(0)\nmodel = torch.nn.Linear(4, 1)\nopt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "model, opt = accelerator.prepare(model, opt)\nsyncs = []\nfor step in range(6):\n"
        "    with accelerator.accumulate(model):\n"
        "        accelerator.backward(model(torch.ones(2, 4)).sum())\n"
        "        syncs.append(accelerator.sync_gradients)\n        opt.step()\n        opt.zero_grad()\n"
        "print(syncs)\n")
    result = launch(LaunchConfig(jobs=[JobSpec(name=f"a{n}", script=str(script), args=[str(n)]) for n in (2, 3)],
                                 policy="concurrent", log_dir=str(tmp_path / "logs"), quiet=True))
    assert result.exit_code == 0, [job.error for job in result.jobs]
    for n in (2, 3):
        expected = [(step + 1) % n == 0 for step in range(6)]
        assert (Path(result.log_dir) / f"a{n}" / "stdout.log").read_text() == f"{expected}\n"


def test_a_patch_that_does_not_fit_the_library_s_version_leaves_it_as_it_is(capfd):
    """A job's `import joblib` must not fail for a name a later joblib no longer has."""
    import types

    from wwrun import libstate

    older = types.ModuleType("joblib.executor")  # without MemmappingExecutor
    libstate._apply(libstate._per_job_joblib_executor_args, older)
    assert vars(older).keys() == vars(types.ModuleType("x")).keys()

    def does_not_fit(module):
        raise KeyError("get_reusable_executor")

    libstate._apply(does_not_fit, older)
    assert "joblib.executor left as it is, shared by every job (KeyError: 'get_reusable_executor')" in capfd.readouterr().err


def test_a_torch_fx_trace_in_one_job_leaves_another_job_s_modules_and_compiled_functions_as_alone(tmp_path):
    """torch.fx's tracer points `nn.Module.__call__` at itself and raises a global
    flag while it traces (torch.compile runs it on every graph): another job's module
    call meanwhile went into that trace ("module is not installed as a submodule"),
    and its compiled model refused to run (nanoGPT's train.py, twice with
    `--compile=True`: "Detected that you are using FX to symbolically trace a
    dynamo-optimized function")."""
    result, logs = _side_by_side(tmp_path, str(SCRIPTS / "fx_trace_beside.py"), trace="trace", eager="eager")
    assert result.exit_code == 0, logs
    assert "fx tracing here: False False" in logs["eager"]
    assert "module gives Tensor" in logs["eager"]
    assert "compiled function gives [3.0, 3.0]" in logs["eager"]
    # The trace in progress got none of the other job's calls: as when alone.
    assert "traced ['placeholder', 'call_module', 'call_method', 'output']" in logs["trace"]


@pytest.mark.parametrize("lock_name, what_a_worker_does", [
    ("torch.cuda._initialization_lock", "torch.manual_seed(0)"),
    ("torch.storage._share_memory_lock", "torch.ones(2).share_memory_()"),
    ("torch.utils._pytree._NODE_REGISTRY_LOCK",
     "torch.utils._pytree.register_pytree_node(type('Output', (), {}), lambda o: ([], None), lambda c, x: None)"),
])
def test_a_dataloader_worker_forked_while_another_job_held_a_torch_lock_goes_on(lock_name, what_a_worker_does):
    """`torch.manual_seed` queues CUDA's seeding under torch.cuda's lock (formatting the
    stack there), and every DataLoader worker seeds as it starts: a worker forked while
    another job's thread seeded waited for good (the Hugging Face Trainer in three jobs
    with two workers each hung one run in three). Workers share tensors and register
    pytree nodes under torch's other module locks."""
    import importlib

    import torch

    from tests.forking import exit_code_of, holding
    from wwrun import libstate

    libstate.install()
    module_name, name = lock_name.rsplit(".", 1)
    with holding(getattr(importlib.import_module(module_name), name)):
        pid = os.fork()
        if pid == 0:
            try:
                exec(what_a_worker_does, {"torch": torch})
                os._exit(0)
            finally:
                os._exit(2)
    assert exit_code_of(pid, f"{what_a_worker_does} while another thread held {lock_name}", timeout_s=10) == 0
