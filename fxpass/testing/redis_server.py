"""A throwaway ``redis-server`` on a free localhost port, for the remote cache's tests and
benchmarks (and a device author's own): a real server, never a mock, started and stopped in
bounded time, persisting nothing.

    with RedisServer() as r:
        os.environ["FXPASS_REMOTE_CACHE"] = r.url
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Any

START_TIMEOUT_S = 10.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """``redis-server`` on 127.0.0.1 (no persistence, its own scratch directory)."""

    def __init__(self, *extra: str, binary: str = "redis-server") -> None:
        exe = shutil.which(binary)
        if exe is None:
            raise FileNotFoundError(
                f"{binary} is not installed (Debian: apt-get install -y redis-server)")
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._dir = tempfile.TemporaryDirectory(prefix="fxpass-redis-")
        self.proc = subprocess.Popen(
            [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
             "--appendonly", "no", "--dir", self._dir.name, *extra],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_up()

    def _wait_up(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            time.sleep(0.05)
        self.stop()
        raise TimeoutError(f"redis-server did not answer on port {self.port} within "
                           f"{START_TIMEOUT_S} s")

    def client(self) -> Any:
        import redis

        return redis.Redis.from_url(self.url, socket_timeout=2)

    def stop(self) -> None:
        """Kill it (as a crash would) and wait, bounded."""
        if self.proc.poll() is None:
            self.proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=START_TIMEOUT_S)
        self._dir.cleanup()

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
