from circular import note, spin

note("start", __name__)
A = spin()
from circular.c import C  # noqa: E402

A_LATE = A + C
note("end", __name__)
