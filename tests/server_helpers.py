"""The server tests' shared piece: `pagedjax serve` in a subprocess on a free port."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(model: str, engine: dict):
    """Start `pagedjax serve model` with `engine` as flags, wait for /health; yields (url, process)
    and ends it with SIGTERM."""
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.Popen([sys.executable, "-m", "pagedjax.cli", "serve", model, "--port", str(port), *flags,
                             "--log-level", "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while True:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            pytest.fail("the server did not start:\n" + proc.stdout.read()[-3000:])
        time.sleep(0.3)
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)


def eventually(condition, polls: int = 400, pause: float = 0.05) -> bool:
    """Whether `condition()` holds within `polls` polls (the server applies aborts on its own
    thread, so its state is only eventually what the client caused)."""
    for _ in range(polls):
        if condition():
            return True
        time.sleep(pause)
    return condition()
