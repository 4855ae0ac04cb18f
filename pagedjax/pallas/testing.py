"""Inputs for checking a kernel against its reference, on a CPU or on the device itself.

Every case draws fresh random inputs and scatters each sequence over shuffled physical blocks of
a pool that is NaN everywhere a sequence does not own: the null block 0, spare blocks, the slots
past a sequence's length. A kernel that reads one slot it should not gives NaN, which no
tolerance hides. The tests (tests/test_*attention.py) and scripts/device_check.py use them.

    paged_case(seed, ...)  -> (q, k_pages, v_pages, block_tables, lengths)            decode
    ragged_case(seed, seqs, ...) -> (q, k_pages, v_pages, block_tables, context_lens,
                                     query_start_loc, num_seqs)                    mixed step
    to_contiguous(k_pages, block_tables, max_len) -> [B, KVH, max_len, D]
    relative_error(out, ref) -> max |out - ref| / max |ref|, in f32
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

# What padding seats hold where a real sequence holds a length or an offset: far out of range.
GARBAGE = 1 << 20


def _fill(rng, k_pages, v_pages, blocks, length):
    """Random K/V for a sequence of `length` tokens in `blocks`; the last page's tail stays NaN."""
    kvh, _, bs, d = k_pages.shape
    for i, blk in enumerate(blocks):
        filled = min(bs, length - i * bs)
        k_pages[:, blk, :filled] = rng.standard_normal((kvh, filled, d))
        v_pages[:, blk, :filled] = rng.standard_normal((kvh, filled, d))


def paged_case(seed, *, block_size, num_heads, num_kv_heads, head_dim, dtype, max_blocks=4,
               batch_lengths=None):
    """Fresh random decode inputs over a NaN-filled pool. Default lengths: 0 (a padding row),
    1, a block, a block and one, the whole table, and a random one."""
    rng = np.random.default_rng(seed)
    bs = block_size
    if batch_lengths is None:
        batch_lengths = [0, 1, bs, bs + 1, max_blocks * bs, int(rng.integers(2, max_blocks * bs))]
    lengths = np.asarray(batch_lengths, np.int32)
    need = -(-lengths // bs)
    num_blocks = 1 + int(need.sum()) + 3  # block 0 is the null block; 3 spare blocks stay NaN
    shape = (num_kv_heads, num_blocks, bs, head_dim)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    physical = rng.permutation(np.arange(1, num_blocks))  # shuffled block-table order
    tables = np.zeros((len(lengths), max_blocks), np.int32)
    used = 0
    for b, n in enumerate(lengths):
        tables[b, :need[b]] = physical[used:used + need[b]]
        used += need[b]
        _fill(rng, k_pages, v_pages, tables[b, :need[b]], n)
    q = rng.standard_normal((len(lengths), num_heads, head_dim))
    return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(tables), jnp.asarray(lengths))


def ragged_case(seed, seqs, *, block_size, num_heads, num_kv_heads, head_dim, dtype, num_tokens,
                num_seats, max_blocks, num_blocks=None):
    """Fresh random inputs for one mixed step. seqs: (context_len, q_len) of each live sequence,
    in order. Table entries past a sequence's last page are stale (random pages), not 0; padding
    seats (>= num_seqs) hold garbage lengths, tables and offsets; padding query rows are NaN."""
    rng = np.random.default_rng(seed)
    bs = block_size
    need = [-(-c // bs) for c, _ in seqs]
    # Block 0 is the null block; at least 3 spare blocks stay NaN.
    num_blocks = num_blocks or 1 + sum(need) + 3
    shape = (num_kv_heads, num_blocks, bs, head_dim)
    k_pages, v_pages = np.full(shape, np.nan, np.float32), np.full(shape, np.nan, np.float32)
    physical = rng.permutation(np.arange(1, 1 + sum(need)))  # shuffled block-table order
    # Padding seats point anywhere, NaN pages and other sequences' pages alike.
    tables = rng.integers(0, num_blocks, (num_seats, max_blocks)).astype(np.int32)
    context_lens = np.full(num_seats, GARBAGE, np.int32)
    qsl = np.full(num_seats + 1, GARBAGE, np.int32)
    qsl[0] = 0
    used = 0
    for s, (ctx, q_len) in enumerate(seqs):
        # Entries past a sequence's last page are normally 0; here they are stale (random pages):
        # nothing past context_lens may be read through them.
        tables[s, :need[s]] = physical[used:used + need[s]]
        used += need[s]
        _fill(rng, k_pages, v_pages, tables[s, :need[s]], ctx)
        context_lens[s] = ctx
        qsl[s + 1] = qsl[s] + q_len
    q = rng.standard_normal((num_tokens, num_heads, head_dim)).astype(np.float32)
    q[qsl[len(seqs)]:] = np.nan  # padding rows must give zeros whatever they hold
    return (jnp.asarray(q, dtype), jnp.asarray(k_pages, dtype), jnp.asarray(v_pages, dtype),
            jnp.asarray(tables), jnp.asarray(context_lens), jnp.asarray(qsl),
            jnp.int32(len(seqs)))


def to_contiguous(k_pages, tables, max_len):
    """[KVH, NB, bs, D] pages + tables -> [B, KVH, max_len, D]: the same cache, laid out contiguously."""
    kvh, _, bs, d = k_pages.shape
    g = k_pages[:, tables]  # [KVH, B, MB, bs, D]
    g = jnp.moveaxis(g, 0, 1).reshape(tables.shape[0], kvh, -1, d)
    return g[:, :, :max_len]


def relative_error(out, ref) -> float:
    """max |out - ref| / max |ref| in f32 (inf if out holds a NaN or inf)."""
    out32 = np.asarray(jnp.asarray(out).astype(jnp.float32))
    ref32 = np.asarray(jnp.asarray(ref).astype(jnp.float32))
    if not np.all(np.isfinite(out32)):
        return float("inf")
    return float(np.max(np.abs(out32 - ref32)) / max(np.max(np.abs(ref32)), 1e-30))
