"""The CPU path's attention (`context_attention` + `split_attention`, what `forward_split` runs per
layer) against the pure-jnp ragged reference, on ragged batches that reach every branch: tokens of
fresh prompts (no cached context), decode tokens, prefill chunks after cached context that fill
whole 16-token tiles (the one-row branch) or share tiles with other rows (the per-token branch),
padding rows and tokens, block sizes from 1 to 32 and contexts ending on and off chunk edges."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax.model.llama import AttentionMetadata, context_attention, split_attention, token_layout, write_kv
from pagedjax.pallas.reference import ragged_paged_attention_reference

KVH, G, D = 2, 3, 16


def make_batch(rng, rows, block_size, T, S, P, num_blocks):
    """rows: [(cached, new)] per sequence. Returns the pool holding random cached K/V (and NaN-free
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
    q = jnp.asarray(rng.standard_normal((T, KVH * G, D)).astype(np.float32))
    k = jnp.asarray(rng.standard_normal((T, KVH, D)).astype(np.float32))
    v = jnp.asarray(rng.standard_normal((T, KVH, D)).astype(np.float32))
    return (jnp.asarray(k_pool), jnp.asarray(v_pool)), q, k, v, attn


@jax.jit
def cpu_path(q, k, v, pool, attn):
    k_pool, v_pool = pool
    T = q.shape[0]
    seq, pos, start, valid = token_layout(attn, T)
    qg = q.reshape(T, KVH, G, D) * D ** -0.5
    ctx = context_attention(qg, k_pool, v_pool, jnp.int32(0), attn.block_tables[seq],
                            jnp.where(valid, seq, -1), jnp.where(valid, start, 0))
    return split_attention(qg, k, v, ctx, seq, pos, valid), valid


@jax.jit
def reference(q, k, v, pool, attn):
    k_pool, v_pool = (write_kv(c, x[None], attn.slot_mapping)[0] for c, x in zip(pool, (k, v)))
    return ragged_paged_attention_reference(q, k_pool, v_pool, attn.block_tables, attn.context_lens,
                                            attn.query_start_loc, attn.num_seqs)


CASES = {
    # (cached, new) per row
    "decode only": [(c, 1) for c in (1, 5, 16, 17, 31, 32, 33, 64, 100, 7)],
    "fresh prompts only": [(0, 20), (0, 1), (0, 16), (0, 9)],
    "one long chunk after context (one-row tiles)": [(70, 48)],
    "chunks sharing tiles": [(40, 5), (3, 7), (0, 6), (90, 13), (16, 16), (1, 1)],
    "mixed step": [(50, 1), (0, 24), (33, 1), (120, 20), (0, 3), (15, 1), (64, 1)],
}


@pytest.mark.parametrize("block_size", [1, 4, 16, 32])
@pytest.mark.parametrize("case", list(CASES))
def test_cpu_attention_matches_reference(case, block_size):
    rows = CASES[case]
    rng = np.random.default_rng(hash((case, block_size)) % 2**32)
    T = -(-sum(n for _, n in rows) // 8) * 8 + 8            # padding tokens at the end
    S = len(rows) + 2                                        # padding rows
    P = -(-max(c + n for c, n in rows) // block_size) + 1    # one spare table column
    pool, q, k, v, attn = make_batch(rng, rows, block_size, T, S, P, num_blocks=S * P + 2)
    got, valid = cpu_path(q, k, v, pool, attn)
    want = reference(q, k, v, pool, attn)
    valid = np.asarray(valid)
    assert valid.sum() == sum(n for _, n in rows)
    np.testing.assert_allclose(np.asarray(got)[valid], np.asarray(want)[valid], rtol=2e-5, atol=2e-5)
    assert np.all(np.isfinite(np.asarray(got)))
