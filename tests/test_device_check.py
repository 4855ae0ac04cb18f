"""scripts/device_check.py is the one command to run when an accelerator is present; here its CPU
path runs end to end (kernels interpreted, the tiny random model) so that it is not dead code."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_device_check_runs_every_check_on_cpu(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device_check.py"), "--out", str(tmp_path)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["platform"] == "cpu" and report["ok"]
    assert list(report["checks"]) == ["kernels", "bench_kernel", "bench_step", "serving"]
    kernels = report["checks"]["kernels"]["data"]
    assert len(kernels["errors"]) == 12 and all(e <= 2e-2 for e in kernels["errors"].values())
    step = report["checks"]["bench_step"]["data"]
    assert step["backend"] == "pallas" and all(r["new_compilations"] == 0 for r in step["rows"])
    serving = report["checks"]["serving"]["data"]["workloads"]["mixed"]["systems"]
    assert set(serving) == {"continuous", "static", "contiguous"}
    assert "| kernels | ok |" in proc.stdout


def test_device_check_refuses_a_bad_budget():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "device_check.py"), "--budget", "0"],
                          capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=120)
    assert proc.returncode == 2 and "--budget must be > 0" in proc.stderr
