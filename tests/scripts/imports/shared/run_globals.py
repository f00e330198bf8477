"""The shape of wandb's module globals (`wandb.init` puts the run in progress in them
with `set_global`), with wwrun's per-job view, as wwrun puts it on `wandb`."""

import sys

from wwrun.libstate import per_job_attributes

run = None
config = {}


def set_global(run=None, config=None):
    module = sys.modules[__name__]
    if run:
        module.run = run
    if config is not None:
        module.config = config


per_job_attributes(sys.modules[__name__], ("run", "config"))
