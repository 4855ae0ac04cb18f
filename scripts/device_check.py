"""The one command to run when an accelerator is present: does pagedjax work, and how fast, on it?

    python scripts/device_check.py [--out results] [--budget 480]

In order, each in its own process with a share of the time budget (default 8 minutes):
  1. kernels   every Pallas kernel (paged decode, ragged, contiguous) in the device's variant,
               compiled for it and tiled for its limits, against the jnp reference, f32 and bf16,
               over pools that are NaN wherever a sequence owns nothing (a wrong read shows);
  2. bench_kernel  scripts/bench_kernel.py --quick: paged vs contiguous decode kernels, bandwidth;
  3. bench_step    scripts/bench_step.py --attention-backend pallas --dtype bfloat16: the whole
               engine step against its matmuls alone, at batch 1, 8, 32;
  4. serving       scripts/bench_serving.py --quick on the mixed workload: continuous vs static
               vs contiguous, TTFT/TPOT/throughput, compilations after warm-up.
Prints one table and writes results/device_check.json (each check's status, seconds, key numbers
and the tail of its output). On a CPU the same checks run small, on the tiny random model, with
the kernels interpreted: that says the script works, not how fast anything is.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="results", help="output directory (default results/)")
    p.add_argument("--budget", type=float, default=480.0, help="seconds for all checks (default 480)")
    p.add_argument("--model", default=None, help="engine checks' model (default smollm2-135m; tiny-random on CPU)")
    args = p.parse_args(argv)
    if args.budget <= 0:
        p.error(f"--budget must be > 0 seconds; got {args.budget}")
    return args


# ---------------------------------------------------------------------------------------------
# 1. kernels against the reference, on the device
# ---------------------------------------------------------------------------------------------


def kernel_check(small: bool) -> dict:
    """Every kernel against its reference; returns {case: max relative error} and the verdict."""
    import functools

    import jax
    import jax.numpy as jnp

    from pagedjax import pallas
    from pagedjax.pallas.testing import paged_case, ragged_case, relative_error, to_contiguous

    limits = pallas.device_limits()
    if small:
        heads, kv_heads, head_dim, blocks = 9, 3, 64, (8, 16)
        seqs, tokens, seats, max_blocks = [(37, 5), (3, 1), (64, 1)], 16, 4, 8
    else:
        heads, kv_heads, head_dim, blocks = 32, 8, 128, (16, 64, 128)
        seqs, tokens, seats, max_blocks = [(1500, 512), (700, 1), (2048, 1), (1, 1), (333, 100)], 640, 8, 128
    results, worst = {}, 0.0
    for dtype in (jnp.float32, jnp.bfloat16):
        tol = 1e-5 if dtype == jnp.float32 else 2e-2
        for bs in blocks:
            mb = max(2, max_blocks * 16 // bs)
            dec = paged_case(bs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                             dtype=dtype, max_blocks=mb)
            q, k, v, tables, lengths = dec
            out = jax.jit(functools.partial(pallas.paged_attention, limits=limits))(*dec)
            ref = jax.jit(pallas.paged_attention_reference)(*dec)
            results[f"paged {jnp.dtype(dtype).name} bs{bs}"] = relative_error(out, ref)
            kc, vc = to_contiguous(k, tables, mb * bs), to_contiguous(v, tables, mb * bs)
            out = jax.jit(functools.partial(pallas.contiguous_attention, limits=limits))(q, kc, vc, lengths)
            ref = jax.jit(pallas.contiguous_attention_reference)(q, kc, vc, lengths)
            results[f"contiguous {jnp.dtype(dtype).name} bs{bs}"] = relative_error(out, ref)
            cap = -(-max(c for c, _ in seqs) // bs)
            args = ragged_case(bs + 1, seqs, block_size=bs, num_heads=heads, num_kv_heads=kv_heads,
                               head_dim=head_dim, dtype=dtype, num_tokens=tokens, num_seats=seats,
                               max_blocks=cap)
            out = jax.jit(functools.partial(pallas.ragged_paged_attention, limits=limits))(*args)
            ref = jax.jit(pallas.ragged_paged_attention_reference)(*args)
            last = int(args[5][int(args[6])])  # rows past the live tokens are padding (NaN q)
            results[f"ragged {jnp.dtype(dtype).name} bs{bs}"] = relative_error(out[:last], ref[:last])
            for key in list(results)[-3:]:
                worst = max(worst, results[key] / tol)
    ok = worst <= 1.0
    summary = f"{len(results)} cases, worst error {worst:.2f} x tolerance (f32 1e-5, bf16 2e-2)"
    return dict(ok=ok, summary=summary, errors=results, device=str(jax.devices()[0]),
                limits=vars(limits))


# ---------------------------------------------------------------------------------------------
# 2-4. the benchmark scripts, each in its own process
# ---------------------------------------------------------------------------------------------


def run_script(name, argv, timeout, out_json):
    t0 = time.perf_counter()
    cmd = [sys.executable, os.path.join(HERE, name), *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=max(10.0, timeout))
        ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
        why = "" if ok else f"exit {proc.returncode}"
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"") + (e.stderr or b"")
        ok, tail, why = False, (out.decode(errors="replace") if isinstance(out, bytes) else out)[-3000:], \
            f"timed out after {timeout:.0f} s"
    data = None
    if ok and out_json and os.path.exists(out_json):
        with open(out_json) as f:
            data = json.load(f)
    return dict(ok=ok, why=why, command=" ".join(cmd[1:]), seconds=time.perf_counter() - t0, tail=tail,
                data=data)


def summarize_bench_kernel(data):
    rows = data.get("rows", [])
    errs = [r["max_rel_err"] for r in rows if r.get("max_rel_err") is not None]
    ratios = [r["shuffled_over_contiguous"] for r in rows
              if r.get("shuffled_over_contiguous") is not None]
    parts = [f"{len(rows)} points"]
    if errs:
        parts.append(f"max err {max(errs):.1e}")
    if ratios:
        parts.append(f"paged(shuffled)/contiguous time {min(ratios):.2f}-{max(ratios):.2f}")
    return ", ".join(parts)


def summarize_bench_step(data):
    rows = data.get("rows", [])
    return "; ".join(f"B={r['batch']}: step {r['step_ms']:.2f} ms ({r['ratio']:.2f}x matmuls), "
                     f"{r['decode_tok_s']:,.0f} tok/s, {r['new_compilations']} compiles" for r in rows)


def summarize_serving(data):
    out = []
    for w, wl in data.get("workloads", {}).items():
        for name, s in wl.get("systems", {}).items():
            sm = s.get("summary", {})
            out.append(f"{w}/{name}: {sm.get('output_throughput', 0):,.0f} out tok/s, "
                       f"TTFT p50 {sm.get('ttft_ms', {}).get('p50', float('nan')):.0f} ms, "
                       f"TPOT p50 {sm.get('tpot_ms', {}).get('p50', float('nan')):.1f} ms")
    return "; ".join(out)


def main(argv=None) -> int:
    args = parse_args(argv)
    import jax

    t_start = time.perf_counter()
    device = jax.devices()[0]
    small = device.platform == "cpu"
    model = args.model or ("tiny-random" if small else "smollm2-135m")
    os.makedirs(args.out, exist_ok=True)
    print(f"jax {jax.__version__}, {device.platform}: {getattr(device, 'device_kind', device)}; model {model}; "
          f"budget {args.budget:.0f} s" + ("  (CPU: small checks, kernels interpreted)" if small else ""),
          flush=True)
    checks = {}

    def left():
        return args.budget - (time.perf_counter() - t_start)

    t0 = time.perf_counter()
    try:
        k = kernel_check(small)
        checks["kernels"] = dict(ok=k["ok"], why="" if k["ok"] else "error above tolerance",
                                 seconds=time.perf_counter() - t0, summary=k["summary"], data=k)
    except Exception as e:  # a compile or runtime failure on the device is the finding
        checks["kernels"] = dict(ok=False, why=f"{type(e).__name__}: {str(e).splitlines()[0][:300]}",
                                 seconds=time.perf_counter() - t0, summary="", data=None)
    print(f"kernels: {checks['kernels']['summary'] or checks['kernels']['why']}", flush=True)

    plan = [
        ("bench_kernel", "bench_kernel.py", ["--quick", "--out", args.out], 0.2,
         os.path.join(args.out, "bench_kernel.json"), summarize_bench_kernel),
        ("bench_step", "bench_step.py",
         ["--model", model, "--attention-backend", "pallas", "--dtype", "bfloat16",
          "--batch", *(["1", "4"] if small else ["1", "8", "32"]), "--steps", "3" if small else "10",
          "--context", "40" if small else "500", "--json", os.path.join(args.out, "device_check_step.json")],
         0.45, os.path.join(args.out, "device_check_step.json"), summarize_bench_step),
        ("serving", "bench_serving.py",
         ["--model", model, "--workloads", "mixed", "--systems", "continuous,static,contiguous", "--quick",
          "--no-capacity", "--no-progress", "--name", "device_check_serving", "--out", args.out,
          *(["--num-requests", "16"] if small else [])],
         1.0, os.path.join(args.out, "device_check_serving.json"), summarize_serving),
    ]
    for name, script, argv_, share, out_json, summarize in plan:
        budget = left() * share if share < 1 else left()
        if budget < 10:
            checks[name] = dict(ok=False, why="no time left in the budget", seconds=0.0, summary="")
            continue
        r = run_script(script, argv_, budget, out_json)
        r["summary"] = summarize(r["data"]) if r["ok"] and r["data"] else ""
        checks[name] = r
        print(f"{name}: {'ok' if r['ok'] else 'FAILED ' + r['why']} ({r['seconds']:.0f} s) {r['summary']}",
              flush=True)
        if not r["ok"]:
            print(r["tail"][-1500:], flush=True)

    total = time.perf_counter() - t_start
    print("\n| check | result | seconds | summary |\n|---|---|--:|---|")
    for name, c in checks.items():
        print(f"| {name} | {'ok' if c['ok'] else 'FAILED: ' + c['why']} | {c['seconds']:.0f} | {c.get('summary', '')} |")
    print(f"\n{total:.0f} s in all on {getattr(device, 'device_kind', device)}")
    path = os.path.join(args.out, "device_check.json")
    with open(path, "w") as f:
        json.dump(dict(jax=jax.__version__, device=str(device), platform=device.platform, model=model,
                       seconds=total, ok=all(c["ok"] for c in checks.values()), checks=checks), f, indent=1,
                  default=str)
    print(f"wrote {path}")
    return 0 if all(c["ok"] for c in checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
