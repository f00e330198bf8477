"""A library with a service process, as wandb has: the teardown it registers with
atexit when the service starts tells the service to finish, and the service then
writes what it holds (wandb's: the runs a script left open). Its telemetry provider
registers its own shutdown with atexit, which the teardown calls first and which
then unregisters itself, as opentelemetry's MeterProvider does. Its workers are stopped
by a `threading._register_atexit` hook, as joblib's loky executor's are."""

import atexit
import subprocess
import sys
import threading

SERVICE = "import sys; sys.stdin.read(); open(sys.argv[1], 'w').write('finished')"


class Provider:
    def __init__(self, path: str):
        self.path = path
        atexit.register(self.shutdown)

    def shutdown(self):
        with open(self.path, "a") as f:
            f.write("shutdown\n")
        atexit.unregister(self.shutdown)


def start(path: str) -> None:
    provider = Provider(f"{path}.provider")
    service = subprocess.Popen([sys.executable, "-c", SERVICE, path], stdin=subprocess.PIPE)

    def teardown():
        provider.shutdown()
        service.stdin.close()
        service.wait(timeout=60)

    atexit.register(teardown)

    def stop_workers():
        with open(f"{path}.hook", "w") as f:
            f.write("workers stopped")

    threading._register_atexit(stop_workers)
