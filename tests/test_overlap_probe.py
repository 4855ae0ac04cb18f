"""scripts/bench_overlap.py builds its probe and prints one line per way of running it (the figures
themselves are the benchmark's to report, not a test's)."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
FLAGS = pathlib.Path("/proc/cpuinfo").read_text() if pathlib.Path("/proc/cpuinfo").exists() else ""


@pytest.mark.skipif("avx512_bf16" not in FLAGS, reason="the probe needs AVX-512 with AVX512_BF16")
def test_overlap_probe_runs_every_mode():
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_overlap.py"), "--batch", "4", "--context",
                          "160", "--layers", "2", "--matmul-ms", "1", "--rounds", "1", "--reps", "1"],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    rows = {line.split()[0]: line.split()[1:4] for line in out.splitlines()
            if line.split() and line.split()[0] in ("none", "overlap", "sparse")}
    assert set(rows) == {"none", "overlap", "sparse"}, out
    for compute, attend, total in rows.values():
        assert float(compute) > 0 and float(attend) >= 0
        assert abs(float(compute) + float(attend) - float(total)) < 0.2, out


def test_overlap_probe_refuses_other_cpus_by_name(monkeypatch, tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_overlap
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(bench_overlap, "cpu_flags", lambda: "fpu sse2 avx2")
    with pytest.raises(SystemExit, match="AVX512_BF16"):
        bench_overlap.build(str(tmp_path))
