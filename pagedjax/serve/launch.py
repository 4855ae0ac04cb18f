"""`pagedjax serve` as a child process: what the online benchmark and the server tests start.

    proc, url = start_server("tiny-random", ["--max-model-len", "128"], stdout=log_file)
    ...
    stop_server(proc)      # SIGTERM: in-flight requests are aborted, the server exits
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, flags: list[str], *, stdout=None, env: dict | None = None,
                 timeout: float = 600) -> tuple[subprocess.Popen, str]:
    """Start `python -m pagedjax.cli serve model --port <free> *flags` (stdout and stderr to
    `stdout`), wait until /health answers; returns (process, base url). RuntimeError if it exits or
    does not answer within `timeout` seconds (it is killed then)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "pagedjax.cli", "serve", model, "--port", str(port), *flags,
                             "--log-level", "warning"], stdout=stdout, stderr=subprocess.STDOUT,
                            env=dict(os.environ, **(env or {})), text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/health", timeout=1) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.3)
    if proc.poll() is None:
        proc.kill()
        proc.wait()
        problem = f"the server did not answer /health within {timeout:.0f} s"
    else:
        problem = f"the server exited with code {proc.returncode} before answering /health"
    output = proc.stdout.read()[-3000:] if stdout == subprocess.PIPE else ""
    raise RuntimeError(problem + (f"; its output ends:\n{output}" if output else ""))


def stop_server(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM, then kill if it has not exited within `timeout` seconds; returns its exit code."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
    return proc.wait()
