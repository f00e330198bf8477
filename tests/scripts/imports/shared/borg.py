"""The shape of accelerate's state classes (a Borg: every instance's `__dict__` is one
class attribute dict), with wwrun's per-job view of that dict, as wwrun puts it on
`accelerate.state`'s `PartialState`, `AcceleratorState` and `GradientState`."""

from wwrun.libstate import _PerJobSharedState


class GradientState:
    _shared_state = _PerJobSharedState({})

    def __init__(self, accumulation_steps=None):
        self.__dict__ = self._shared_state
        if accumulation_steps is not None:
            self.accumulation_steps = accumulation_steps
