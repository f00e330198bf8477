"""Past one device: one engine per GPU (or per `--engines` on the CPU), each a whole
wwrun engine in its own process, and a driver that places jobs on them by memory.

    wwrun --gpus all sweep.yaml                             # one engine process per GPU
    wwrun --device cpu --engines 2 --memory-limit 64MiB,256MiB a.py : b.py
    wwrun --ray [ADDRESS] sweep.yaml                        # engines as Ray actors

One invariant: one engine = one device = one process. With one engine nothing here
runs and `launch` behaves as it always did (no extra process).

    placement.py   which engine a job goes to (pure logic, no processes)
    engines.py     an engine process (multiprocessing, spawn) or Ray actor, behind one interface
    driver.py      the queue, retries, signals, the merged report and events
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

from wwrun.config import ConfigError, LaunchConfig, _device_of


@dataclass(frozen=True)
class Plan:
    """How many engines a run gets and what each has."""

    device: str
    """'cpu' or 'cuda'."""
    count: int | None
    """Engines; None: one per GPU of the Ray cluster (known once it is joined)."""
    limits: tuple
    """Each engine's memory limit (bytes, a fraction, or None), one per engine; one
    entry for all when `count` is None."""
    gpus: tuple[int, ...] | None
    """Local GPU indices (as CUDA_VISIBLE_DEVICES shows them), one per engine; None
    on the CPU and under Ray (Ray hands each actor its GPU)."""


def plan(config: LaunchConfig) -> Plan:
    """The engines `config` asks for on this machine. Raises ConfigError."""
    device = _device_of(config)
    limits = config.memory_limit if isinstance(config.memory_limit, list) else None
    if config.gpus is not None and device != "cuda":
        raise ConfigError("gpus", "needs CUDA devices, and this run is on the CPU (use --engines N there)")
    gpus = None
    if config.ray is not None:
        count = config.engines or (len(limits) if limits else None)
        if count is None and device == "cpu":
            count = 1
        if config.gpus not in (None, "all"):
            raise ConfigError("gpus", "under --ray each engine gets the GPU Ray gives it: use --engines N")
    elif device == "cuda":
        gpus = _select_gpus(config.gpus, config.engines, _visible_gpus())
        count = len(gpus)
    else:
        count = config.engines or (len(limits) if limits else 1)
    if limits is not None and count is not None and len(limits) != count:
        raise ConfigError("memory_limit", f"{len(limits)} limits for {count} engine(s): give one, or one per engine")
    if limits is None:
        limits = [config.memory_limit] * (count or 1)
    return Plan(device=device, count=count, limits=tuple(limits), gpus=None if gpus is None else tuple(gpus))


def asked_for(config: LaunchConfig) -> bool:
    """Whether the config names a scale-out option (engines, GPUs, Ray, a memory limit per engine)."""
    return (config.engines is not None or config.gpus is not None or config.ray is not None
            or isinstance(config.memory_limit, list))


def needs_driver(config: LaunchConfig) -> bool:
    """Whether the run goes through the driver: several engines, a chosen GPU, or Ray."""
    if config.ray is not None:
        return True
    if config.engines is None and config.gpus is None and not isinstance(config.memory_limit, list):
        if config.device == "cpu" or _visible_gpus() <= 1:
            return False
    p = plan(config)
    return p.count > 1 or (p.gpus is not None and p.gpus != (0,))


def preflight(config: LaunchConfig) -> None:
    """The checks of the scale-out options that need this machine; ConfigError."""
    if config.ray is not None and importlib.util.find_spec("ray") is None:
        raise ConfigError("ray", "needs Ray, which is not installed (pip install 'wwrun[ray]')")
    p = plan(config)
    if config.ray is not None or (p.count or 2) > 1:
        for name in ("trace", "memory_plot", "explain"):
            if getattr(config, name):
                raise ConfigError(name, "observes one engine: not with several engines (run one, or drop it)")


def launch(config: LaunchConfig, *, display):
    """Run the config's jobs on several engines; returns a RunResult as `wwrun.launch`,
    which calls it when `needs_driver`."""
    from wwrun.scale.driver import Driver
    from wwrun.scale.engines import ProcessFleet, RayFleet

    preflight(config)  # also when only the GPUs it sees made the run several engines
    p = plan(config)
    fleet = RayFleet(config, p) if config.ray is not None else ProcessFleet(config, p)
    return Driver(config, fleet, display).run()


def _visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _select_gpus(gpus: str | None, engines: int | None, visible: int) -> list[int]:
    """The GPU indices `--gpus` (and `--engines`) select among `visible`."""
    if gpus is None or gpus == "all":
        chosen = list(range(visible))
        if engines is not None:
            if engines > visible:
                raise ConfigError("engines", f"{engines} engines, one per GPU, and this machine shows {visible} GPU(s)")
            chosen = chosen[:engines]
        return chosen
    if "," in gpus:
        chosen = [int(i) for i in gpus.split(",") if i]
        if len(set(chosen)) != len(chosen):
            raise ConfigError("gpus", f"{gpus!r} names a GPU twice")
        missing = [i for i in chosen if i >= visible]
        if missing:
            raise ConfigError("gpus", f"no GPU {missing[0]} here: this process sees {visible} (0 to {visible - 1})"
                              if visible else f"no GPU {missing[0]} here: this process sees none")
    else:
        if int(gpus) > visible:
            raise ConfigError("gpus", f"{gpus} GPUs asked for and this process sees {visible}")
        chosen = list(range(int(gpus)))
    if engines is not None and engines != len(chosen):
        raise ConfigError("engines", f"{engines} engines for {len(chosen)} GPU(s): one engine per GPU")
    return chosen
