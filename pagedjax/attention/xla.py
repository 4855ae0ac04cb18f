"""A layer's attention on a CPU in XLA ops: the "reference" backend (pagedjax.attention).

The stacked pool is only read inside the layer loop; the step's own K/V are written once after
it. Why: on a CPU, a pool fed to lax.scan as xs is copied slice by slice (~150 ms a step at batch
32 and 512-token contexts for SmolLM2, measured), and a pool carried through the loop and
scattered into costs more still. So each token attends to two parts, merged in one softmax:
its row's *cached* context (positions before the row's new tokens), read page chunk by page
chunk from the pool (`context_attention`), and the step's own K/V of its row, causal
(`split_attention`). A request must therefore never read, in the same step, a block another
request is filling: the KV cache manager keeps such blocks pending until the step has run.

`pagedjax.native.attention` computes the same in one C++ call (the "native" backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.attention.metadata import TokenLayout

# Work sizes of `context_attention`: a tile of query tokens reads its rows' pages a chunk at a
# time. On a 2-core x86 CPU (scripts/bench_step.py, SmolLM2, 30 layers, block size 16) tiles of 16
# tokens reading 32 context positions (2 pages) per iteration were the fastest of 8-32 tokens x
# 16-128 positions: one chunk's gathered K (16 x 2 pages x 12 KiB) stays in L2. A tile that is one
# row (a prefill chunk after cached context) reads 128 positions per iteration. Chunks are whole
# pages, at least one, so tiny blocks do not mean tiny loop iterations.
CTX_TILE_TOKENS = 16
CTX_CHUNK_TOKENS = 32
CTX_ROW_CHUNK_TOKENS = 128


def context_attention(q, k_cache, v_cache, layer, tables, seq, start, *, tile: int = CTX_TILE_TOKENS,
                      chunk_tokens: int = CTX_CHUNK_TOKENS, row_chunk_tokens: int = CTX_ROW_CHUNK_TOKENS):
    """Each token's attention over its row's *cached* context (positions < start), read from the
    pool page chunk by page chunk, returned as an online-softmax state to merge with the step's
    own K/V.

    The work follows the live tokens, not the bucket: tokens are sorted by how much context they
    have, tiles of `tile` tokens run only while some token still has context (tokens of a fresh
    prompt, start 0, cost nothing), and each tile loops only over the pages its longest row has.
    A tile whose tokens all belong to one row (a prefill chunk after cached context) reads that
    row's pages once and attends with a matmul; a mixed tile reads each token's pages.

    q [T, KVH, G, D] float32, already scaled; k_cache, v_cache the stacked pool
    [L, KVH, NB, BS, D]; layer an int32 scalar; tables [T, P] each token's row's block table;
    seq [T] each token's row (-1 for padding); start [T] cached positions before the token's
    row's new tokens (0 for padding). Returns (m [T, KVH, G], denom [T, KVH, G], o [T, KVH, G, D]),
    o not yet divided by denom; m is -inf where a token has no context.
    """
    T, KVH, G, D = q.shape
    bs = k_cache.shape[3]
    tile = min(tile, T)
    c = max(1, chunk_tokens // bs)          # pages per iteration
    chunk = c * bs
    rc = max(1, row_chunk_tokens // bs)
    order = jnp.argsort(-start, stable=True)        # most context first; a row's tokens stay together
    Tp = -(-T // tile) * tile
    pad_t = Tp - T
    st = jnp.pad(start[order], (0, pad_t))
    sq = jnp.pad(seq[order], (0, pad_t), constant_values=-1)
    tab = jnp.pad(tables[order], ((0, pad_t), (0, (-tables.shape[1]) % (c * rc))))
    qs = jnp.pad(q[order], ((0, pad_t), (0, 0), (0, 0), (0, 0)))
    n_tiles = (jnp.sum(st > 0) + tile - 1) // tile
    cdims = (tile, KVH, G)

    def read_pages(cache, pages):
        # a page of one kv head is one contiguous row of bs * D values: gathering rows is ~15 %
        # faster on the CPU than gathering [bs, D] slices
        L_, _, NB, _, _ = cache.shape
        rows = cache.reshape(L_, KVH, NB, bs * D)[layer, :, pages]
        return rows.reshape(*pages.shape, KVH, bs, D)

    def run_tile(i, out):
        t0 = i * tile
        qt, stt, tabt, sqt = (jax.lax.dynamic_slice_in_dim(x, t0, tile) for x in (qs, st, tab, sq))
        empty = (jnp.full(cdims, -jnp.inf, jnp.float32), jnp.zeros(cdims, jnp.float32),
                 jnp.zeros((*cdims, D), jnp.float32))

        def one_row():
            # every token of the tile belongs to one row: read its pages once, rc pages at a
            # time, as [tile * G, D] x [D, rc * bs] products, with an online softmax
            def body(j, carry):
                m, den, o = carry
                pages = jax.lax.dynamic_slice_in_dim(tabt[0], j * rc, rc)                 # [rc]
                k, v = read_pages(k_cache, pages), read_pages(v_cache, pages)            # [rc, KVH, bs, D]
                s = jnp.einsum("tkgd,ckjd->tkgcj", qt, k.astype(jnp.float32)).reshape(*cdims, rc * bs)
                pos = j * rc * bs + jnp.arange(rc * bs)
                s = jnp.where(pos[None, None, None, :] < stt[:, None, None, None], s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = jnp.einsum("tkgcj,ckjd->tkgd", p.reshape(*cdims, rc, bs), v.astype(jnp.float32))
                return m_new, den * alpha + jnp.sum(p, axis=-1), o * alpha[..., None] + pv

            return jax.lax.fori_loop(0, -(-stt[0] // (rc * bs)), body, empty)   # longest context first

        def per_token():
            # tokens of several rows: each reads its own row's pages, c at a time. Scores of every
            # chunk first, one softmax, then the values: fewer small ops per loop iteration than
            # an online softmax, which matters for 16-token tiles on a CPU
            n = -(-stt[0] // chunk)
            width = tab.shape[1] * bs

            def scores(j, s_all):
                pages = jax.lax.dynamic_slice_in_dim(tabt, j * c, c, axis=1)             # [tile, c]
                s = jnp.einsum("tkgd,tckjd->tkgcj", qt, read_pages(k_cache, pages).astype(jnp.float32))
                return jax.lax.dynamic_update_slice_in_dim(s_all, s.reshape(*cdims, chunk), j * chunk, 3)

            s_all = jax.lax.fori_loop(0, n, scores, jnp.full((*cdims, width), -jnp.inf, jnp.float32))
            s_all = jnp.where(jnp.arange(width)[None, None, None, :] < stt[:, None, None, None], s_all, -jnp.inf)
            m = jnp.max(s_all, axis=-1)
            p = jnp.exp(s_all - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])

            def values(j, o):
                pages = jax.lax.dynamic_slice_in_dim(tabt, j * c, c, axis=1)
                pj = jax.lax.dynamic_slice_in_dim(p, j * chunk, chunk, 3).reshape(*cdims, c, bs)
                return o + jnp.einsum("tkgcj,tckjd->tkgd", pj, read_pages(v_cache, pages).astype(jnp.float32))

            return m, jnp.sum(p, axis=-1), jax.lax.fori_loop(0, n, values, empty[2])

        state = jax.lax.cond((sqt[0] == sqt[-1]) & (sqt[0] >= 0), one_row, per_token)
        return tuple(jax.lax.dynamic_update_slice_in_dim(acc, x, t0, 0) for acc, x in zip(out, state))

    out = (jnp.full((Tp, KVH, G), -jnp.inf, jnp.float32), jnp.zeros((Tp, KVH, G), jnp.float32),
           jnp.zeros((Tp, KVH, G, D), jnp.float32))
    m, den, o = jax.lax.fori_loop(0, n_tiles, run_tile, out)
    inv = jnp.argsort(order)
    return m[inv], den[inv], o[inv]


def split_attention(qg, k_new, v_new, ctx, seq, pos, valid):
    """One softmax over two parts: a token's cached context (the state `context_attention`
    returns) and this step's own K/V (same row, causal).

    qg [T, KVH, G, D] float32, scaled; k_new, v_new [T, KVH, D]; ctx = (m, denom, o) per token
    and query head; seq, pos, valid from `token_layout`. Returns f32 [T, KVH * G, D]."""
    T, KVH, G, D = qg.shape
    m_ctx, den_ctx, o_ctx = ctx
    s_new = jnp.einsum("tkgd,ukd->tkgu", qg, k_new.astype(jnp.float32))
    m_new = (seq[None, :] == seq[:, None]) & (pos[None, :] <= pos[:, None]) & valid[None, :] & valid[:, None]
    s_new = jnp.where(m_new[:, None, None, :], s_new, -jnp.inf)
    m = jnp.maximum(m_ctx, jnp.max(s_new, axis=-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p_new = jnp.exp(s_new - m[..., None])
    alpha = jnp.exp(m_ctx - m)
    denom = den_ctx * alpha + jnp.sum(p_new, axis=-1)
    o = o_ctx * alpha[..., None] + jnp.einsum("tkgu,ukd->tkgd", p_new, v_new.astype(jnp.float32))
    o = o / jnp.where(denom > 0, denom, 1.0)[..., None]
    return o.reshape(T, KVH * G, D)


def xla_attention(qg, k_new, v_new, k_cache, v_cache, layer, tables, layout: TokenLayout):
    """A layer's attention on the CPU path in XLA ops: `context_attention` over each token's
    cached context, merged by `split_attention` with the step's own K/V.

    qg [T, KVH, G, D] float32, scaled; k_new, v_new [T, KVH, D]; the stacked pool
    [L, KVH, NB, BS, D]; layer an int32 scalar; tables [T, P] each token's row's block table.
    Returns f32 [T, KVH * G, D]. `pagedjax.native.attention` is the same in one C++ call."""
    seq, pos, start, valid = layout
    ctx = context_attention(qg, k_cache, v_cache, layer, tables, jnp.where(valid, seq, -1),
                            jnp.where(valid, start, 0))
    return split_attention(qg, k_new, v_new, ctx, seq, pos, valid)
