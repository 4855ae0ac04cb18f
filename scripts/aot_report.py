"""The engine step compiled for TPUs and NVIDIA GPUs on this machine, and what it costs on paper.

For each target (pagedjax.aot.TARGETS) and each model shape (SmolLM2-135M, and a Llama-3-8B-shaped
config), the whole engine step -- embedding, 30/32 scanned layers with the Pallas ragged paged
attention tiled for that device, the head, greedy sampling and the sampler -- is compiled by the
real compiler (libtpu; XLA:GPU + Triton + ptxas) at decode batch {1, 8, 32, 128, 256} x context
{512, 2048, 8192}, bf16 weights and KV pool, every sequence at the full context, a pool of
exactly the blocks they hold. Nothing runs: this is compiled-and-estimated.

Per point: weights, KV pool and temporary bytes (memory_analysis of the step as the engine runs
it); flops and bytes accessed (the compiler's cost analysis, every layer counted: see
pagedjax.aot.compile_engine_step); the bytes a decode step cannot avoid (every weight once, every
cached K/V once, the new K/V written); and a roofline estimate from the chip's published peak HBM
bandwidth and bf16 FLOP/s: a lower bound on the step time of the compiled program (and of the
ideal one), the decode tokens/s it allows, and what the sampler adds when a row samples
(temperature > 0; greedy steps skip it).
A point whose weights and pool exceed the chip's HBM is listed as not fitting, uncompiled.

Then the decode kernels alone, paged against contiguous at equal work (Llama-3-8B's attention:
32 query heads over 8 kv heads of 128, bf16, batch x context as above): the bytes each must move,
what the block tables add, the granularity of its reads (a page, against a contiguous step), and
each compiled program's temporary bytes.

    python scripts/aot_report.py [--quick] [--targets tpu-v5e h100] [--models llama-3-8b]

Writes results/aot_report.json and prints markdown tables (the README's "Accelerators: compiled,
not yet run" section is this output).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from pagedjax import aot  # noqa: E402

BATCHES = (1, 8, 32, 128, 256)
CONTEXTS = (512, 2048, 8192)
BLOCK_SIZE = 16


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--targets", nargs="+", default=list(aot.TARGETS), choices=list(aot.TARGETS))
    p.add_argument("--models", nargs="+", default=list(aot.model_shapes()), choices=list(aot.model_shapes()))
    p.add_argument("--batch", type=int, nargs="+", default=list(BATCHES))
    p.add_argument("--context", type=int, nargs="+", default=list(CONTEXTS))
    p.add_argument("--quick", action="store_true", help="batch 1 and 32, context 2048 only")
    p.add_argument("--skip-kernels", action="store_true", help="no paged-vs-contiguous kernel table")
    p.add_argument("--grid", action="store_true",
                   help="also compile every kernel over the test grid (pagedjax.aot.kernel_cases) per target")
    p.add_argument("--markdown", default=None, help="also write the tables to this markdown file")
    p.add_argument("--from-json", default=None,
                   help="render the tables of an earlier run's aot_report.json instead of compiling")
    p.add_argument("--resume", action="store_true",
                   help="keep the points an earlier (interrupted) run wrote to OUT/aot_report.json")
    p.add_argument("--out", default="results", help="output directory (default results/)")
    args = p.parse_args(argv)
    if args.quick:
        args.batch, args.context = [1, 32], [2048]
    for name, values in (("--batch", args.batch), ("--context", args.context)):
        if any(v < 1 for v in values):
            p.error(f"{name} values must be >= 1; got {values}")
    if any(c % BLOCK_SIZE for c in args.context):
        p.error(f"--context values must be multiples of the block size {BLOCK_SIZE}; got {args.context}")
    return args


def kv_bytes_per_token(cfg, dtype):
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(dtype).itemsize


def weight_bytes(cfg, dtype):
    from pagedjax.model.llama import param_shapes
    import math

    leaves = jax.tree.leaves(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    return sum(math.prod(s) for s in leaves) * jnp.dtype(dtype).itemsize


def step_point(target, model, cfg, batch, context, dtype):
    t = aot.get_target(target)
    pages = context // BLOCK_SIZE
    weights = weight_bytes(cfg, dtype)
    pool = batch * context * kv_bytes_per_token(cfg, dtype)
    row = dict(target=target, model=model, batch=batch, context=context, weight_bytes=weights,
               kv_pool_bytes=pool)
    # every weight read once, every cached token's K/V read once, the step's K/V written
    ideal = weights + pool + batch * kv_bytes_per_token(cfg, dtype)
    row["ideal_bytes"] = ideal
    if weights + pool > t.chip.hbm_bytes:
        row["status"] = f"does not fit: weights + pool {(weights + pool) / 1e9:.1f} GB > {t.chip.hbm_bytes / 1e9:.0f} GB HBM"
        return row
    t0 = time.perf_counter()
    try:
        sc = aot.compile_engine_step(t, cfg, num_tokens=batch, num_seqs=batch, pages=pages,
                                     num_blocks=batch * pages + 1, block_size=BLOCK_SIZE, dtype=dtype)
    except Exception as e:  # e.g. XLA:TPU: weights + pool + temporaries exceed HBM
        row["status"] = "compile error: " + str(e).strip().splitlines()[0][:200]
        return row
    mem = sc.program.memory
    rf = aot.roofline(t.chip, sc.flops, sc.bytes_accessed)
    sampler = aot.roofline(t.chip, sc.sampler.cost["flops"], sc.sampler.cost["bytes_accessed"])
    ideal_s = max(sc.flops / t.chip.bf16_flops, ideal / t.chip.hbm_bandwidth)
    row.update(status="compiled", compile_seconds=round(time.perf_counter() - t0, 1),
               temp_bytes=mem["temp_bytes"], argument_bytes=mem["argument_bytes"],
               alias_bytes=mem["alias_bytes"], device_bytes=sc.program.device_bytes,
               flops=sc.flops, bytes_accessed=sc.bytes_accessed, cost_source=sc.program.cost_source,
               step_seconds=rf["seconds"], bound=rf["bound"], tokens_per_s=batch / rf["seconds"],
               ideal_step_seconds=ideal_s, ideal_tokens_per_s=batch / ideal_s,
               sampler_bytes=sc.sampler.cost["bytes_accessed"], sampler_seconds=sampler["seconds"])
    return row


def kernel_point(target, batch, context, dtype=jnp.bfloat16, heads=32, kv_heads=8, head_dim=128):
    """Paged and contiguous decode kernels compiled at equal work."""
    from pagedjax import pallas

    t = aot.get_target(target)
    S = jax.ShapeDtypeStruct
    isz = jnp.dtype(dtype).itemsize
    pages = context // BLOCK_SIZE
    pool = S((kv_heads, batch * pages + 1, BLOCK_SIZE, head_dim), dtype)
    q = S((batch, heads, head_dim), dtype)
    lens = S((batch,), jnp.int32)
    kv = 2 * batch * kv_heads * context * head_dim * isz
    if kv + kv > t.chip.hbm_bytes:  # both caches side by side
        return dict(target=target, batch=batch, context=context, status="does not fit")
    paged = aot.compile(lambda *a: pallas.paged_attention(*a, limits=t.limits), q, pool, pool,
                        S((batch, pages), jnp.int32), lens, target=t)
    cache = S((batch, kv_heads, context, head_dim), dtype)
    contiguous = aot.compile(lambda *a: pallas.contiguous_attention(*a, limits=t.limits), q, cache, cache,
                             lens, target=t)
    tables = batch * pages * 4
    # the unit of a read: a page per DMA on TPU (one copy per page and kv head); on GPU a step of
    # the gather covers whole pages, a contiguous step one slice
    row = dict(target=target, batch=batch, context=context, status="compiled", kv_bytes=kv,
               table_bytes=tables, indirection=tables / kv,
               paged_read_bytes=BLOCK_SIZE * head_dim * isz,
               paged_bytes=paged.cost["bytes_accessed"], contiguous_bytes=contiguous.cost["bytes_accessed"],
               paged_temp=paged.memory["temp_bytes"], contiguous_temp=contiguous.memory["temp_bytes"],
               paged_seconds=aot.roofline(t.chip, paged.cost["flops"], paged.cost["bytes_accessed"])["seconds"],
               contiguous_seconds=aot.roofline(t.chip, contiguous.cost["flops"],
                                               contiguous.cost["bytes_accessed"])["seconds"])
    return row


def gb(x):
    return f"{x / 1e9:.2f}"


def steps_table(rows) -> str:
    out = ["### The engine step, compiled and estimated (bf16, block size 16, every sequence at the full context)",
           "",
           "| target | model | batch | context | weights GB | KV pool GB | temp GB | GFLOP | GB accessed | "
           "ideal GB | bound | step ms (lower bound) | ideal step ms | decode tok/s (upper bound) | + sampler ms |",
           "|---|---|--:|--:|--:|--:|--:|--:|--:|--:|---|--:|--:|--:|--:|"]
    for r in rows:
        head = f"| {r['target']} | {r['model']} | {r['batch']} | {r['context']} | {gb(r['weight_bytes'])} | {gb(r['kv_pool_bytes'])} |"
        if r["status"] != "compiled":
            out.append(head + f" {r['status']} ||||||||||")
            continue
        out.append(head + f" {gb(r['temp_bytes'])} | {r['flops'] / 1e9:.1f} | {gb(r['bytes_accessed'])} | "
                   f"{gb(r['ideal_bytes'])} | {r['bound']} | {r['step_seconds'] * 1e3:.2f} | "
                   f"{r['ideal_step_seconds'] * 1e3:.2f} | {r['tokens_per_s']:,.0f} | "
                   f"{r['sampler_seconds'] * 1e3:.2f} |")
    return "\n".join(out)


def kernels_table(rows) -> str:
    out = ["### Decode kernels, paged against contiguous at equal work (32 q / 8 kv heads of 128, bf16, block 16)",
           "",
           "| target | batch | context | K/V GB | block tables KB | tables / K/V | paged read unit | "
           "paged GB (est.) | contiguous GB (est.) | paged temp MB | contiguous temp MB | paged µs | contiguous µs |",
           "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|"]
    for r in rows:
        if r["status"] != "compiled":
            out.append(f"| {r['target']} | {r['batch']} | {r['context']} | {r['status']} |||||||||")
            continue
        out.append(f"| {r['target']} | {r['batch']} | {r['context']} | {gb(r['kv_bytes'])} | "
                   f"{r['table_bytes'] / 1e3:.1f} | {r['indirection'] * 100:.3f} % | {r['paged_read_bytes'] // 1024} KiB | "
                   f"{gb(r['paged_bytes'])} | {gb(r['contiguous_bytes'])} | {r['paged_temp'] / 1e6:.1f} | "
                   f"{r['contiguous_temp'] / 1e6:.1f} | {r['paged_seconds'] * 1e6:.1f} | {r['contiguous_seconds'] * 1e6:.1f} |")
    return "\n".join(out)


def grid_table(rows) -> str:
    out = ["### The kernel grid (pagedjax.aot.kernel_cases: every kernel in the target's variant)", "",
           "| target | compiled | failed | seconds |", "|---|--:|--:|--:|"]
    out += [f"| {r['target']} | {r['compiled']} / {r['cases']} | {len(r['failures'])} | {r['seconds']:.0f} |" for r in rows]
    for r in rows:
        out += [f"- {r['target']}: {f}" for f in r["failures"]]
    return "\n".join(out)


def grid_point(target) -> dict:
    t0 = time.perf_counter()
    cases = aot.kernel_cases()
    failures = []
    for kernel, case in cases:
        try:
            aot.compile_kernel(target, kernel, case)
        except Exception as e:  # the compiler's own words, first line
            failures.append(f"{kernel} {case}: {str(e).strip().splitlines()[0][:200]}")
    return dict(target=target, cases=len(cases), compiled=len(cases) - len(failures), failures=failures,
                seconds=time.perf_counter() - t0)


def chips_text(chips: dict) -> str:
    return "\n".join(f"- {t}: {c['name']}, {c['bf16_flops'] / 1e12:.0f} TFLOP/s bf16, "
                     f"{c['hbm_bandwidth'] / 1e9:,.0f} GB/s, {c['hbm_bytes'] / 1e9:.0f} GB ({c['source']})"
                     for t, c in chips.items())


def render(report: dict) -> str:
    parts = [f"Compiled with jax {report['jax']} on a machine without an accelerator; every figure is the "
             f"compiler's or a roofline estimate from published peaks, nothing ran on an accelerator.",
             chips_text(report["chips"])]
    if report.get("grid"):
        parts.append(grid_table(report["grid"]))
    parts.append(steps_table(report["steps"]))
    if report.get("kernels"):
        parts.append(kernels_table(report["kernels"]))
    return "\n\n".join(parts) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            text = render(json.load(f))
        print(text)
        if args.markdown:
            with open(args.markdown, "w") as f:
                f.write(text)
        return
    for t in args.targets:
        why = aot.available(t)
        if why is not None:
            sys.exit(f"cannot compile for {t}: {why}")
    print(f"jax {jax.__version__}; deviceless compilation; every number below is compiled and estimated, "
          f"nothing ran on an accelerator")
    chips = {t: vars(aot.get_target(t).chip) for t in args.targets}
    print(chips_text(chips))
    t0 = time.perf_counter()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "aot_report.json")
    report = dict(jax=jax.__version__, block_size=BLOCK_SIZE, grid=[], steps=[], kernels=[], chips=chips,
                  command=" ".join(["python", "scripts/aot_report.py", *(argv or sys.argv[1:])]))
    if args.resume and os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        for k in ("grid", "steps", "kernels"):
            report[k] = earlier.get(k, [])
        report["chips"] = {**earlier.get("chips", {}), **chips}

    def done(kind, **key):
        return any(all(r.get(k) == v for k, v in key.items()) for r in report[kind])

    def save(kind, row):
        # every point is written as it comes (a run of hours must not lose them), and the compiled
        # programs are dropped from jax's caches (they hold gigabytes after a few dozen steps)
        report[kind].append(row)
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        jax.clear_caches()

    if args.grid:
        for target in args.targets:
            if not done("grid", target=target):
                save("grid", grid_point(target))
            g = [r for r in report["grid"] if r["target"] == target][0]
            print(f"  [{time.perf_counter() - t0:6.0f} s] {target}: kernel grid {g['compiled']}/{g['cases']}", flush=True)
    shapes = aot.model_shapes()
    for model in args.models:
        for target in args.targets:
            for context in args.context:
                for batch in args.batch:
                    if done("steps", target=target, model=model, batch=batch, context=context):
                        continue
                    save("steps", step_point(target, model, shapes[model], batch, context, jnp.bfloat16))
                    print(f"  [{time.perf_counter() - t0:6.0f} s] {target} {model} B={batch} ctx={context}: "
                          f"{report['steps'][-1]['status']}", flush=True)
    if not args.skip_kernels:
        for target in args.targets:
            for context in args.context:
                for batch in args.batch:
                    if not done("kernels", target=target, batch=batch, context=context):
                        save("kernels", kernel_point(target, batch, context))
    text = render(report)
    print("\n" + text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text)
    print(f"wrote {path}{' and ' + args.markdown if args.markdown else ''} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
