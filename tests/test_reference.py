"""The jnp references against dense float64 numpy attention built without any paging.

Each case writes every sequence's K/V into shuffled physical blocks of a pool that is NaN
everywhere else (the null block 0, spare blocks, slots past a sequence's length), so a wrong
gather or a leaky mask shows up as NaN or as a mismatch against the numpy truth.
"""

import os
import zlib

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pagedjax.pallas import (  # noqa: E402
    contiguous_attention_reference,
    paged_attention_reference,
    ragged_paged_attention_reference,
)


def write_paged(rng, seq_lens, *, num_kv_heads, head_dim, block_size, max_blocks=None,
                num_blocks=None, dtype=jnp.float32):
    """Random per-sequence K/V [KVH, len, D] (rounded to dtype) written into a NaN pool.

    Returns (k_pages, v_pages, block_tables, dense_k, dense_v): pages [KVH, NB, bs, D] in dtype,
    block_tables int32[S, max_blocks] (unused entries 0), dense lists of float64 arrays.
    """
    seq_lens = np.asarray(seq_lens)
    need = -(-seq_lens // block_size)
    max_blocks = max_blocks or max(1, int(need.max()))
    num_blocks = num_blocks or 1 + int(need.sum()) + 3  # block 0 is the null block; 3 spare
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    physical = rng.permutation(np.arange(1, num_blocks))  # scattered, never block 0
    tables = np.zeros((len(seq_lens), max_blocks), np.int32)
    dense_k, dense_v, used = [], [], 0
    for s, n in enumerate(seq_lens):
        kv = [np.asarray(jnp.asarray(rng.standard_normal((num_kv_heads, n, head_dim)), dtype)
                         .astype(jnp.float32)) for _ in range(2)]
        blocks = physical[used:used + need[s]]
        used += need[s]
        tables[s, :need[s]] = blocks
        for i, blk in enumerate(blocks):
            chunk = slice(i * block_size, min((i + 1) * block_size, n))
            k_pages[:, blk, :chunk.stop - chunk.start] = kv[0][:, chunk]
            v_pages[:, blk, :chunk.stop - chunk.start] = kv[1][:, chunk]
        dense_k.append(kv[0].astype(np.float64))
        dense_v.append(kv[1].astype(np.float64))
    return (jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype), jnp.asarray(tables),
            dense_k, dense_v)


def dense_softmax_attention(q, k, v, scale):
    """q [H, D] against k, v [KVH, n, D], float64; n == 0 gives zeros."""
    h, d = q.shape
    kvh, n = k.shape[0], k.shape[1]
    if n == 0:
        return np.zeros((h, d))
    kk = np.repeat(k, h // kvh, axis=0)  # [H, n, D]: head i reads kv head i // group
    vv = np.repeat(v, h // kvh, axis=0)
    logits = np.einsum("hd,hnd->hn", q, kk) * scale
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hn,hnd->hd", p, vv)


def assert_close(out, truth, rtol):
    out = np.asarray(jnp.asarray(out, jnp.float32), np.float64)
    assert np.all(np.isfinite(out)), "non-finite output: a masked or unowned slot leaked"
    err = np.max(np.abs(out - truth)) / max(np.max(np.abs(truth)), 1e-30)
    assert err <= rtol, f"relative error {err:.3g} > {rtol}"


@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim", [
    (4, 4, 4, 16), (8, 9, 3, 64), (16, 8, 2, 32), (8, 8, 1, 64),
])
def test_paged_reference_matches_dense(block_size, num_heads, num_kv_heads, head_dim):
    rng = np.random.default_rng(block_size * 100 + num_heads)
    bs = block_size
    lengths = np.array([0, 1, bs, bs + 1, 5 * bs, 3 * bs - 2], np.int32)
    k_pages, v_pages, tables, dk, dv = write_paged(
        rng, lengths, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=bs)
    q = rng.standard_normal((len(lengths), num_heads, head_dim)).astype(np.float32)
    out = jax.jit(paged_attention_reference)(jnp.asarray(q), k_pages, v_pages, tables,
                                             jnp.asarray(lengths))
    truth = np.stack([dense_softmax_attention(q[b].astype(np.float64), dk[b], dv[b],
                                              head_dim**-0.5) for b in range(len(lengths))])
    assert out.dtype == jnp.float32 and out.shape == q.shape
    assert_close(out, truth, 1e-5)
    assert np.all(np.asarray(out[0]) == 0.0)  # length 0: exact zeros


def test_paged_reference_bf16_and_scale():
    rng = np.random.default_rng(7)
    lengths = np.array([3, 17, 0], np.int32)
    k_pages, v_pages, tables, dk, dv = write_paged(
        rng, lengths, num_kv_heads=2, head_dim=32, block_size=8, dtype=jnp.bfloat16)
    q = jnp.asarray(rng.standard_normal((3, 4, 32)), jnp.bfloat16)
    out = jax.jit(paged_attention_reference, static_argnames="scale")(
        q, k_pages, v_pages, tables, jnp.asarray(lengths), scale=0.3)
    q64 = np.asarray(q.astype(jnp.float32), np.float64)
    truth = np.stack([dense_softmax_attention(q64[b], dk[b], dv[b], 0.3) for b in range(3)])
    assert out.dtype == jnp.bfloat16
    assert_close(out, truth, 1e-2)  # bf16 output rounding only: the math is f32


def test_contiguous_reference_matches_dense():
    rng = np.random.default_rng(3)
    b, h, kvh, max_len, d = 4, 6, 2, 21, 16
    lengths = np.array([0, 1, 21, 9], np.int32)
    k = rng.standard_normal((b, kvh, max_len, d)).astype(np.float32)
    v = rng.standard_normal((b, kvh, max_len, d)).astype(np.float32)
    for i, n in enumerate(lengths):  # slots past the length are garbage, never read
        k[i, :, n:], v[i, :, n:] = np.nan, np.nan
    q = rng.standard_normal((b, h, d)).astype(np.float32)
    out = jax.jit(contiguous_attention_reference)(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v),
                                         jnp.asarray(lengths))
    truth = np.stack([dense_softmax_attention(q[i].astype(np.float64), k[i, :, :n].astype(np.float64),
                                              v[i, :, :n].astype(np.float64), d**-0.5)
                      for i, n in enumerate(lengths)])
    assert_close(out, truth, 1e-5)


# ---------------------------------------------------------------------------------------------
# ragged (prefill + decode) reference
# ---------------------------------------------------------------------------------------------


def naive_ragged(q, dense_k, dense_v, context_lens, query_start_loc, num_seqs, scale):
    """Loop over sequences and their tokens: token i of sequence s sees positions <= its own."""
    out = np.zeros(q.shape)
    for s in range(num_seqs):
        lo, hi = query_start_loc[s], query_start_loc[s + 1]
        for t in range(lo, hi):
            pos = context_lens[s] - (hi - lo) + (t - lo)
            out[t] = dense_softmax_attention(q[t], dense_k[s][:, :pos + 1], dense_v[s][:, :pos + 1],
                                             scale)
    return out


def ragged_case(rng, context_lens, q_lens, *, num_tokens, num_seqs_total, block_size=8,
                num_heads=6, num_kv_heads=2, head_dim=16, max_blocks=None, num_blocks=None,
                pad_fill=0):
    """Builds the arguments of ragged_paged_attention_reference plus the numpy truth.

    Sequences past len(context_lens) are padding: context 0, zero block-table rows, and
    query_start_loc entries filled with pad_fill (their values must not matter).
    """
    n = len(context_lens)
    lens = list(context_lens) + [0] * (num_seqs_total - n)
    k_pages, v_pages, tables, dk, dv = write_paged(
        rng, lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
        max_blocks=max_blocks, num_blocks=num_blocks)
    qsl = np.full(num_seqs_total + 1, pad_fill, np.int32)
    qsl[:n + 1] = np.concatenate([[0], np.cumsum(q_lens)])
    assert qsl[n] <= num_tokens
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    ctx = np.asarray(lens, np.int32)
    truth = naive_ragged(q.astype(np.float64), dk, dv, ctx, qsl, n, head_dim**-0.5)
    args = (jnp.asarray(q), k_pages, v_pages, tables, jnp.asarray(ctx), jnp.asarray(qsl),
            jnp.int32(n))
    return args, truth


ragged_jit = jax.jit(ragged_paged_attention_reference)


@pytest.mark.parametrize("name,context_lens,q_lens,num_tokens,num_seqs_total,pad_fill", [
    ("decode_only", [5, 1, 16, 17], [1, 1, 1, 1], 4, 4, 0),
    ("prefill_only", [7, 16, 9], [7, 16, 9], 32, 3, 0),
    ("mixed", [30, 1, 12, 8], [1, 1, 12, 3], 17, 4, 0),
    ("chunk_mid_block", [21, 13], [7, 10], 17, 2, 0),  # chunks start at positions 14 and 3
    ("padding_seqs_and_tokens", [9, 4], [3, 4], 12, 5, 0),
    ("padding_qsl_repeats_last", [9, 4], [3, 4], 12, 5, 7),
    ("empty_chunk_in_middle", [6, 5, 3], [2, 0, 3], 8, 3, 0),
])
def test_ragged_reference_matches_naive_loop(name, context_lens, q_lens, num_tokens,
                                             num_seqs_total, pad_fill):
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    args, truth = ragged_case(rng, context_lens, q_lens, num_tokens=num_tokens,
                              num_seqs_total=num_seqs_total, pad_fill=pad_fill)
    out = ragged_jit(*args)
    assert out.shape == args[0].shape
    assert_close(out, truth, 1e-5)
    last = sum(q_lens)
    assert np.all(np.asarray(out[last:]) == 0.0), "padding tokens must give zeros"


def test_ragged_reference_zero_seqs_gives_zeros():
    rng = np.random.default_rng(0)
    args, _ = ragged_case(rng, [4], [2], num_tokens=4, num_seqs_total=2)
    args = args[:-1] + (jnp.int32(0),)
    assert np.all(np.asarray(ragged_jit(*args)) == 0.0)


def test_ragged_reference_decode_equals_paged_reference():
    # One token per sequence at the end of its context is exactly decode attention.
    rng = np.random.default_rng(11)
    ctx = [3, 8, 9, 20]
    args, _ = ragged_case(rng, ctx, [1] * 4, num_tokens=4, num_seqs_total=4, num_heads=9,
                          num_kv_heads=3, head_dim=32)
    q, k_pages, v_pages, tables, context_lens, _, _ = args
    ragged = ragged_jit(*args)
    decode = jax.jit(paged_attention_reference)(q, k_pages, v_pages, tables, context_lens)
    np.testing.assert_allclose(np.asarray(ragged), np.asarray(decode), rtol=1e-6, atol=1e-6)


@settings(max_examples=20, deadline=None)
@given(st.data())
def test_ragged_reference_random_layouts(data):
    # Fixed shapes (one compile) with everything else traced and drawn at random.
    num_seqs = data.draw(st.integers(0, 4), label="num_seqs")
    q_lens, context_lens, budget = [], [], 24
    for _ in range(num_seqs):
        q_len = data.draw(st.integers(0, min(9, budget)))
        budget -= q_len
        q_lens.append(q_len)
        context_lens.append(data.draw(st.integers(max(q_len, 1), 40)))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    args, truth = ragged_case(rng, context_lens, q_lens, num_tokens=24, num_seqs_total=4,
                              max_blocks=5, num_blocks=24, pad_fill=data.draw(st.integers(0, 24)))
    assert_close(ragged_jit(*args), truth, 1e-5)
