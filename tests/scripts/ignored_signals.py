"""Says whether SIGHUP and SIGINT are ignored, then sends itself both. Started as
`nohup` (SIGHUP ignored) in a non-interactive shell's background (SIGINT ignored) does,
a `python` process keeps both ignored and goes on."""

import os
import signal

print(signal.getsignal(signal.SIGHUP) is signal.SIG_IGN, signal.getsignal(signal.SIGINT) is signal.SIG_IGN)
os.kill(os.getpid(), signal.SIGHUP)
os.kill(os.getpid(), signal.SIGINT)
print("survived")
