"""A ``python -m sgl_vericache.launch_server`` process in its own process group, with its
log file: the tests' servers (``test/conftest.py``) and the soak's (``bench_soak.py``)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parents[1]
STARTUP_TIMEOUT_S = float(os.environ.get("VERICACHE_TEST_STARTUP_TIMEOUT", "600"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A launch_server process in its own process group (``env`` on top of ours), logging to
    ``log_path``."""

    def __init__(self, args: list[str], log_path: Path, env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        cmd = [sys.executable, "-m", "sgl_vericache.launch_server", "--port", str(self.port), *args]
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     env={**os.environ, **(env or {})}, start_new_session=True)

    def log_tail(self, n: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if requests.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(2)
        self.stop()
        raise RuntimeError(f"server not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def alive(self) -> bool:
        return self.proc.poll() is None

    def healthy(self, timeout: float = 300) -> bool:
        """Alive, and ``/health_generate`` (a real one-token generation) answers 200."""
        try:
            return self.alive() and requests.get(self.url + "/health_generate", timeout=timeout).status_code == 200
        except requests.RequestException:
            return False

    def rss_mb(self) -> float:
        """Resident memory of the whole process group (server, scheduler, detokenizer), MB."""
        out = subprocess.run(["ps", "-o", "rss=", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout
        return round(sum(int(x) for x in out.split()) / 1024, 1)

    def cpu_seconds(self) -> float:
        """CPU time (user + system) the process group's live members have used so far, seconds."""
        pids = subprocess.run(["ps", "-o", "pid=", "-g", str(self.proc.pid)], capture_output=True, text=True).stdout
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0.0
        for pid in pids.split():
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # it left meanwhile
                continue
            total += (int(fields[11]) + int(fields[12])) / ticks  # utime, stime (fields 14, 15)
        return total

    def group_alive(self) -> bool:
        try:
            os.killpg(self.proc.pid, 0)
        except ProcessLookupError:
            return False
        # zombies still count for killpg; look for live members
        out = subprocess.run(["ps", "-o", "stat=", "-g", str(self.proc.pid)], capture_output=True, text=True)
        return any(s and not s.startswith("Z") for s in out.stdout.split())

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60) -> bool:
        """Signal the server; True when the whole process group left within ``timeout``."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.group_alive():
            time.sleep(0.5)
        clean = not self.group_alive()
        if not clean:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(timeout=30)
        self._log.close()
        return clean
