"""A ``vllm-dflash2 serve`` subprocess for benchmarks and tests."""

from __future__ import annotations

from pathlib import Path


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``vllm-dflash2 serve TARGET ARGS...`` subprocess on 127.0.0.1, for tests and
    benchmarks: started in its own session (so stopping it takes the engine core and
    worker along), healthy on return from ``start``; a context manager."""

    def __init__(self, target, args: list[str], log_path, *, env: dict | None = None,
                 timeout: float = 300):
        self.target, self.args, self.log = str(target), list(args), Path(log_path)
        self.env, self.timeout = env, timeout
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = None

    def start(self) -> "Server":
        import os
        import subprocess
        import sys
        import time

        cli = os.path.join(os.path.dirname(sys.executable), "vllm-dflash2")
        cmd = [cli, "serve", self.target, "--host", "127.0.0.1", "--port", str(self.port),
               *self.args]
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                         env=dict(os.environ, **(self.env or {})),
                                         start_new_session=True)
        deadline = time.time() + self.timeout
        while not self.healthy(timeout=2):
            if self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.time() > deadline:
                self.stop()
                raise RuntimeError(f"server did not become healthy in {self.timeout:.0f} s:\n"
                                   + self.log_tail())
            time.sleep(1)
        return self

    def healthy(self, timeout: float = 10) -> bool:
        import urllib.request

        try:
            with urllib.request.urlopen(self.base + "/health", timeout=timeout) as r:
                return r.status == 200
        except OSError:
            return False

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text()[-chars:] if self.log.exists() else ""

    def stop(self) -> None:
        import os
        import signal
        import subprocess

        if self.proc is None:
            return
        try:  # the whole group: an exited API server can leave its engine behind
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def __enter__(self) -> "Server":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
