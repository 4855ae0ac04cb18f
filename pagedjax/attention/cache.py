"""The KV pool and how a step's K/V get into it.

    (k_cache, v_cache), each [num_layers, num_kv_heads, num_blocks, block_size, head_dim]

A token's flat slot is block_id * block_size + offset; slot -1 marks a padding token, whose K/V
is not written. Block 0 is the null block: padding rows of a block table point at it, so a
kernel that follows an unused entry reads in bounds (and masks what it reads).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def init_kv_cache(cfg, num_blocks: int, block_size: int, dtype: Any = jnp.float32):
    """Zeroed `(k_cache, v_cache)`, each `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`."""
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


def _finite(new, dtype):
    # The pool never holds a non-finite value: a request whose activations overflow ends with an
    # error, and its blocks are reused by others whose attention must not meet 0 * NaN.
    return jnp.where(jnp.isfinite(new), new, 0).astype(dtype)


def _bits(x: jax.Array) -> jax.Array:
    """A 16-bit float array viewed as uint16 (anything else as it is). XLA on a CPU has no native
    bfloat16 arithmetic: a scatter into a bfloat16 pool converts the whole pool to float32 and
    back every step, while the same scatter over its bits moves only the written rows."""
    return jax.lax.bitcast_convert_type(x, jnp.uint16) if x.dtype.itemsize == 2 and x.dtype != jnp.uint16 else x


def _unbits(x: jax.Array, dtype) -> jax.Array:
    return jax.lax.bitcast_convert_type(x, dtype) if x.dtype != dtype else x


def values_dtype(cache: jax.Array):
    """The dtype of the values a pool holds: a uint16 pool holds bfloat16 values as their bits (the
    native CPU backend keeps a bfloat16 pool so: XLA on a CPU turns the bits of a scattered
    bfloat16 pool back into bfloat16 by copying the whole pool, every step)."""
    return jnp.bfloat16 if cache.dtype == jnp.uint16 else cache.dtype


def write_kv(cache: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new K or V into the paged cache at flat slots; slot -1 rows are dropped.

    cache: [..., KVH, num_blocks, block_size, D]; new: [..., T, KVH, D] with the same leading dims
    (the whole stack after a layer loop: [L, T, KVH, D] into [L, KVH, ...]).
    """
    *lead, kvh, nb, bs, d = cache.shape
    flat = _bits(cache).reshape(*lead, kvh, nb * bs, d)
    # -1 would wrap around to the last slot under numpy indexing rules: send it out of range instead,
    # where mode="drop" discards it.
    slots = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)
    if slots.shape[0] == 1:
        # one row: XLA turns the scatter into a dynamic-update-slice that reads the slot it
        # replaces (to drop it), and on a CPU copies the whole pool to do that; a second,
        # dropped row keeps it a scatter, done in place
        slots = jnp.concatenate([slots, jnp.full(1, nb * bs, slots.dtype)])
        new = jnp.concatenate([new, jnp.zeros_like(new)], axis=-3)
    flat = flat.at[..., slots, :].set(jnp.swapaxes(_bits(_finite(new, values_dtype(cache))), -3, -2), mode="drop")
    return _unbits(flat.reshape(cache.shape), cache.dtype)


def write_layer(cache: jax.Array, layer: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter one layer's new K or V [T, KVH, D] into the stacked pool [L, KVH, NB, BS, D] at
    `layer`, in place when the pool is a loop carry (no layer is sliced out and copied)."""
    _, kvh, nb, bs, d = cache.shape
    t = new.shape[0]
    block = jnp.where(slot_mapping < 0, nb, slot_mapping // bs)  # out of range: dropped
    offset = slot_mapping % bs
    # one head_dim row per (token, kv head): a scatter whose window is the minor dimension alone
    # leaves the pool in its row-major layout, the one the Pallas kernels read
    heads = jnp.tile(jnp.arange(kvh, dtype=jnp.int32), t)
    rows = _bits(_finite(new, values_dtype(cache))).reshape(t * kvh, d)
    out = _bits(cache).at[layer, heads, jnp.repeat(block, kvh), jnp.repeat(offset, kvh), :].set(rows, mode="drop")
    return _unbits(out, cache.dtype)
