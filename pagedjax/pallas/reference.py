"""Pure-jnp attention over paged and contiguous KV caches: the oracle every kernel is tested against.

Short and obviously correct rather than fast: each function gathers the keys and values a query
may see into a dense array, masks, and takes an f32 softmax. The runner also uses
`ragged_paged_attention_reference` for prefill until a ragged kernel exists.

Shapes and layouts (B sequences, H query heads, KVH kv heads, D head_dim):
  q            [B, H, D]                      one query token per sequence (decode)
  k_pages      [KVH, num_blocks, block_size, D]  the block pool; v_pages the same
  block_tables int32[B, max_blocks_per_seq]   logical block i of sequence b lives in physical
                                              block block_tables[b, i]; unused entries are 0,
                                              the null block
  lengths      int32[B]                       tokens in the cache for each sequence; 0 marks a
                                              padding row, whose output is zeros
  k, v         [B, KVH, max_len, D]           a contiguous cache, one slab per sequence

GQA: query head h reads kv head h // (H // KVH). `scale` defaults to D ** -0.5. Softmax and
accumulation run in f32 whatever the input dtype; the output has q's dtype.

Nothing outside the valid positions can leak into the output, even NaN: masked logits are
replaced (not added to) and masked values are zeroed before the weighted sum, because stale or
never-written cache slots may hold anything.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

__all__ = [
    "paged_attention_reference",
    "ragged_paged_attention_reference",
    "contiguous_attention_reference",
]


def _masked_attention(q, k, v, mask, scale):
    """softmax(q k^T * scale) v over the positions where mask is True, in f32.

    q [..., G, D], k and v [..., S, D], mask broadcastable to [..., G, S]. Rows with no valid
    position give zeros.
    """
    q32, k32, v32 = (x.astype(jnp.float32) for x in (q, k, v))
    logits = jnp.einsum("...gd,...sd->...gs", q32, k32, precision=lax.Precision.HIGHEST) * scale
    logits = jnp.where(mask, logits, -jnp.inf)
    m = jnp.max(logits, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)  # all-masked row: keep exp() away from inf - inf
    p = jnp.where(mask, jnp.exp(logits - m), 0.0)
    l = jnp.sum(p, axis=-1, keepdims=True)
    v_mask = jnp.any(mask, axis=-2)[..., :, None]  # [..., S, 1]: a position some row may read
    v32 = jnp.where(v_mask, v32, 0.0)  # 0 * NaN would still be NaN
    out = jnp.einsum("...gs,...sd->...gd", p, v32, precision=lax.Precision.HIGHEST)
    return out / jnp.where(l > 0, l, 1.0)


def _default_scale(scale, head_dim):
    return head_dim**-0.5 if scale is None else scale


def _gather_pages(pages, block_tables):
    """[KVH, num_blocks, bs, D] gathered by int32[..., max_blocks] -> [..., KVH, max_blocks * bs, D]."""
    g = pages[:, block_tables]  # [KVH, ..., max_blocks, bs, D]
    g = jnp.moveaxis(g, 0, -4)  # [..., KVH, max_blocks, bs, D]
    return g.reshape(*g.shape[:-3], g.shape[-3] * g.shape[-2], g.shape[-1])


def contiguous_attention_reference(q, k, v, lengths, *, scale=None):
    """Decode attention over a contiguous cache.

    q [B, H, D]; k, v [B, KVH, max_len, D]; lengths int32[B] (positions >= lengths[b] are
    ignored; 0 gives zeros). Returns [B, H, D] in q.dtype.
    """
    b, h, d = q.shape
    kvh, max_len = k.shape[1], k.shape[2]
    qg = q.reshape(b, kvh, h // kvh, d)
    mask = jnp.arange(max_len)[None, :] < lengths[:, None]  # [B, S]
    out = _masked_attention(qg, k, v, mask[:, None, None, :], _default_scale(scale, d))
    return out.reshape(b, h, d).astype(q.dtype)


def paged_attention_reference(q, k_pages, v_pages, block_tables, lengths, *, scale=None):
    """Decode attention over a paged cache: gather each sequence's pages, then attend.

    q [B, H, D]; k_pages, v_pages [KVH, num_blocks, block_size, D]; block_tables
    int32[B, max_blocks_per_seq]; lengths int32[B]. Returns [B, H, D] in q.dtype.
    """
    k = _gather_pages(k_pages, block_tables)  # [B, KVH, max_blocks * bs, D]
    v = _gather_pages(v_pages, block_tables)
    return contiguous_attention_reference(q, k, v, lengths, scale=scale)


def ragged_paged_attention_reference(
    q, k_pages, v_pages, block_tables, context_lens, query_start_loc, num_seqs, *, scale=None,
    layer=None,
):
    """Causal attention for a step's tokens of many sequences (prefill chunks and decodes mixed).

    q               [T, H, D]   the step's query tokens, sequence after sequence, padded to T
    k_pages/v_pages [KVH, num_blocks, block_size, D], already holding this step's new K/V; with
                    `layer` (an int32 scalar), the stacked pool [L, KVH, ...] of which that
                    layer is read
    block_tables    int32[S, max_blocks]
    context_lens    int32[S]    cached tokens of each sequence INCLUDING this step's tokens
    query_start_loc int32[S+1]  sequence s owns q rows query_start_loc[s]:query_start_loc[s+1]
    num_seqs        int32 scalar (may be traced); sequences >= num_seqs are padding and their
                                entries of query_start_loc are ignored
    Row t of sequence s sits at absolute position context_lens[s] - q_len_s + (t - query_start_loc[s])
    and attends to kv positions <= its own. Rows outside
    query_start_loc[0]:query_start_loc[num_seqs] (padding tokens) give zeros. Returns [T, H, D].

    Cost: each token gathers its sequence's whole block table, T * KVH * max_blocks * block_size * D
    elements, so keep max_blocks bucketed to the live context.
    """
    if layer is not None:
        k_pages, v_pages = k_pages[layer], v_pages[layer]
    t_total, h, d = q.shape
    kvh = k_pages.shape[0]
    s_total = block_tables.shape[0]
    t = jnp.arange(t_total, dtype=jnp.int32)
    live = jnp.arange(s_total) < num_seqs  # [S]
    # The sequence of row t counts the live sequences that end at or before t; only entries
    # 0..num_seqs of query_start_loc are read, so padding entries may hold anything.
    ends = query_start_loc[1:]
    seq = jnp.sum(live[None, :] & (ends[None, :] <= t[:, None]), axis=1)  # [T]
    seq = jnp.minimum(seq, s_total - 1)
    last = query_start_loc[jnp.clip(num_seqs, 0, s_total)]
    valid = (t >= query_start_loc[0]) & (t < last)
    q_len = query_start_loc[seq + 1] - query_start_loc[seq]
    pos = context_lens[seq] - q_len + (t - query_start_loc[seq])  # [T]
    pos = jnp.where(valid, pos, -1)  # -1: sees nothing, so padding rows give zeros

    k = _gather_pages(k_pages, block_tables[seq])  # [T, KVH, L, D]
    v = _gather_pages(v_pages, block_tables[seq])
    mask = jnp.arange(k.shape[-2])[None, :] <= pos[:, None]  # [T, L]
    qg = q.reshape(t_total, kvh, h // kvh, d)
    out = _masked_attention(qg, k, v, mask[:, None, None, :], _default_scale(scale, d))
    return out.reshape(t_total, h, d).astype(q.dtype)
