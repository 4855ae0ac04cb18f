"""Whether a decode step could hide its KV reads behind its matmuls on this CPU.

Builds and runs scripts/overlap_probe.cc (g++, AVX-512 with AVX512_BF16): per layer, a compute
phase shaped like the native matmul's inner loop, sized so that 30 layers of it take
--matmul-ms (the matmul-only step that scripts/bench_step.py measures), then an attention phase
reading every line of the layer's bf16 K/V pages of --batch sequences at --context tokens in a
scattered block order. Three ways, interleaved over --rounds rounds:

  none      the compute phase asks for nothing (the step as it runs)
  overlap   the compute phase asks for every line of the coming attention's pages (software
            prefetches into L2, a share after each pass of its loop)
  sparse    the same, one line in 8

If the memory worked while the cores multiplied, `overlap` would keep the compute phase's time
and cut the attention's; the sum of the two is what a step would pay.

    python scripts/bench_overlap.py [--batch 32] [--context 916] [--matmul-ms 44] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

MODES = {"none": 0, "overlap": 1, "sparse": 2}


def cpu_flags() -> str:
    if not os.path.exists("/proc/cpuinfo"):
        return ""
    with open("/proc/cpuinfo") as f:
        return f.read()


def build(out_dir: str) -> str:
    source = os.path.join(os.path.dirname(os.path.abspath(__file__)), "overlap_probe.cc")
    binary = os.path.join(out_dir, "overlap_probe")
    if "avx512_bf16" not in cpu_flags().split():
        sys.exit("bench_overlap: the probe needs a CPU with AVX-512 and AVX512_BF16 (its attention phase "
                 "reads bf16 pages with pair products, as the native kernel does there)")
    subprocess.run(["g++", "-O3", "-march=native", "-pthread", source, "-o", binary], check=True)
    return binary


def probe(binary: str, mode: int, passes: int, args, reps: int) -> tuple[float, float]:
    out = subprocess.run([binary, str(mode), str(passes), str(args.batch), str(args.context), str(args.layers),
                          str(args.kv_heads), str(reps)], check=True, capture_output=True, text=True).stdout
    compute, attend, _ = out.split()
    return float(compute), float(attend)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--context", type=int, default=916, help="cached tokens per sequence")
    p.add_argument("--layers", type=int, default=30, help="SmolLM2-135M's")
    p.add_argument("--kv-heads", type=int, default=3, help="SmolLM2-135M's (head dim 64)")
    p.add_argument("--matmul-ms", type=float, default=44.0,
                   help="what the compute phase of all layers should take: the matmul-only step")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--reps", type=int, default=2, help="steps timed per run (after one untimed)")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        binary = build(tmp)
        trial = 2000
        compute, _ = probe(binary, 0, trial, args, 1)
        passes = max(1, round(trial * args.matmul_ms / compute))
        pool_mb = 2 * args.layers * args.kv_heads * args.batch * -(-args.context // 16) * 2048 / 1e6
        print(f"{args.batch} sequences x {args.context} cached tokens, {args.layers} layers x {args.kv_heads} kv heads: "
              f"{pool_mb:.0f} MB of bf16 K/V read a step; compute phase {passes} passes a layer "
              f"(~{args.matmul_ms:g} ms a step)")
        runs: dict[str, list[tuple[float, float]]] = {name: [] for name in MODES}
        for _ in range(args.rounds):
            for name, mode in MODES.items():
                runs[name].append(probe(binary, mode, passes, args, args.reps))
        print(f"{'mode':<8} {'compute ms':>11} {'attention ms':>13} {'sum ms':>8}   (median of {args.rounds} rounds; every round)")
        for name, rs in runs.items():
            c = statistics.median(r[0] for r in rs)
            a = statistics.median(r[1] for r in rs)
            s = statistics.median(r[0] + r[1] for r in rs)
            every = ", ".join(f"{r[0]:.1f}+{r[1]:.1f}" for r in rs)
            print(f"{name:<8} {c:11.1f} {a:13.1f} {s:8.1f}   {every}")
        base = statistics.median(r[0] + r[1] for r in runs["none"])
        best = min(statistics.median(r[0] + r[1] for r in rs) for rs in runs.values())
        plain_read_ms = statistics.median(r[1] for r in runs["none"])
        if plain_read_ms > 0 and base > 0:
            print(f"attention reading at {pool_mb / plain_read_ms:.1f} GB/s with no overlap; the best mode's step "
                  f"{best / base:.2f} of the plain one's")


if __name__ == "__main__":
    main()
