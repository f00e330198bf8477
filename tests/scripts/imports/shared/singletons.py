"""The shape of Hydra's `Singleton` metaclass (one instance per class, kept in the
metaclass's `_instances`), with wwrun's per-job view of it, as wwrun puts it on
`hydra.core.singleton.Singleton`; two classes named as Hydra's: the run in progress
(`GlobalHydra`) and a registry (`ConfigStore`). Each instance gets a serial number."""

import itertools

from wwrun.libstate import _PerJobSingletons

serials = itertools.count(1)


class Singleton(type):
    _instances = _PerJobSingletons({})

    def __call__(cls, *args, **kwargs):
        if cls not in cls._instances:
            cls._instances[cls] = super().__call__(*args, **kwargs)
        return cls._instances[cls]


class GlobalHydra(metaclass=Singleton):
    def __init__(self):
        self.serial = next(serials)


class ConfigStore(metaclass=Singleton):
    def __init__(self):
        self.serial = next(serials)


GlobalHydra.__module__ = "hydra.core.global_hydra"
ConfigStore.__module__ = "hydra.core.config_store"
