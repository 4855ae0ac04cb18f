"""The native CPU attention alone: one decode step's attention over every layer, and how fast it
reads the KV pool.

B decode tokens (one per sequence, every sequence at --context tokens of cached context) attend
through `pagedjax.native.attention` once per layer and write their own K/V into the pool after it,
the layers taken in turn so that each call reads and writes its own slice of the pool as the
model's step does. The default shape is SmolLM2-135M's
(30 layers, 3 kv heads of 3 query heads, head dim 64, 16-token blocks). The block tables come
three ways:

- sequential: each sequence's blocks adjacent in the pool (a fresh engine's allocation);
- scattered: blocks in random order (a long-running server's pool after many requests);
- cached: every sequence reading the same blocks, which stay in the CPU's caches: the kernel's
  arithmetic with almost no memory traffic (its "GB/s" is the rate the arithmetic alone allows).

For each it prints the best and median time of a whole step's layers over --reps runs and the
bytes of K and V read per second; beside them, the rate at which one core reads 512 MB straight
through (numpy's max), a floor on the memory bandwidth the kernel could use; and, for a bf16
pool, how each kernel multiplies its pages (AVX512_BF16's pair products, or widened to float32:
the build's choice for this CPU).

With --source, other versions of the kernel's source run beside this one, in turn within each
repetition (so that a noisy machine slows them alike), e.g. the previous commit's:

    git show HEAD~1:pagedjax/native/attention.cc > /tmp/prev.cc
    python scripts/bench_cpu_attention.py --source /tmp/prev.cc

--flags adds compiler flags to every kernel's build (`--flags=-mno-avx512f`: the portable
loops CPUs without AVX-512 run).

    python scripts/bench_cpu_attention.py [--batch 32] [--context 916] [--kv-cache-dtype bfloat16]
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax import native
from pagedjax.attention import AttentionMetadata, token_layout

TABLES = ("sequential", "scattered", "cached")


def make_step(args, tables_kind: str, rng, target: str = native.TARGET):
    L, KVH, G, D, BS, B, C = (args.layers, args.kv_heads, args.groups, args.head_dim, args.block_size,
                              args.batch, args.context)
    P = C // BS + 1  # the cached positions and the step's own, at position C
    num_blocks = B * P + 1  # block 0 is the null block
    dtype = jnp.dtype(args.kv_cache_dtype)

    def values():  # a bfloat16 pool is held as its bits, as the engine's native backend holds it
        x = jnp.asarray(rng.standard_normal((L, KVH, num_blocks, BS, D), np.float32), dtype)
        return jax.lax.bitcast_convert_type(x, jnp.uint16) if dtype == jnp.bfloat16 else x

    pool = [values(), values()]
    blocks = np.arange(1, num_blocks)
    if tables_kind == "scattered":
        blocks = rng.permutation(blocks)
    tables = blocks[:P][None].repeat(B, 0) if tables_kind == "cached" else blocks.reshape(B, P)
    tables = jnp.asarray(tables, jnp.int32)
    # the step's own token sits at position C, after the C cached ones; each call writes its K/V
    # there after its reads, as the engine's step does (not with "cached" tables: every row's
    # would go to one slot)
    slots = jnp.full(B, -1, jnp.int32) if tables_kind == "cached" else tables[:, C // BS] * BS + C % BS
    attn = AttentionMetadata(slots, tables, jnp.full(B, C + 1, jnp.int32), jnp.arange(B + 1, dtype=jnp.int32),
                             jnp.int32(B))
    q = jnp.asarray(rng.standard_normal((B, KVH * G, D)), jnp.float32)
    kv = jnp.asarray(rng.standard_normal((B, KVH, D)), jnp.float32)

    @functools.partial(jax.jit, donate_argnums=(1, 2))  # the pool updated in place, as in the engine
    def layer(layer_index, k_pool, v_pool):
        layout = token_layout(attn, B)
        qg = q.reshape(B, KVH, G, D) * D ** -0.5
        return native.attention(qg, kv, kv, k_pool, v_pool, layer_index, attn.block_tables[layout.seq], layout,
                                target=target, slot_mapping=attn.slot_mapping)

    def step():
        for i in range(L):
            out, pool[:] = layer(jnp.int32(i), *pool)
        out.block_until_ready()

    return step


def memory_read_rate(reps: int) -> float:
    """GB/s of a plain sequential read by one core: numpy's max over 512 MB."""
    x = np.ones(128 << 20, np.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        x.max()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best / 1e9


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--context", type=int, default=916)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--groups", type=int, default=3, help="query heads per kv head")
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--tables", nargs="+", default=list(TABLES), choices=TABLES)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--source", action="append", default=[],
                    help="another version of pagedjax/native/attention.cc to time beside this one (repeatable)")
    ap.add_argument("--flags", default="", help="compiler flags added to every kernel's build, e.g. "
                    "--flags=-mno-avx512f for the portable path CPUs without AVX-512 take")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    if not native.available():
        raise SystemExit(f"the native kernels are not available here: {native.unavailable_reason()}")

    item = jnp.dtype(args.kv_cache_dtype).itemsize
    kv_bytes = 2 * args.layers * args.batch * args.context * args.kv_heads * args.head_dim * item
    print(f"{args.batch} decode tokens x {args.context} cached, {args.layers} layers, {args.kv_heads} kv heads x "
          f"{args.groups}, head dim {args.head_dim}, block {args.block_size}, {args.kv_cache_dtype} pool: "
          f"{kv_bytes / 1e6:.0f} MB of K/V per step")
    read = memory_read_rate(args.reps)
    print(f"  one core reading memory straight through: {read:5.1f} GB/s")
    flags = tuple(args.flags.split())
    kernels = ({"this": native.register_source(native.SOURCE, flags) if flags else native.TARGET}
               | {src: native.register_source(src, flags) for src in args.source})
    # how each kernel multiplies a bf16 page (the build's choice, see pagedjax.native.attention_flags)
    products = {name: "pair products" if native.bf16_pair_products(target) else "widened to float32"
                for name, target in kernels.items()}
    if args.kv_cache_dtype == "bfloat16":
        for name, how in products.items():
            print(f"  {name}: bf16 pages {how}")
    steps = {}
    for name, target in kernels.items():
        for kind in args.tables:  # the same pool contents and tables for every kernel
            steps[name, kind] = make_step(args, kind, np.random.default_rng(TABLES.index(kind)), target)
            steps[name, kind]()  # compile, and touch the pool once
    times = {key: [] for key in steps}
    for _ in range(args.reps):
        for key, step in steps.items():
            t0 = time.perf_counter()
            step()
            times[key].append(time.perf_counter() - t0)
    results = {name: {} for name in kernels}
    for (name, kind), ts in times.items():
        best, median = min(ts), statistics.median(ts)
        results[name][kind] = {"best_ms": best * 1e3, "median_ms": median * 1e3, "gb_per_s": kv_bytes / best / 1e9}
        label = f"{kind:10s}" if len(kernels) == 1 else f"{name}: {kind:10s}"
        print(f"  {label} best {best * 1e3:7.1f} ms  median {median * 1e3:7.1f} ms  "
              f"{kv_bytes / best / 1e9:5.1f} GB/s of K/V")
    if len(kernels) == 1:
        results, products = results["this"], products["this"]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "kv_bytes": kv_bytes, "memory_read_gb_per_s": read, "results": results,
                       "bf16_products": products}, f, indent=1)


if __name__ == "__main__":
    main()
