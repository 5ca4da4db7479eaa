"""A real ``localllm serve`` subprocess for tests and benchmarks: start, wait for its ready line, stop."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

_READY = re.compile(r"localllm serving .* at (http://\S+)")


def default_route_is_batch_invariant() -> bool:
    """Whether the backend a CPU engine selects by default says its rows do not depend on their batch
    (the native kernels' route, where they build)."""
    from localllm.kernels.select import select_backend

    return select_backend("auto", "cpu").batch_invariant


def batch_invariant_env() -> dict[str, str]:
    """The environment in which a server's greedy text does not depend on what shares its steps:
    the default where that route is batch-invariant, else the float32 reference path
    (``LOCALLLM_CPU_FAST=0``: torch's int4 route picks its GEMM by the step's row count, so
    concurrent and solo texts may part at near-ties)."""
    return {} if default_route_is_batch_invariant() else {"LOCALLLM_CPU_FAST": "0"}


def serve_command() -> list[str]:
    """``localllm serve`` through the main CLI."""
    return [sys.executable, "-m", "localllm.cli", "serve"]


class ServerProcess:
    """``localllm serve MODEL --port 0 ARGS`` with its output in files; ``url`` once ready. Without a
    MODEL (None), the server offers its store's models (LOCALLLM_HOME), each loaded on demand."""

    def __init__(self, model: str | os.PathLike | None, *args: str, env: dict[str, str] | None = None) -> None:
        self.log_dir = Path(tempfile.mkdtemp(prefix="localllm-serve-"))
        self.stdout_path = self.log_dir / "stdout"
        self.stderr_path = self.log_dir / "stderr"
        self.url: str | None = None
        model_args = [str(model)] if model is not None else []
        cmd = [*serve_command(), *model_args, "--host", "127.0.0.1", "--port", "0", *args]
        with open(self.stdout_path, "wb") as out, open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=err, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 180.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = _READY.search(self.stdout_path.read_text(errors="replace"))
            if m:
                self.url = m.group(1)
                return self.url
            if self.proc.poll() is not None:
                raise RuntimeError(f"localllm serve exited with {self.proc.returncode}:\n{self.output()}")
            time.sleep(0.1)
        self.kill()
        raise RuntimeError(f"localllm serve was not ready after {timeout:.0f}s:\n{self.output()}")

    def output(self) -> str:
        return self.stdout_path.read_text(errors="replace") + self.stderr_path.read_text(errors="replace")

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM, then wait; the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@contextmanager
def serving(model: str | os.PathLike | None, *args: str, env: dict[str, str] | None = None):
    """A ready :class:`ServerProcess` for the ``with`` block (killed after it)."""
    proc = ServerProcess(model, *args, env=env)
    try:
        proc.wait_ready()
        yield proc
    finally:
        proc.kill()
