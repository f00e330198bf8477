"""A library with a service process, as wandb has: the teardown it registers with
atexit when the service starts tells the service to finish, and the service then
writes what it holds (wandb's: the runs a script left open)."""

import atexit
import subprocess
import sys

SERVICE = "import sys; sys.stdin.read(); open(sys.argv[1], 'w').write('finished')"


def start(path: str) -> None:
    service = subprocess.Popen([sys.executable, "-c", SERVICE, path], stdin=subprocess.PIPE)

    def teardown():
        service.stdin.close()
        service.wait(timeout=60)

    atexit.register(teardown)
