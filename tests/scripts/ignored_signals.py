"""Says whether SIGHUP is ignored, then sends itself one. Started under `nohup` (SIGHUP
ignored), a `python` process keeps it ignored and goes on."""

import os
import signal

print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN)
os.kill(os.getpid(), signal.SIGHUP)
print("survived")
