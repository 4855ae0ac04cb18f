"""The server tests' shared piece: `pagedjax serve` in a subprocess (pagedjax.serve.launch)."""

from __future__ import annotations

import contextlib
import subprocess
import time

import pytest

from pagedjax.serve.launch import start_server, stop_server


@contextlib.contextmanager
def running_server(model: str, engine: dict):
    """Start `pagedjax serve model` with `engine` as flags on the CPU; yields (url, process) and
    ends it with SIGTERM. The process's output is a pipe the tests may read."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in engine.items()]
    try:
        proc, url = start_server(model, flags, stdout=subprocess.PIPE, env={"JAX_PLATFORMS": "cpu"}, timeout=180)
    except RuntimeError as e:
        pytest.fail(f"the server did not start: {e}")
    try:
        yield url, proc
    finally:
        stop_server(proc)


def eventually(condition, polls: int = 400, pause: float = 0.05) -> bool:
    """Whether `condition()` holds within `polls` polls (the server applies aborts on its own
    thread, so its state is only eventually what the client caused)."""
    for _ in range(polls):
        if condition():
            return True
        time.sleep(pause)
    return condition()
