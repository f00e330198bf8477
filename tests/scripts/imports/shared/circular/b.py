from circular import note, spin

note("start", __name__)
spin()
from circular.c import C_LATE  # noqa: E402

B_LATE = C_LATE
note("end", __name__)
