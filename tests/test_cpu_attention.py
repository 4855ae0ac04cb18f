"""The CPU path's attention against the pure-jnp ragged reference, both versions:
`xla_attention` (`context_attention` + `split_attention` in XLA ops, the "reference" backend)
and `pagedjax.native.attention` (one C++ call, the "native" backend).

Ragged batches reach every branch: tokens of fresh prompts (no cached context), decode tokens,
prefill chunks after cached context that fill whole 16-token tiles (the XLA one-row branch) or
share tiles with other rows (its per-token branch), padding rows and tokens, block sizes from 1
to 32 and contexts ending on and off page and chunk edges. The native kernel is also run with
head dims 64 and 128 (its AVX-512 paths, where the CPU has them) and a bfloat16 pool, read in place (as
this CPU's build reads it, and where the CPU has AVX512_BF16 also with a build that takes its bf16
pair products and one that widens pages to float32), and built without AVX-512 (its AVX2 loops
and the portable ones). The
native kernel keeps its pool's pages in its own layout and writes the step's K/V into it itself:
pools built here position-major are rearranged first (`on_pages`), and its writes are checked
bit for bit against the other backends' write_kv; given q and k before the rotary embedding, it
rotates them itself as the model's apply_rope does."""

from __future__ import annotations

import dataclasses
import functools
import json
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import require_native, require_native_matmul
from pagedjax import native
from pagedjax.attention import AttentionMetadata, token_layout, write_kv
from pagedjax.attention.xla import xla_attention
from pagedjax.pallas.reference import ragged_paged_attention_reference

KVH, G = 2, 3


def make_batch(rng, rows, block_size, T, S, P, num_blocks, D, groups=G):
    """rows: [(cached, new)] per sequence, `groups` query heads per kv head. Returns the pool holding random cached K/V (and NaN-free
    garbage elsewhere), the step's q/k/v, and the metadata, padded to T tokens, S rows, P pages."""
    assert sum(n for _, n in rows) <= T and len(rows) <= S
    k_pool = rng.standard_normal((1, KVH, num_blocks, block_size, D)).astype(np.float32)
    v_pool = rng.standard_normal((1, KVH, num_blocks, block_size, D)).astype(np.float32)
    free = list(rng.permutation(np.arange(1, num_blocks)))
    tables = np.zeros((S, P), np.int32)
    qsl = np.zeros(S + 1, np.int32)
    lens = np.zeros(S, np.int32)
    slots = np.full(T, -1, np.int32)
    t = 0
    for s, (cached, new) in enumerate(rows):
        n_pages = -(-(cached + new) // block_size)
        tables[s, :n_pages] = [free.pop() for _ in range(n_pages)]
        lens[s] = cached + new
        for i in range(new):
            p = cached + i
            slots[t + i] = tables[s, p // block_size] * block_size + p % block_size
        t += new
        qsl[s + 1] = t
    qsl[len(rows) + 1:] = t
    attn = AttentionMetadata(jnp.asarray(slots), jnp.asarray(tables), jnp.asarray(lens), jnp.asarray(qsl),
                             jnp.int32(len(rows)))
    q = jnp.asarray(rng.standard_normal((T, KVH * groups, D)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((T, KVH, D)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((T, KVH, D)).astype(np.float32))
    return (jnp.asarray(k_pool), jnp.asarray(v_pool)), q, k, v, attn


def cpu_path(attention_fn, groups=G):
    @jax.jit
    def run(q, k, v, pool, attn):
        k_pool, v_pool = pool
        T, _, D = q.shape
        layout = token_layout(attn, T)
        qg = q.reshape(T, KVH, groups, D) * D ** -0.5
        o = attention_fn(qg, k, v, k_pool, v_pool, jnp.int32(0), attn.block_tables[layout.seq], layout)
        return o, layout.valid

    return run


def on_pages(native_fn):
    """A native attention given a pool laid out as the other backends lay it out (each page
    position-major): its pages rearranged first as the kernel keeps them (native.to_pages)."""
    target = getattr(native_fn, "keywords", {}).get("target", native.TARGET)  # a build of its own: its layout

    def run(qg, k, v, k_pool, v_pool, *args, **kwargs):
        return native_fn(qg, k, v, *native.to_pages(k_pool, v_pool, target), *args, **kwargs)

    return run


IMPLS = {"xla": cpu_path(xla_attention), "native": cpu_path(on_pages(native.attention))}


@jax.jit
def reference(q, k, v, pool, attn):
    k_pool, v_pool = (write_kv(c.astype(jnp.float32), x[None], attn.slot_mapping)[0] for c, x in zip(pool, (k, v)))
    return ragged_paged_attention_reference(q, k_pool, v_pool, attn.block_tables, attn.context_lens,
                                            attn.query_start_loc, attn.num_seqs)


def tolerance(impl, dtype):
    """float32 sums everywhere. Where the native kernel reads a bfloat16 pool with AVX512_BF16's
    pair products, the queries and softmax weights also enter as bfloat16 (8 bits of mantissa,
    relative error <= 2^-9 each): scores move by ~1e-3 and outputs by a few 1e-3 at most here.
    A misplaced lane or row moves them by O(1)."""
    if impl == "native" and dtype == jnp.bfloat16 and native.bf16_pair_products():
        return dict(rtol=1e-2, atol=1e-2)
    return dict(rtol=2e-5, atol=2e-5)


CASES = {
    # (cached, new) per row
    "decode only": [(c, 1) for c in (1, 5, 16, 17, 31, 32, 33, 64, 100, 7)],
    "fresh prompts only": [(0, 20), (0, 1), (0, 16), (0, 9)],
    "one long chunk after context (one-row tiles)": [(70, 48)],
    "chunks sharing tiles": [(40, 5), (3, 7), (0, 6), (90, 13), (16, 16), (1, 1)],
    "mixed step": [(50, 1), (0, 24), (33, 1), (120, 20), (0, 3), (15, 1), (64, 1)],
}
VARIANTS = {  # impl, head dim, pool dtype
    "xla": ("xla", 16, jnp.float32),
    "native": ("native", 16, jnp.float32),
    "native-d64": ("native", 64, jnp.float32),
    "native-d64-bf16": ("native", 64, jnp.bfloat16),
    "native-d128-bf16": ("native", 128, jnp.bfloat16),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_attention_matches_reference(case, block_size, variant):
    impl, D, dtype = VARIANTS[variant]
    if impl == "native":
        require_native()
    rows = CASES[case]
    rng = np.random.default_rng(hash((case, block_size)) % 2**32)
    T = -(-sum(n for _, n in rows) // 8) * 8 + 8            # padding tokens at the end
    S = len(rows) + 2                                        # padding rows
    P = -(-max(c + n for c, n in rows) // block_size) + 1    # one spare table column
    pool, q, k, v, attn = make_batch(rng, rows, block_size, T, S, P, S * P + 2, D)
    pool = tuple(c.astype(dtype) for c in pool)
    got, valid = IMPLS[impl](q, k, v, pool, attn)
    want = reference(q, k, v, pool, attn)
    valid = np.asarray(valid)
    assert valid.sum() == sum(n for _, n in rows)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], **tolerance(impl, dtype))
    assert np.all(np.isfinite(np.asarray(got)))
    if impl == "native":
        assert np.all(np.asarray(got)[~valid] == 0)


@pytest.mark.parametrize("groups", [1, 2, 4, 5, 8])
@pytest.mark.parametrize("D, dtype", [(64, jnp.float32), (64, jnp.bfloat16), (128, jnp.float32), (128, jnp.bfloat16)])
def test_native_any_number_of_query_heads_per_kv_head(groups, D, dtype):
    """The AVX-512 path attends with the query heads of one kv head together, four at a time at
    head dim 64 and two at 128, then the rest: every split of G matches the reference."""
    require_native()
    rows = CASES["mixed step"]
    rng = np.random.default_rng(groups * 1000 + D)
    T, S = 56, len(rows) + 1
    P = -(-max(c + n for c, n in rows) // 16) + 1
    pool, q, k, v, attn = make_batch(rng, rows, 16, T, S, P, S * P + 2, D, groups)
    pool = tuple(c.astype(dtype) for c in pool)
    got, valid = cpu_path(on_pages(native.attention), groups)(q, k, v, pool, attn)
    want = reference(q, k, v, pool, attn)
    valid = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], **tolerance("native", dtype))


def bf16_products_case(case, D, groups, extra_flags):
    """The native kernel built with `extra_flags` and the reference on one bf16 case: (target,
    got, want) over the valid rows."""
    target = native.register_source(extra_flags=extra_flags)
    rows = CASES[case]
    rng = np.random.default_rng(D * 10 + groups)
    T = -(-sum(n for _, n in rows) // 8) * 8 + 8
    P = -(-max(c + n for c, n in rows) // 16) + 1
    pool, q, k, v, attn = make_batch(rng, rows, 16, T, len(rows) + 1, P, (len(rows) + 1) * P + 2, D, groups)
    pool = tuple(c.astype(jnp.bfloat16) for c in pool)
    got, valid = cpu_path(on_pages(functools.partial(native.attention, target=target)), groups)(q, k, v, pool, attn)
    want = reference(q, k, v, pool, attn)
    valid = np.asarray(valid)
    return target, np.asarray(got)[valid], np.asarray(want)[valid]


def require_pair_products():
    require_native()
    if not {"avx512f", "avx512_bf16"} <= native.cpu_flags():
        pytest.skip("this CPU has no AVX512_BF16 pair products: every other bf16 test takes the widened path")


PRODUCT_CASES = [("mixed step", 64, 3), ("chunks sharing tiles", 128, 5), ("decode only", 64, 4)]


@pytest.mark.parametrize("case, D, groups", PRODUCT_CASES)
def test_native_widened_bf16_path_on_a_cpu_with_pair_products(case, D, groups):
    """CPUs with AVX-512 but without AVX512_BF16, and Intel's with it, widen bf16 pages to float32
    and keep all arithmetic float32. Where this CPU has the pair products, the kernel built with
    -mno-avx512bf16 takes that path: it matches the reference at float32 tolerance."""
    require_pair_products()
    target, got, want = bf16_products_case(case, D, groups, ("-mno-avx512bf16",))
    assert not native.bf16_pair_products(target)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("case, D, groups", PRODUCT_CASES)
def test_native_pair_products_on_a_cpu_with_them(case, D, groups):
    """Where this CPU has AVX512_BF16, the kernel built to take its pair products whatever the
    vendor (-UPAGEDJAX_WIDEN_BF16 after the build's own flags) rounds the queries and weights to
    bf16: within 1e-2 of the reference, and not bit for bit the widened kernel's outputs (so the
    pair products did run)."""
    require_pair_products()
    target, got, want = bf16_products_case(case, D, groups, ("-UPAGEDJAX_WIDEN_BF16",))
    assert native.bf16_pair_products(target)
    np.testing.assert_allclose(got, want, rtol=1e-2, atol=1e-2)
    _, widened, _ = bf16_products_case(case, D, groups, ("-mno-avx512bf16",))
    assert not np.array_equal(got, widened)


def test_native_bf16_products_follow_the_vendor():
    """The machine's own build widens bf16 pages on Intel CPUs and takes the pair products on
    other CPUs with AVX512_BF16 (attention_flags); what the library reports is what was built."""
    require_native()
    pairs = {"avx512f", "avx512_bf16"} <= native.cpu_flags()
    intel = native.cpu_vendor() == "GenuineIntel"
    assert native.attention_flags() == (("-DPAGEDJAX_WIDEN_BF16",) if pairs and intel else ())
    assert native.bf16_pair_products() == (pairs and not intel)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("D,block_size", [(64, 16), (128, 32), (64, 5)])
def test_native_portable_path_without_avx512(dtype, D, block_size):
    """CPUs without AVX-512 take the AVX2 loops (where the CPU has AVX2 and FMA: head dims 64 and
    128, blocks a multiple of 16) or the portable ones (other blocks) over the same page layout: the
    kernel built with -mno-avx512f matches the reference at float32 tolerance on a ragged step
    with a prefill chunk and decodes."""
    require_native()
    attention = functools.partial(native.attention, target=native.register_source(extra_flags=("-mno-avx512f",)))
    rows = CASES["mixed step"]
    rng = np.random.default_rng(11)
    T = -(-sum(n for _, n in rows) // 8) * 8 + 8
    P = -(-max(c + n for c, n in rows) // block_size) + 1
    pool, q, k, v, attn = make_batch(rng, rows, block_size, T, len(rows) + 1, P, (len(rows) + 1) * P + 2, D)
    pool = tuple(c.astype(dtype) for c in pool)
    got, valid = cpu_path(on_pages(attention))(q, k, v, pool, attn)
    want = reference(q, k, v, pool, attn)
    valid = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("D", [16, 64])
def test_native_matches_xla_on_a_long_prefill_chunk(D):
    """A 200-token chunk after 300 cached tokens, next to decodes: many 8-token groups of one row,
    causal runs longer than 16 keys, in both kernels."""
    require_native()
    rows = [(300, 200), (45, 1), (0, 37), (129, 1)]
    rng = np.random.default_rng(7)
    pool, q, k, v, attn = make_batch(rng, rows, 16, 248, 5, 33, 5 * 33 + 2, D)
    got, valid = IMPLS["native"](q, k, v, pool, attn)
    want, _ = IMPLS["xla"](q, k, v, pool, attn)
    valid = np.asarray(valid)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=2e-5, atol=2e-5)


def test_native_rejects_a_block_outside_the_pool():
    """Indices the kernel would read are checked before it reads: an error, not a crash."""
    require_native()
    rng = np.random.default_rng(0)
    pool, q, k, v, attn = make_batch(rng, [(20, 1)], 16, 8, 2, 4, 6, 16)
    attn = dataclasses.replace(attn, block_tables=attn.block_tables.at[0, 1].set(99))
    with pytest.raises(Exception, match=r"block 99 outside the pool \[0, 6\)"):
        jax.block_until_ready(IMPLS["native"](q, k, v, pool, attn))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size", [1, 5, 16, 32])
def test_native_writes_the_steps_kv_into_its_page_layout(block_size, dtype):
    """With slot_mapping the call also writes the step's K/V into its layer of the pool, after
    every read: the output is the same as without, and the pool is, bit for bit, what the other
    backends' write_kv makes of the position-major pool, in the kernel's page layout -- bf16
    rounded to nearest, a non-finite value stored as 0, padding tokens (slot -1) writing nothing,
    other layers untouched. Odd block sizes keep a bf16 page's values in rows (5)."""
    require_native()
    rows = CASES["mixed step"]
    rng = np.random.default_rng(block_size)
    T, S = 64, len(rows) + 1
    P = -(-max(c + n for c, n in rows) // block_size) + 1
    pool, q, k, v, attn = make_batch(rng, rows, block_size, T, S, P, S * P + 2, 64)
    pool = tuple(jnp.concatenate([c, c[::-1] * 2]).astype(dtype) for c in pool)  # two layers; layer 1 read and written
    k = k.at[0, 0, 3].set(jnp.nan).at[0, 1, 5].set(jnp.inf)  # row 0's one token
    v = v.at[0, 1, 7].set(-jnp.inf)

    @jax.jit
    def run(pool, slots):
        layout = token_layout(attn, T)
        qg = q.reshape(T, KVH, G, 64) * 64 ** -0.5
        args = (qg, k, v, *native.to_pages(*pool), jnp.int32(1), attn.block_tables[layout.seq], layout)
        return native.attention(*args), native.attention(*args, slot_mapping=slots)

    plain, (o, written) = run(pool, attn.slot_mapping)
    other_rows = np.arange(T) > 0  # row 0 attends to its own non-finite K/V
    np.testing.assert_array_equal(np.asarray(o)[other_rows], np.asarray(plain)[other_rows])
    bits = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype == jnp.bfloat16 else x)  # noqa: E731
    want = [c.at[1].set(write_kv(c[1:], x[None], attn.slot_mapping)[0]) for c, x in zip(pool, (k, v))]
    for got, w in zip(written, native.to_pages(*want)):
        assert np.array_equal(bits(got), bits(w))
    assert np.all(np.isfinite(np.asarray(written[0], np.float32)))
    for got, orig in zip(native.from_pages(*native.to_pages(*pool)), pool):  # the layout undone
        assert np.array_equal(bits(got), bits(orig))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("D", [64, 16])
def test_native_applies_the_rotary_embedding_itself(D, dtype):
    """With rope=(cos, sin, scale) the call takes q and k before the rotary embedding: its output
    and the keys it writes are those of the call given them rotated (apply_rope) and q scaled, to
    float32 rounding (bf16 pool: the written keys to one bf16 rounding); values as they come."""
    from pagedjax.model.llama import ModelConfig, apply_rope, rope_cos_sin

    require_native()
    rows = CASES["mixed step"]
    rng = np.random.default_rng(D)
    T, S, BS = 64, len(rows) + 1, 16
    P = -(-max(c + n for c, n in rows) // BS) + 1
    pool, q, k, v, attn = make_batch(rng, rows, BS, T, S, P, S * P + 2, D)
    pool = tuple(c.astype(dtype) for c in pool)
    cfg = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=KVH * G,
                      num_kv_heads=KVH, head_dim=D, rope_theta=10000.0)

    @jax.jit
    def run(pool):
        layout = token_layout(attn, T)
        cos, sin = rope_cos_sin(cfg, layout.pos, jnp.float32)
        common = (*native.to_pages(*pool), jnp.int32(0), attn.block_tables[layout.seq], layout)
        fused = native.attention(q.reshape(T, KVH, G, D), k, v, *common, slot_mapping=attn.slot_mapping,
                                 rope=(cos, sin, D ** -0.5))
        qg = apply_rope(q, cos, sin).reshape(T, KVH, G, D) * D ** -0.5
        plain = native.attention(qg, apply_rope(k, cos, sin), v, *common, slot_mapping=attn.slot_mapping)
        return fused, plain

    (o, written), (want_o, want_written) = run(pool)
    np.testing.assert_allclose(np.asarray(o), np.asarray(want_o), rtol=1e-4, atol=1e-4)
    as_f32 = lambda x: np.asarray(jax.lax.bitcast_convert_type(x, jnp.bfloat16).astype(jnp.float32) if x.dtype == jnp.uint16 else x)  # noqa: E731
    tol = 1e-5 if dtype == jnp.float32 else 1e-2
    for got, want in zip(written, want_written):
        np.testing.assert_allclose(as_f32(got), as_f32(want), rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="rope needs slot_mapping"):
        native.attention(q.reshape(T, KVH, G, D), k, v, *native.to_pages(*pool), jnp.int32(0),
                         attn.block_tables[token_layout(attn, T).seq], token_layout(attn, T),
                         rope=(jnp.ones((T, D)), jnp.zeros((T, D)), 1.0))


def test_native_rejects_a_slot_outside_the_pool():
    require_native()
    rng = np.random.default_rng(0)
    pool, q, k, v, attn = make_batch(rng, [(20, 1)], 16, 8, 2, 4, 6, 16)
    layout = token_layout(attn, 8)
    slots = attn.slot_mapping.at[0].set(6 * 16)
    with pytest.raises(Exception, match=r"token 0's slot 96 outside the pool \[0, 96\) \(-1: none\)"):
        jax.block_until_ready(native.attention(q.reshape(8, KVH, G, 16), k, v, *pool, jnp.int32(0),
                                               attn.block_tables[layout.seq], layout, slot_mapping=slots))


def test_backend_choice_when_the_kernel_cannot_be_built(monkeypatch):
    """No compiler: "auto" falls back to the XLA attention and an explicit "native" says why;
    with tensor parallelism "auto" keeps the XLA attention and "native" is refused."""
    from pagedjax.attention import resolve_backend

    monkeypatch.setattr(native, "compiler", lambda: None)
    native._register.cache_clear()
    try:
        assert not native.available()
        assert "no C++ compiler" in native.unavailable_reason()
        assert resolve_backend("auto") == "reference"
        with pytest.raises(ValueError, match=r"attention_backend='native'.*no C\+\+ compiler"):
            resolve_backend("native")
    finally:
        native._register.cache_clear()
    monkeypatch.undo()
    assert resolve_backend("auto", tensor_parallel_size=2) == "reference"
    with pytest.raises(ValueError, match=r"attention_backend='native' needs tensor_parallel_size 1, got 2"):
        resolve_backend("native", tensor_parallel_size=2)


def test_bench_cpu_attention_script_runs_every_table_layout(tmp_path):
    """scripts/bench_cpu_attention.py on a small shape: a time for each block-table layout, and
    the bytes of K/V a step reads counted from the shape; with --source, another version of the
    kernel (here a copy of this one) timed beside it."""
    require_native()
    out = tmp_path / "bench.json"
    other = tmp_path / "attention.cc"
    other.write_bytes(native.SOURCE.read_bytes())
    script = Path(__file__).resolve().parents[1] / "scripts" / "bench_cpu_attention.py"
    subprocess.run([sys.executable, str(script), "--batch", "2", "--context", "40", "--layers", "2", "--reps", "1",
                    "--source", str(other), "--json", str(out)], check=True, capture_output=True, timeout=300)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"this", str(other)}
    assert report["kv_bytes"] == 2 * 2 * 2 * 40 * 3 * 64 * 2  # K and V, layers, tokens, kv heads, dim, bf16
    for kernel in report["results"].values():
        assert set(kernel) == {"sequential", "scattered", "cached"}
        assert all(r["best_ms"] > 0 for r in kernel.values())
    # each kernel says how it multiplies bf16 pages: the same way here, built from the same source
    how = "pair products" if native.bf16_pair_products() else "widened to float32"
    assert report["bf16_products"] == {"this": how, str(other): how}


def _pool_copies(hlo: str, pool_elems: int) -> list[str]:
    """The `copy` instructions of a compiled module that copy something the size of a pool."""
    copies = []
    for m in re.finditer(r"= \w+\[([\d,]*)\]\{[^}]*\} copy\(", hlo):
        if int(np.prod([int(d) for d in m.group(1).split(",") if d])) >= pool_elems:
            copies.append(m.group(0))
    return copies


@pytest.mark.parametrize("backend,layout", [("native", "unstacked"), ("native", "panels"), ("native", ""),
                                            ("reference", "")])
@pytest.mark.parametrize("T", [1, 8])
def test_the_compiled_step_writes_the_pool_in_place(backend, layout, T):
    """The donated pool is updated where it lies: the step's K/V written after the layers must
    not make XLA copy the whole pool (every layer's attention reads it first; the native call
    hands it back so the write is ordered after the reads), whether the layers run over the
    stacked or the unstacked weights (also multiplied by the native matmul: "panels"), and for a
    one-token step too (a one-row scatter that XLA turns into a dynamic-update-slice that read the
    pool, and copied it, before)."""
    if backend == "native":
        require_native()
    if layout == "panels":
        require_native_matmul()
    from pagedjax.model.llama import ModelConfig, init_random_params
    from pagedjax.model.step_weights import to_step_layout
    from pagedjax.runner import make_step
    from pagedjax.scheduler.batch import StepInput

    cfg = ModelConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=256, tie_word_embeddings=True)
    params = init_random_params(cfg, jax.random.key(0))
    params = to_step_layout(params, unstacked=True, panels=layout == "panels") if layout else params
    kv = tuple(jnp.zeros((cfg.num_layers, cfg.num_kv_heads, 40, 16, cfg.head_dim), jnp.float32) for _ in range(2))
    step = make_step(cfg, backend=backend)
    hlo = step.func.lower(params, kv, StepInput.padding(T, min(T, 4), 4), **step.keywords).compile().as_text()
    assert _pool_copies(hlo, kv[0].size) == []
