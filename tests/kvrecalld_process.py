"""kvrecalld as a subprocess for the Python tests: started with flags on loopback ports it picks
itself (--address=127.0.0.1:0 --metrics_address=127.0.0.1:0 unless the flags say otherwise),
its addresses read from what it prints, stopped with SIGTERM."""
import os
import re
import signal
import subprocess
import tempfile
import time

SOURCE_DIR = os.environ.get("KVRECALL_SOURCE_DIR",
                            os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def binary():
    return os.environ.get("KVRECALLD", os.path.join(SOURCE_DIR, "build", "server", "kvrecalld"))


class Kvrecalld:
    """A running kvrecalld: `address` (gRPC), `metrics_url` (http://HOST:PORT/metrics or None),
    `health_address` (the plaintext health port or None)."""

    def __init__(self, *flags, timeout=30):
        defaults = [f for f in ("--address=127.0.0.1:0", "--metrics_address=127.0.0.1:0")
                    if not any(x.startswith(f.split("=")[0] + "=") for x in flags)]
        self._log = tempfile.TemporaryFile()
        self.process = subprocess.Popen([binary(), *defaults, *flags], stdout=self._log,
                                        stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            out = self.log()
            listening = re.search(r"^kvrecalld listening on (\S+)$", out, re.M)
            if listening:
                break
            if self.process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"kvrecalld did not start: {out}")
            time.sleep(0.05)
        self.address = listening.group(1)
        metrics = re.search(r"^kvrecalld metrics on (\S+)$", out, re.M)
        self.metrics_url = metrics.group(1) if metrics else None
        health = re.search(r"^kvrecalld health on (\S+)$", out, re.M)
        self.health_address = health.group(1) if health else None

    def log(self):
        if self._log.closed:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")

    def stop(self, timeout=30):
        """SIGTERM, then the exit status (SIGKILL after `timeout`)."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()
        return self.process.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
