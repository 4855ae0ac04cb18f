"""What attention needs to know about one step, described once.

AttentionMetadata is built on the host by the packer (fixed shapes per bucket) and passed into the
jitted step as it is; TokenLayout is what the CPU backends derive from it once per step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class AttentionMetadata(NamedTuple):
    """What the paged attention needs for one step; built on the host, fixed shapes per bucket.

    slot_mapping:    int32[T]    flat cache slot of each token (block_id * block_size + offset), -1 = padding
    block_tables:    int32[S, max_blocks_per_seq]  physical blocks of each sequence (unused entries 0)
    context_lens:    int32[S]    tokens of each sequence in the cache *including* this step's tokens
    query_start_loc: int32[S+1]  sequence s owns query rows query_start_loc[s]:query_start_loc[s+1]
    num_seqs:        int32[]     live sequences (rows >= num_seqs are padding)
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array


class TokenLayout(NamedTuple):
    """Per token of a step: its row (sequence), its position, where its row's new tokens start
    (= the row's cached positions), and whether it is a real token."""

    seq: jax.Array
    pos: jax.Array
    start: jax.Array
    valid: jax.Array


def token_layout(attn: AttentionMetadata, T: int) -> TokenLayout:
    """The `TokenLayout` of a step of T tokens. Rows >= num_seqs are padding."""
    qsl = attn.query_start_loc
    S = attn.block_tables.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    live = jnp.arange(S) < attn.num_seqs
    seq = jnp.sum(live[None, :] & (qsl[1:][None, :] <= t[:, None]), axis=1)
    seq = jnp.minimum(seq, S - 1)
    valid = (t >= qsl[0]) & (t < qsl[jnp.clip(attn.num_seqs, 0, S)])
    q_len = qsl[seq + 1] - qsl[seq]
    start = attn.context_lens[seq] - q_len          # first position written this step
    pos = start + (t - qsl[seq])
    return TokenLayout(seq, pos, start, valid)
