"""Engines behind one interface: a process of this machine (multiprocessing, spawn)
or a Ray actor, each running one fed `wwrun.runner.Runner` (a whole wwrun engine on its device).

Messages from an engine to the driver (tuples, first the kind):

    ("ready", info)                      started: pid, host, device, capacity (bytes or None),
                                         allocator (the one serving its jobs)
    ("state", name, state, details)      a job's state changed; details: exit_code, error,
                                         started, ended, reason (what a queued or waiting
                                         job waits for), and at its end out_of_memory
                                         and the engine's job report (peak_memory_bytes, ...)
    ("line", name, stream, text)         a line the job printed
    ("note", text, important)            a note of the engine's launcher
    ("memory", {name: (live, peak, iterations)}, total_live)   about twice a second
    ("done", run_extra)                  its run ended after `close`
    ("error", text)                      it could not start

and from the driver: submit(spec, index, folder), close(), interrupt().

`ProcessFleet` and `RayFleet` hold a run's engines; the driver calls `start`,
`submit`, `close`, `interrupt`, `wait` (messages and deaths) and `shutdown`.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import threading
import types
import time
from collections import deque

MEMORY_EVERY_S = 0.5
START_TIMEOUT_S = 180.0  # an engine imports torch and builds what it needs


def engine_config(config, limit, index: int):
    """The config one engine runs: its own memory limit, its files under
    `<run>/engine-<index>/`, and the driver's run id. The driver keeps the queue,
    retries, halting, the report and the events."""
    run_dir = os.path.join(os.path.abspath(config.log_dir), config.run_id)
    return config.replace(
        memory_limit=limit, policy=config.resolved_policy, log_dir=os.path.join(run_dir, f"engine-{index}"),
        engines=None, gpus=None,
        ray=None, shard=None, retries=0, halt="never", report=None, events=None, quiet=True, tee=False,
        trace=None, memory_plot=None, explain=False,
    )


class EngineCore:
    """One engine, in the process that hosts it: a fed `Runner` on its own thread,
    its states, lines and memory sent through `send`."""

    def __init__(self, config, index: int, send, cpu_threads: int | None = None):
        from wwrun import isolation, libstate, rng
        from wwrun.runner import Runner

        self.index = index
        self.send = send
        isolation.install()
        libstate.install()
        rng.install()
        self.runner = Runner(config, _Forward(self), fed=True, cpu_threads=cpu_threads)
        self._thread = threading.Thread(target=self._run, name=f"wwrun-engine-{index}", daemon=True)
        self._ended = threading.Event()

    def start(self) -> None:
        import torch

        self.send(("ready", {
            "pid": os.getpid(), "host": socket.gethostname(), "device": self.runner.device,
            "capacity": self.runner.memory.limit, "allocator": self.runner.memory.allocator,
            "visible_gpus": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "torch": torch.__version__,
        }))
        self._thread.start()
        threading.Thread(target=self._report_memory, name="wwrun-engine-memory", daemon=True).start()

    def _run(self) -> None:
        try:
            result = self.runner.run()
            self.send(("done", result.to_dict()["run"]))
        except BaseException as exc:  # noqa: BLE001 - told to the driver, which reports it
            self.send(("error", f"engine {self.index}: {type(exc).__name__}: {exc}"))
        finally:
            self._ended.set()

    def _report_memory(self) -> None:
        while not self._ended.wait(MEMORY_EVERY_S):
            memory = self.runner.memory
            figures = {}
            for job in list(self.runner.jobs):
                if job.result.state.is_final or job.thread is None:
                    continue
                try:
                    report = memory.job_report(job.spec.name, started=True)
                except (KeyError, RuntimeError):  # not seen yet, or changing under us: next time
                    continue
                if "peak_memory_bytes" not in report:
                    continue
                figures[job.spec.name] = (memory.memory_of(job.spec.name) or 0, report["peak_memory_bytes"],
                                          report.get("iterations", 0))
            self.send(("memory", figures, sum(live for live, _, _ in figures.values())))

    def submit(self, spec, index: int, folder: str) -> None:
        self.runner.submit(spec, index, folder)

    def close(self) -> None:
        self.runner.close()

    def interrupt(self) -> None:
        self.runner.interrupt()

    def join(self, timeout: float | None = None) -> bool:
        return self._ended.wait(timeout)


class _Forward:
    """The engine's display: what a display would show goes to the driver instead."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.runner = None

    def start(self, runner) -> None:
        self.runner = runner

    def line(self, job: str, stream: str, text: str) -> None:
        self.core.send(("line", job, stream, text))

    def prompt(self, job: str, stream: str, text: str) -> None:
        pass  # an engine's jobs read no terminal: its stdin is /dev/null

    def state(self, result) -> None:
        details = {"exit_code": result.exit_code, "error": result.error, "started": result.started,
                   "ended": result.ended, "reason": result.reason}
        if result.state.is_final:
            job = next((j for j in self.runner.jobs if j.result is result), None)
            details["out_of_memory"] = bool(job and job.out_of_memory)
            report = self.runner.job_report(job) if job is not None else {}
            if report:
                details["report"] = report
        self.core.send(("state", result.name, result.state.value, details))

    def note(self, text: str, important: bool = True) -> None:
        self.core.send(("note", text, important))

    def explain(self, text: str) -> None:
        pass

    def stop(self, result) -> None:
        pass


# ----------------------------------------------------------------------------- processes


def _process_main(conn, config, index: int, gpu: int | None, cpu_threads: int | None = None) -> None:
    """An engine process: commands from the pipe, messages back through it."""
    if gpu is not None:  # before torch looks: this process sees its GPU alone, as device 0
        os.environ["CUDA_VISIBLE_DEVICES"] = _physical_gpu(gpu)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver relays Ctrl-C, once each time
    lock = threading.Lock()

    def send(message) -> None:
        with lock:
            try:
                conn.send(message)
            except (OSError, ValueError):  # the driver went away
                pass

    try:
        core = EngineCore(config, index, send, cpu_threads)
        core.start()
    except BaseException as exc:  # noqa: BLE001
        send(("error", f"engine {index} could not start: {type(exc).__name__}: {exc}"))
        return
    driver_gone = False
    while True:
        try:
            command, *args = conn.recv()
        except (EOFError, OSError):  # the driver is gone: stop the jobs
            driver_gone = True
            core.interrupt()
            break
        if command == "submit":
            core.submit(*args)
        elif command == "close":
            core.close()
            break
        elif command == "interrupt":
            core.interrupt()
    while not core.join(0.5):  # closed (or the driver is gone): until the engine's jobs have ended
        if driver_gone or not conn.poll():
            continue
        try:
            command, *args = conn.recv()
        except (EOFError, OSError):
            driver_gone = True
            core.interrupt()
            continue
        if command == "interrupt":
            core.interrupt()
    conn.close()


def _physical_gpu(index: int) -> str:
    """The CUDA_VISIBLE_DEVICES entry of this process's `index`-th visible GPU."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if index < len(entries):
            return entries[index]
    return str(index)


class _Engine:
    """The driver's handle on one engine."""

    def __init__(self, index: int, limit, label: str):
        self.index = index
        self.limit = limit
        self.label = label
        self.info: dict = {}
        self.alive = True
        self.ready = False
        self.done = False
        self.death: str | None = None
        self.exit_code: int | None = None


class ProcessFleet:
    """Engines as processes of this machine, one per GPU or per --engines on the CPU."""

    kind = "process"

    def __init__(self, config, plan):
        from wwrun import host

        self.config = config
        self.plan = plan
        self.engines = [_Engine(i, plan.limits[i], f"engine {i}") for i in range(plan.count)]
        self.jobs_at_once = min(len(config.jobs), plan.count * config.concurrency)
        self.cpu_threads = host.cpu_threads_per_job(self.jobs_at_once)
        """torch's intra-op threads in every engine: they share this machine's CPUs."""
        self._procs = []
        self._conns = []

    def start(self) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # forking a process with torch's threads is unsafe
        # Spawn imports the parent's __main__ again in each child (a user's unguarded
        # script would start its own run there): the engines need nothing of it.
        main = sys.modules["__main__"]
        sys.modules["__main__"] = types.ModuleType("__main__")
        try:
            self._spawn(ctx)
        finally:
            sys.modules["__main__"] = main

    def _spawn(self, ctx) -> None:
        for engine in self.engines:
            parent, child = ctx.Pipe()
            gpu = self.plan.gpus[engine.index] if self.plan.gpus is not None else None
            if gpu is not None:
                engine.label += f" (GPU {gpu})"
            proc = ctx.Process(
                target=_process_main, name=f"wwrun-engine-{engine.index}",
                args=(child, engine_config(self.config, engine.limit, engine.index), engine.index, gpu,
                      self.cpu_threads),
                daemon=True,
            )
            proc.start()
            child.close()
            self._procs.append(proc)
            self._conns.append(parent)

    def submit(self, index: int, spec, job_index: int, folder: str) -> None:
        self._send(index, ("submit", spec, job_index, folder))

    def close(self, index: int) -> None:
        self._send(index, ("close",))

    def interrupt(self, index: int) -> None:
        self._send(index, ("interrupt",))

    def _send(self, index: int, message) -> None:
        if not self.engines[index].alive:
            return
        try:
            self._conns[index].send(message)
        except (OSError, ValueError):
            pass  # it died: `wait` tells

    def wait(self, timeout: float) -> tuple[list[tuple[int, tuple]], list[int]]:
        """(messages as (engine, message), engines found dead) within `timeout` seconds."""
        from multiprocessing.connection import wait

        live = {i: c for i, c in enumerate(self._conns) if self.engines[i].alive}
        sentinels = {self._procs[i].sentinel: i for i in live}
        ready = wait([*live.values(), *sentinels], timeout) if live else []
        messages, dead = [], []
        for i, conn in live.items():
            if conn in ready or self._procs[i].sentinel in ready:
                try:
                    while conn.poll():
                        message = conn.recv()
                        _note_end(self.engines[i], message)
                        messages.append((i, message))
                except (EOFError, OSError):
                    pass
        for i in live:
            proc = self._procs[i]
            if proc.sentinel in ready or not proc.is_alive() or self.engines[i].death:
                if proc.is_alive():  # it said it failed (`error`): nothing more will come from it
                    proc.kill()
                proc.join(1)
                engine = self.engines[i]
                engine.exit_code = proc.exitcode
                if not engine.done:
                    engine.death = engine.death or _death(proc.exitcode, engine.info.get("pid", proc.pid))
                    dead.append(i)
                engine.alive = False
        return messages, dead

    def kill(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()

    def shutdown(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
        self.kill()
        for conn in self._conns:
            conn.close()


def _note_end(engine: _Engine, message: tuple) -> None:
    """An engine's last words: its run ended (`done`), or it failed (`error`)."""
    if message[0] == "done":
        engine.done = True
    elif message[0] == "error":
        engine.death = message[1]
    elif message[0] == "ready":
        engine.info = message[1]
        engine.ready = True


def _death(exit_code: int | None, pid) -> str:
    if exit_code is not None and exit_code < 0:
        try:
            how = signal.Signals(-exit_code).name
        except ValueError:
            how = f"signal {-exit_code}"
    else:
        how = f"exit code {exit_code}"
    return f"its engine process (pid {pid}) died ({how})"


def death_exit_code(exit_code: int | None) -> int:
    """A shell's code for a process ended by a signal (139 for SIGSEGV), else its own."""
    if exit_code is None:
        return 1
    return 128 - exit_code if exit_code < 0 else (exit_code or 1)


# ----------------------------------------------------------------------------- Ray


class EngineActor:
    """An engine as a Ray actor (`RayFleet` makes it remote). Its messages wait in a
    list until `poll` takes them (through Ray's object store)."""

    def __init__(self, config, index: int):
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver relays Ctrl-C
        self._messages: deque = deque()
        self._cond = threading.Condition()
        self.core = EngineCore(config, index, self._send)
        self.core.start()

    def _send(self, message) -> None:
        with self._cond:
            self._messages.append(message)
            self._cond.notify_all()

    def poll(self, timeout: float = 0.5) -> list:
        """The messages since the last poll; waits up to `timeout` for one."""
        with self._cond:
            if not self._messages:
                self._cond.wait(timeout)
            messages = list(self._messages)
            self._messages.clear()
        return messages

    def submit(self, spec, job_index: int, folder: str) -> None:
        self.core.submit(spec, job_index, folder)

    def close(self) -> None:
        self.core.close()

    def interrupt(self) -> None:
        self.core.interrupt()


class RayFleet:
    """Engines as Ray actors, each reserving one GPU (or one CPU with --device cpu):
    one per GPU of the cluster, or `--engines` of them. Without an address a local
    Ray starts (and stops with the run); in a process where Ray is already started,
    that Ray is used."""

    kind = "ray"
    cpu_threads = None  # engines on several hosts: each divides its own host's CPUs

    def __init__(self, config, plan):
        self.config = config
        self.plan = plan
        self.engines: list[_Engine] = []
        self._actors = []
        self._polls: dict = {}
        self._started_ray = False

    def start(self) -> None:
        import ray

        if not ray.is_initialized():
            address = None if self.config.ray == "local" else self.config.ray
            # Ray's own INFO and WARNING lines (token authentication, "Started a local Ray
            # instance") are not the run's: only its errors reach wwrun's output.
            options = {"address": address, "include_dashboard": False, "log_to_driver": False,
                       "logging_level": logging.ERROR}
            if address is None and self.plan.device == "cpu":
                options["num_cpus"] = max(os.cpu_count() or 1, self.plan.count or 1)
            try:
                ray.init(**options)
            except (ConnectionError, RuntimeError, ValueError) as err:
                from wwrun.config import ConfigError

                first = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise ConfigError("ray", f"cannot start or reach Ray at {self.config.ray}: {first}") from None
            self._started_ray = True
        count = self.plan.count
        if count is None:  # one per GPU of the cluster
            count = int(ray.cluster_resources().get("GPU", 0))
            if count == 0:
                from wwrun.config import ConfigError

                raise ConfigError("ray", "the Ray cluster has no GPU: use --device cpu --engines N")
        limits = self.plan.limits if len(self.plan.limits) == count else [self.plan.limits[0]] * count
        resources = {"num_gpus": 1, "num_cpus": 0} if self.plan.device == "cuda" else {"num_cpus": 1}
        actor = ray.remote(max_concurrency=4, max_restarts=0)(EngineActor)
        for i in range(count):
            engine = _Engine(i, limits[i], f"engine {i} (Ray)")
            self.engines.append(engine)
            handle = actor.options(name=None, **resources).remote(engine_config(self.config, limits[i], i), i)
            self._actors.append(handle)
            self._polls[handle.poll.remote()] = i

    def submit(self, index: int, spec, job_index: int, folder: str) -> None:
        if self.engines[index].alive:
            self._actors[index].submit.remote(spec, job_index, folder)

    def close(self, index: int) -> None:
        if self.engines[index].alive:
            self._actors[index].close.remote()

    def interrupt(self, index: int) -> None:
        if self.engines[index].alive:
            self._actors[index].interrupt.remote()

    def wait(self, timeout: float) -> tuple[list[tuple[int, tuple]], list[int]]:
        import ray

        if not self._polls:
            time.sleep(min(timeout, 0.1))
            return [], []
        ready, _ = ray.wait(list(self._polls), num_returns=len(self._polls), timeout=timeout)
        messages, dead = [], []
        for ref in ready:
            i = self._polls.pop(ref)
            engine = self.engines[i]
            try:
                for message in ray.get(ref):
                    _note_end(engine, message)
                    messages.append((i, message))
            except (ray.exceptions.RayActorError, ray.exceptions.ActorDiedError,
                    ray.exceptions.WorkerCrashedError, ray.exceptions.NodeDiedError) as err:
                engine.alive = False
                if not engine.done:
                    engine.death = f"its Ray actor died ({type(err).__name__}: {_first_line(err)})"
                    dead.append(i)
                continue
            if engine.done or engine.death:
                engine.alive = False
                if engine.death:
                    dead.append(i)
                continue
            self._polls[self._actors[i].poll.remote()] = i
        return messages, dead

    def kill(self) -> None:
        import ray

        for handle in self._actors:
            try:
                ray.kill(handle)
            except Exception:  # noqa: BLE001 - gone already
                pass

    def shutdown(self, timeout: float) -> None:
        import ray

        self.kill()
        if self._started_ray:
            ray.shutdown()


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0][:200] if text else ""
