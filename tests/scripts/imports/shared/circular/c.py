from circular import note, spin

note("start", __name__)
C = spin()
from circular.a import A  # noqa: E402

C_LATE = A + C
note("end", __name__)
