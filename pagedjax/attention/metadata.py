"""What attention knows about one step: the AttentionMetadata the packer fills (defined once, with
the rest of the step's inputs, in pagedjax.scheduler.batch), registered here as a pytree so the
jitted step takes it as it is; and the TokenLayout the CPU backends derive from it once a step.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from pagedjax.scheduler.batch import AttentionMetadata, step_fields

jax.tree_util.register_dataclass(AttentionMetadata, data_fields=step_fields(AttentionMetadata), meta_fields=[])


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
