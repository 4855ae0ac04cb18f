"""Paged vs contiguous decode attention, kernel against kernel: what does the indirection cost?

On a GPU (the full sweep): batch {1, 8, 64, 256} x context {128, 512, 2048, 8192} x block size
{8, 16, 32, 64, 128}, bf16, every sequence at the full context. For each point it times (median of
--reps runs) the paged kernel with sequential block tables (each sequence's blocks adjacent in the
pool) and with shuffled ones, the contiguous kernel, and the jnp reference; reports the bytes of
K/V the kernel must read, the bandwidth it achieves against a measured device-to-device copy, and
paged / contiguous. Every kernel output is also checked against the reference.

Times are wall-clock per call (dispatch included, which dominates only the smallest points).

On CPU the kernels run in interpret mode: a small f32 sweep that checks correctness. Its
timings measure the interpreter, not a kernel, and mean nothing.

Writes results/bench_kernel.json and results/bench_kernel.png (see --out).

--ragged instead times one mixed continuous-batching step through the ragged kernel
(pagedjax.pallas.ragged_paged_attention): on a GPU, 2 prefill chunks of 512 tokens + 62 decodes,
every sequence at a 2048-token context (32 heads / 8 kv heads, head_dim 128, bf16, block 16),
against the jnp reference path, with the bytes of K/V the step must read and the bandwidth that
achieves; plus a decode-only step (64 decodes) through the ragged and the decode kernel. On CPU a
tiny step checks correctness only. Writes results/bench_ragged.json and results/bench_ragged.png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a few points only (GPU: batch 8,64 x context 2048,8192 x block 16,64)")
    p.add_argument("--batch", type=int, nargs="+", help="batch sizes (overrides the sweep)")
    p.add_argument("--context", type=int, nargs="+", help="context lengths (overrides the sweep)")
    p.add_argument("--block-size", type=int, nargs="+", help="block sizes (overrides the sweep)")
    p.add_argument("--num-heads", type=int, default=None, help="query heads (GPU 32, CPU 9)")
    p.add_argument("--num-kv-heads", type=int, default=None, help="kv heads (GPU 8, CPU 3)")
    p.add_argument("--head-dim", type=int, default=None, help="head_dim (GPU 128, CPU 64)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default=None,
                   help="cache dtype (GPU bfloat16, CPU float32 for an exact check)")
    p.add_argument("--variant", choices=["auto", "gpu", "tpu"], default="auto")
    p.add_argument("--reps", type=int, default=None, help="timed runs per kernel (GPU 20, CPU 3)")
    p.add_argument("--skip-reference", action="store_true",
                   help="do not time the jnp reference (it is still used for the check)")
    p.add_argument("--out", default="results", help="output directory (default: results/)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--ragged", action="store_true",
                   help="time a mixed prefill+decode step through the ragged kernel instead")
    return p.parse_args(argv)


def make_timer(reps):
    """timed(fn, *xs) -> (output, median seconds of reps calls after two warm-up calls)."""

    def timed(fn, *xs):
        out = fn(*xs)
        out.block_until_ready()  # compile + first run
        fn(*xs).block_until_ready()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn(*xs).block_until_ready()
            times.append(time.perf_counter() - t0)
        return out, statistics.median(times)

    return timed


def copy_bandwidth(timed, on_cpu):
    """Device-to-device copy bandwidth: read + write bytes over time, the ceiling a streaming
    kernel that reads its K/V once can approach."""
    import jax
    import jax.numpy as jnp

    copy_bytes = (16 << 20) if on_cpu else (2 << 30)
    buf = jnp.ones((copy_bytes // 4,), jnp.float32)
    _, t_copy = timed(jax.jit(lambda x: x + 1.0), buf)  # reads and writes every byte once
    return 2 * copy_bytes / t_copy


def main(argv=None):
    args = parse_args(argv)
    if args.ragged:
        return ragged_main(args)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from pagedjax.pallas import (
        contiguous_attention,
        paged_attention,
        paged_attention_reference,
    )

    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    if on_cpu:
        sweep = dict(batch=[2, 8], context=[64, 256], block_size=[8, 32])
        if args.quick:
            sweep = dict(batch=[4], context=[128], block_size=[16])
        heads, kv_heads, head_dim, dtype_name, reps = 9, 3, 64, "float32", 3
    else:
        sweep = dict(batch=[1, 8, 64, 256], context=[128, 512, 2048, 8192],
                     block_size=[8, 16, 32, 64, 128])
        if args.quick:
            sweep = dict(batch=[8, 64], context=[2048, 8192], block_size=[16, 64])
        heads, kv_heads, head_dim, dtype_name, reps = 32, 8, 128, "bfloat16", 20
    sweep["batch"] = args.batch or sweep["batch"]
    sweep["context"] = args.context or sweep["context"]
    sweep["block_size"] = args.block_size or sweep["block_size"]
    heads = args.num_heads or heads
    kv_heads = args.num_kv_heads or kv_heads
    head_dim = args.head_dim or head_dim
    dtype = jnp.dtype(args.dtype or dtype_name)
    reps = args.reps or reps
    tol = 1e-5 if dtype == jnp.float32 else 2e-2

    device = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {backend}, device {device.device_kind}")
    print(f"heads {heads} / kv heads {kv_heads}, head_dim {head_dim}, {dtype.name}, "
          f"median of {reps} runs")
    if on_cpu:
        print("CPU: the kernels run in Pallas interpret mode. This run checks correctness only; "
              "its timings measure the interpreter and MEAN NOTHING about kernel speed.")

    timed = make_timer(reps)
    copy_bw = copy_bandwidth(timed, on_cpu)
    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:.1f} GB/s")

    paged = jax.jit(lambda *xs: paged_attention(*xs, variant=args.variant))
    contig = jax.jit(lambda *xs: contiguous_attention(*xs, variant=args.variant))
    reference = jax.jit(paged_attention_reference)

    def rel_err(out, ref):
        out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
        return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))

    rows, failures = [], []
    key = jax.random.key(args.seed)
    rng = np.random.default_rng(args.seed)
    header = (f"{'batch':>5} {'ctx':>5} {'bs':>4} | {'seq ms':>8} {'shuf ms':>8} {'contig ms':>9} "
              f"{'ref ms':>8} | {'KV MiB':>8} {'GB/s':>7} {'% copy':>6} | {'shuf/contig':>11} "
              f"{'seq/contig':>10} | {'max err':>8}")
    print(header)
    print("-" * len(header))
    for batch in sweep["batch"]:
        for context in sweep["context"]:
            for block_size in sweep["block_size"]:
                if context % block_size:
                    continue
                max_blocks = context // block_size
                num_blocks = 1 + batch * max_blocks  # block 0 is the null block
                kq, kk, kv, key = jax.random.split(key, 4)
                q = jax.random.normal(kq, (batch, heads, head_dim), dtype)
                shape = (kv_heads, num_blocks, block_size, head_dim)
                k_pages = jax.random.normal(kk, shape, dtype)
                v_pages = jax.random.normal(kv, shape, dtype)
                lengths = jnp.full((batch,), context, jnp.int32)
                sequential = np.arange(1, num_blocks, dtype=np.int32).reshape(batch, max_blocks)
                shuffled = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
                tables = {"sequential": jnp.asarray(sequential),
                          "shuffled": jnp.asarray(shuffled.reshape(batch, max_blocks))}
                # The same cache laid out contiguously: with sequential tables each sequence's
                # blocks are already adjacent, so this is a reshape of the pool.
                k = jnp.moveaxis(k_pages[:, 1:].reshape(kv_heads, batch, context, head_dim), 0, 1)
                v = jnp.moveaxis(v_pages[:, 1:].reshape(kv_heads, batch, context, head_dim), 0, 1)

                if args.skip_reference:
                    ref, t_ref = reference(q, k_pages, v_pages, tables["sequential"], lengths), float("nan")
                else:
                    ref, t_ref = timed(reference, q, k_pages, v_pages, tables["sequential"], lengths)
                out_seq, t_seq = timed(paged, q, k_pages, v_pages, tables["sequential"], lengths)
                out_shuf, t_shuf = timed(paged, q, k_pages, v_pages, tables["shuffled"], lengths)
                ref_shuf = reference(q, k_pages, v_pages, tables["shuffled"], lengths)
                out_con, t_con = timed(contig, q, k, v, lengths)
                err = max(rel_err(out_seq, ref), rel_err(out_shuf, ref_shuf), rel_err(out_con, ref))
                if not err <= tol:
                    failures.append((batch, context, block_size, err))
                kv_bytes = 2 * batch * context * kv_heads * head_dim * dtype.itemsize
                row = dict(batch=batch, context=context, block_size=block_size,
                           paged_sequential_s=t_seq, paged_shuffled_s=t_shuf, contiguous_s=t_con,
                           reference_s=t_ref, kv_bytes=kv_bytes,
                           paged_shuffled_bandwidth=kv_bytes / t_shuf,
                           contiguous_bandwidth=kv_bytes / t_con,
                           fraction_of_copy_bandwidth=kv_bytes / t_shuf / copy_bw,
                           shuffled_over_contiguous=t_shuf / t_con,
                           sequential_over_contiguous=t_seq / t_con, max_rel_err=err)
                rows.append(row)
                print(f"{batch:>5} {context:>5} {block_size:>4} | {t_seq * 1e3:>8.3f} "
                      f"{t_shuf * 1e3:>8.3f} {t_con * 1e3:>9.3f} {t_ref * 1e3:>8.3f} | "
                      f"{kv_bytes / 2**20:>8.1f} {kv_bytes / t_shuf / 1e9:>7.1f} "
                      f"{100 * kv_bytes / t_shuf / copy_bw:>6.1f} | {t_shuf / t_con:>11.3f} "
                      f"{t_seq / t_con:>10.3f} | {err:>8.1e}", flush=True)
                del q, k_pages, v_pages, k, v, ref, ref_shuf, out_seq, out_shuf, out_con

    os.makedirs(args.out, exist_ok=True)
    result = dict(jax_version=jax.__version__, backend=backend, device=device.device_kind,
                  interpret_mode=on_cpu, timings_meaningful=not on_cpu, num_heads=heads,
                  num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype.name, reps=reps,
                  variant=args.variant, copy_bandwidth=copy_bw, tolerance=tol, rows=rows,
                  failures=[dict(batch=b, context=c, block_size=s, max_rel_err=e)
                            for b, c, s, e in failures])
    json_path = os.path.join(args.out, "bench_kernel.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    png_path = os.path.join(args.out, "bench_kernel.png")
    plot(rows, sweep, copy_bw, on_cpu, png_path)
    print(f"wrote {json_path} and {png_path}")

    if not on_cpu:
        late = [r for r in rows if r["context"] >= 2048]
        if late:
            worst = max(r["shuffled_over_contiguous"] for r in late)
            print(f"target paged <= 1.15 x contiguous at context >= 2048: worst {worst:.3f} "
                  f"{'PASS' if worst <= 1.15 else 'MISS'}")
        big = [r for r in rows if r["batch"] == 64 and r["context"] == 8192]
        if big:
            best = max(r["fraction_of_copy_bandwidth"] for r in big)
            print(f"target >= 80% of copy bandwidth at batch 64, context 8192: best "
                  f"{100 * best:.1f}% {'PASS' if best >= 0.8 else 'MISS'}")
    else:
        print("(CPU interpret mode: the timings above mean nothing; the error column is the result)")
    if failures:
        print(f"CORRECTNESS FAILURES (tolerance {tol}): {failures}")
        return 1
    print(f"all outputs match the reference within {tol}")
    return 0


def plot(rows, sweep, copy_bw, on_cpu, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sweep["batch"]
    fig, axes = plt.subplots(2, len(batches), figsize=(4 * len(batches), 7), squeeze=False)
    for col, batch in enumerate(batches):
        for bs in sweep["block_size"]:
            pts = sorted((r["context"], r) for r in rows
                         if r["batch"] == batch and r["block_size"] == bs)
            if not pts:
                continue
            ctx = [c for c, _ in pts]
            axes[0, col].plot(ctx, [r["shuffled_over_contiguous"] for _, r in pts], "o-",
                              label=f"block {bs}")
            axes[1, col].plot(ctx, [r["paged_shuffled_bandwidth"] / copy_bw for _, r in pts], "o-",
                              label=f"block {bs}")
        axes[0, col].set_title(f"batch {batch}")
        axes[0, col].axhline(1.15, color="grey", ls="--", lw=0.8)
        axes[1, col].axhline(0.8, color="grey", ls="--", lw=0.8)
        for row in range(2):
            axes[row, col].set_xscale("log", base=2)
            axes[row, col].set_xlabel("context (tokens)")
    axes[0, 0].set_ylabel("paged (shuffled) / contiguous time")
    axes[1, 0].set_ylabel("paged K/V read rate / copy bandwidth")
    axes[0, 0].legend(fontsize=7)
    title = "paged vs contiguous decode attention"
    if on_cpu:
        title += " (CPU INTERPRET MODE: TIMINGS MEAN NOTHING)"
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def mixed_step(key, rng, q_lens, context, block_size, heads, kv_heads, head_dim, dtype, num_tokens):
    """One step's ragged inputs: sequence s has q_lens[s] new tokens, all at `context` tokens
    (including the new ones), its blocks shuffled over the pool."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    num_seqs = len(q_lens)
    max_blocks = -(-context // block_size)
    num_blocks = 1 + num_seqs * max_blocks  # block 0 is the null block
    tables = rng.permutation(np.arange(1, num_blocks, dtype=np.int32)).reshape(num_seqs, max_blocks)
    qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    kq, kk, kv = jax.random.split(key, 3)
    shape = (kv_heads, num_blocks, block_size, head_dim)
    return (jax.random.normal(kq, (num_tokens, heads, head_dim), dtype),
            jax.random.normal(kk, shape, dtype), jax.random.normal(kv, shape, dtype),
            jnp.asarray(tables), jnp.full((num_seqs,), context, jnp.int32), jnp.asarray(qsl),
            jnp.int32(num_seqs))


def ragged_main(args):
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.experimental import pallas as pl

    from pagedjax.pallas import (
        paged_attention,
        paged_attention_reference,
        ragged_paged_attention,
        ragged_paged_attention_reference,
    )
    from pagedjax.pallas.common import GPU_MIN_ROWS, TOKENS_PER_STEP
    from pagedjax.pallas.ragged_paged_attention import TPU_MIN_ROWS, default_block_q

    backend = jax.default_backend()
    on_cpu = backend == "cpu"
    if on_cpu:
        chunks, decodes, context, block_size = [24], 5, 96, 16
        heads, kv_heads, head_dim, dtype_name, reps = 9, 3, 64, "float32", 3
    else:
        chunks, decodes, context, block_size = [512, 512], 62, 2048, 16
        heads, kv_heads, head_dim, dtype_name, reps = 32, 8, 128, "bfloat16", 20
    context = (args.context or [context])[0]
    block_size = (args.block_size or [block_size])[0]
    heads = args.num_heads or heads
    kv_heads = args.num_kv_heads or kv_heads
    head_dim = args.head_dim or head_dim
    dtype = jnp.dtype(args.dtype or dtype_name)
    reps = args.reps or reps
    tol = 1e-5 if dtype == jnp.float32 else 2e-2
    variant = args.variant if args.variant != "auto" else ("tpu" if backend == "tpu" else "gpu")

    device = jax.devices()[0]
    print(f"jax {jax.__version__}, backend {backend}, device {device.device_kind}")
    print(f"ragged step: chunks {chunks} + {decodes} decodes, context {context}, block {block_size}, "
          f"heads {heads} / kv heads {kv_heads}, head_dim {head_dim}, {dtype.name}, {variant} "
          f"variant, median of {reps} runs")
    if on_cpu:
        print("CPU: the kernels run in Pallas interpret mode. This run checks correctness only; "
              "its timings measure the interpreter and MEAN NOTHING about kernel speed.")
    timed = make_timer(reps)
    copy_bw = copy_bandwidth(timed, on_cpu)
    print(f"device copy bandwidth (read + write): {copy_bw / 1e9:.1f} GB/s")

    kernel = jax.jit(lambda *xs: ragged_paged_attention(*xs, variant=variant))
    reference = jax.jit(ragged_paged_attention_reference)
    decode_kernel = jax.jit(lambda q, k, v, bt, lens: paged_attention(q, k, v, bt, lens,
                                                                      variant=variant))
    decode_reference = jax.jit(paged_attention_reference)
    group = heads // kv_heads
    group_rows = pl.next_power_of_2(group) if variant == "gpu" else group
    min_rows = GPU_MIN_ROWS if variant == "gpu" else TPU_MIN_ROWS

    def kv_bytes(q_lens, num_tokens):
        """(bytes of K/V the step needs, each page once; bytes the kernel issues: every query tile
        of a chunk reads the pages up to its last token, rounded up to whole steps)."""
        per_token = 2 * kv_heads * head_dim * dtype.itemsize
        bq = default_block_q(num_tokens, len(q_lens), group_rows, min_rows)
        step = max(TOKENS_PER_STEP // block_size, 1) * block_size
        issued = 0
        for q_len in q_lens:
            for j in range(-(-q_len // bq)):
                kv_len = context - q_len + min((j + 1) * bq, q_len)
                issued += -(-kv_len // step) * step
        return len(q_lens) * context * per_token, issued * per_token

    def rel_err(out, ref):
        out, ref = out.astype(jnp.float32), ref.astype(jnp.float32)
        return float(jnp.max(jnp.abs(out - ref)) / jnp.max(jnp.abs(ref)))

    rng = np.random.default_rng(args.seed)
    key = jax.random.key(args.seed)
    rows, failures = [], []

    def report(name, seconds, need, issued, err):
        row = dict(name=name, seconds=seconds, kv_bytes=need, kv_bytes_issued=issued,
                   bandwidth=need / seconds if need else None,
                   fraction_of_copy_bandwidth=need / seconds / copy_bw if need else None,
                   max_rel_err=err)
        rows.append(row)
        if err is not None and not err <= tol:
            failures.append((name, err))
        bw = f"{need / seconds / 1e9:>8.1f} {100 * need / seconds / copy_bw:>6.1f}" if need else (
            f"{'':>8} {'':>6}")
        mib = f"{need / 2**20:>8.1f} {issued / 2**20:>9.1f}" if need else f"{'':>8} {'':>9}"
        print(f"{name:<28} {seconds * 1e3:>9.3f} | {mib} | {bw} | "
              f"{'' if err is None else f'{err:.1e}':>8}", flush=True)

    header = (f"{'path':<28} {'ms':>9} | {'KV MiB':>8} {'issued':>9} | {'GB/s':>8} {'% copy':>6} | "
              f"{'max err':>8}")
    print(header)
    print("-" * len(header))

    # The mixed step: chunks first, then the decodes; T padded to a multiple of 64 (a bucket).
    q_lens = chunks + [1] * decodes
    num_tokens = -(-sum(q_lens) // 64) * 64
    step = mixed_step(key, rng, q_lens, context, block_size, heads, kv_heads, head_dim, dtype,
                      num_tokens)
    need, issued = kv_bytes(q_lens, num_tokens)
    out, t_kernel = timed(kernel, *step)
    if args.skip_reference:
        ref, t_ref = reference(*step), None
    else:
        ref, t_ref = timed(reference, *step)
    err = rel_err(out, ref)
    report("mixed: ragged kernel", t_kernel, need, issued, err)
    if t_ref is not None:
        # The reference gathers every row's whole block table.
        gathered = num_tokens * -(-context // block_size) * block_size * 2 * kv_heads * head_dim
        report("mixed: jnp reference", t_ref, need, gathered * dtype.itemsize, None)
    del step, out, ref

    # Decode only: does a decode step want the ragged kernel or the decode kernel?
    n_dec = len(q_lens)
    key, sub = jax.random.split(key)
    q, k_pages, v_pages, tables, lens, qsl, n = mixed_step(
        sub, rng, [1] * n_dec, context, block_size, heads, kv_heads, head_dim, dtype, n_dec)
    need, issued = kv_bytes([1] * n_dec, n_dec)
    out, t_ragged = timed(kernel, q, k_pages, v_pages, tables, lens, qsl, n)
    out_dec, t_dec = timed(decode_kernel, q, k_pages, v_pages, tables, lens)
    ref = decode_reference(q, k_pages, v_pages, tables, lens)
    report(f"decode x{n_dec}: ragged kernel", t_ragged, need, issued, rel_err(out, ref))
    report(f"decode x{n_dec}: decode kernel", t_dec, need, need, rel_err(out_dec, ref))

    os.makedirs(args.out, exist_ok=True)
    result = dict(jax_version=jax.__version__, backend=backend, device=device.device_kind,
                  interpret_mode=on_cpu, timings_meaningful=not on_cpu, chunks=chunks,
                  decodes=decodes, context=context, block_size=block_size, num_tokens=num_tokens,
                  num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, dtype=dtype.name,
                  variant=variant, reps=reps, copy_bandwidth=copy_bw, tolerance=tol, rows=rows,
                  failures=[dict(name=n_, max_rel_err=e) for n_, e in failures])
    json_path = os.path.join(args.out, "bench_ragged.json")
    with open(json_path, "w") as f:
        json.dump(result, f, indent=1)
    png_path = os.path.join(args.out, "bench_ragged.png")
    plot_ragged(rows, on_cpu, png_path)
    print(f"wrote {json_path} and {png_path}")
    if on_cpu:
        print("(CPU interpret mode: the timings above mean nothing; the error column is the result)")
    elif t_ref is not None:
        print(f"mixed step: reference / kernel = {t_ref / t_kernel:.1f}x")
    if failures:
        print(f"CORRECTNESS FAILURES (tolerance {tol}): {failures}")
        return 1
    print(f"all outputs match the reference within {tol}")
    return 0


def plot_ragged(rows, on_cpu, path):
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.barh([r["name"] for r in rows], [r["seconds"] * 1e3 for r in rows])
    ax.set_xscale("log")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.set_xlabel("ms per call (median, log scale)")
    ax.invert_yaxis()
    title = "ragged paged attention: one step"
    if on_cpu:
        title += "\n(CPU INTERPRET MODE: TIMINGS MEAN NOTHING)"
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
