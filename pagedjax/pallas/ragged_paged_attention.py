"""Pallas ragged paged attention: one step's prefill chunks and decode tokens of many sequences.

    ragged_paged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                           num_seqs, *, scale=None, variant="auto", interpret=None,
                           limits=None) -> [T, H, D]

Arguments (T step tokens, S sequence seats, H query heads, KVH kv heads, D head_dim):
  q               [T, H, D]  the step's query tokens, sequence after sequence, padded to T; same
                  dtype as the cache
  k_pages         [KVH, num_blocks, block_size, D]  the block pool, f32 or bf16, ALREADY holding
                  this step's new K; v_pages the same for V. With `layer` (an int32 scalar, may
                  be traced), the stacked pool of every layer [L, KVH, num_blocks, block_size, D],
                  of which the kernel reads that layer's pages in place: a model's layer loop
                  passes the whole pool and its index, and no layer is ever sliced out (copied)
  block_tables    int32[S, max_blocks]  logical block i of sequence s is physical block
                  block_tables[s, i]; unused entries are 0, the null block. The kernels never
                  follow an entry at or past cdiv(context_lens[s], block_size) (they read block 0)
  context_lens    int32[S]  tokens in the cache per sequence, INCLUDING this step's; slots at or
                  past it are never used, even if they hold NaN
  query_start_loc int32[S+1]  sequence s owns q rows query_start_loc[s]:query_start_loc[s+1]
  num_seqs        int32 scalar, may be traced. Seats >= num_seqs are padding: their entries of
                  context_lens, block_tables and query_start_loc[s+1] are ignored
  scale           softmax scale, default D ** -0.5
Row t of sequence s (q_len = its number of rows) sits at absolute position
context_lens[s] - q_len + (t - query_start_loc[s]) and attends to kv positions <= its own: causal
inside the new tokens, everything before them. A sequence with no rows this step costs nothing.
Rows outside query_start_loc[0]:query_start_loc[num_seqs] give zeros, whatever q holds there.
GQA: query head h reads kv head h // (H // KVH); any H % KVH == 0. Softmax and accumulation run in
f32; the output has q's dtype. Bad shapes and dtypes raise ValueError at the Python boundary; value
checks (ordered query_start_loc, context_lens >= a sequence's rows and within its block table) run
only when the values are concrete. Under jit the kernels read at most the first
max_blocks * block_size positions, exactly as the reference does.

How work is cut: each sequence's rows are split into query tiles of `block_q` tokens (a power of
two); a tile holds its tokens times the kv head's group of query heads, group-major (row
g * block_q + t), so one tile's K/V pages are read once for the whole group. A few jnp gathers
outside the kernel pack q into tiles [num_tiles, KVH, rows, D] and unpack the output, and give
every tile its sequence, its first query position and the number of kv positions it needs (its
last token's position + 1). num_tiles is a static bound,
min(T, (T + S * (block_q - 1)) // block_q); tiles past the real ones are empty and cost one idle
program. Each program loops over only the
pages its tile needs, with an online softmax in f32.

Variants (both run on CPU in interpret mode, the default there):
  "gpu"  Triton-style Pallas, lowering through the Pallas Triton backend on NVIDIA GPUs. Grid
         (query tile, kv head). K/V are read `tokens_per_step` tokens at a time straight from the
         pool through the tile's block-table row (whole pages, or part of one). Triton's block
         dims must be powers of two and a dot needs every dimension >= 16: the group is padded to
         a power of two and a tile has at least 16 rows. The step and the pipeline depth fit the
         shared memory of the device `limits` describe; a tile holds at most 64 rows (32 for
         head_dim 256). No flash-decoding splits: a mixed step has enough tiles to fill the GPU; a
         small decode-only batch may be faster through pagedjax.pallas.paged_attention.
  "tpu"  Mosaic-style Pallas, lowering through Mosaic on TPU. Grid (query tile, kv head). The tile
         table (sequence, first position, kv length per tile) and the flattened block tables are
         scalar-prefetched into SMEM; the pool stays in HBM (memory_space=pl.ANY) and pages are
         copied into VMEM with async copies, double-buffered so the next step's copies overlap
         this step's compute. The group is not padded.
  "auto" "tpu" on a TPU backend, "gpu" otherwise (on CPU it interprets faster).
interpret=None interprets on CPU and compiles on GPU/TPU; True forces interpretation; a
pltpu.InterpretParams() runs the TPU variant under the TPU interpreter (checks DMA and semaphores).
limits: the device the kernel is tiled and compiled for (default: the local one).

Shapes and tuning are static, values are not: new lengths, tables, query_start_loc and num_seqs
reuse the compiled kernel. Call it inside your own jax.jit step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from pagedjax.pallas.common import (
    DTYPES,
    GPU_MIN_ROWS,
    MASK_VALUE,
    MAX_TILE_ROWS,
    TOKENS_PER_STEP,
    DeviceLimits,
    cdiv,
    ceil_div,
    check_vmem,
    concrete,
    dot,
    finish,
    fit_step_to_pages,
    gpu_page_loader,
    init_carry,
    is_pow2,
    kernel_cost,
    pltriton,
    pow2_floor,
    resolve,
    round_up,
    softmax_scale,
    tpu_double_buffered,
    tpu_page_copies,
)
from pagedjax.pallas.paged_attention import check_triton, gpu_plan

__all__ = [
    "ragged_paged_attention",
    "ragged_paged_attention_gpu",
    "ragged_paged_attention_tpu",
    "default_block_q",
]

# The smallest tile on TPU: one f32 sublane tile of rows.
TPU_MIN_ROWS = 8


# ---------------------------------------------------------------------------------------------
# shared math and tiling
# ---------------------------------------------------------------------------------------------


def _attend_causal(q, q_pos0, kv_len, block_q, n, steps, load, scale):
    """Online softmax of a query tile q [rows, D] over `steps` steps of n kv tokens from position 0.

    Row r is token r % block_q of the tile (group-major rows), at position q_pos0 + r % block_q;
    it sees kv positions <= its own and < kv_len (a tile's padding rows see all kv_len, and are
    dropped when unpacking). load(i, tok0) -> (k, v), each [n, D]. A row that sees nothing keeps
    l == 0, and _finish gives it zeros.
    """
    rows, d = q.shape
    # block_q is a power of two: & instead of %, which Mosaic lowers only for some generations.
    q_pos = q_pos0 + (lax.broadcasted_iota(jnp.int32, (rows, n), 0) & (block_q - 1))

    def body(i, carry):
        m_prev, l_prev, acc_prev = carry
        tok0 = i * n
        k, v = load(i, tok0)
        s = dot(q, k, ((1,), (1,))) * scale  # [rows, n]
        kv_pos = tok0 + lax.broadcasted_iota(jnp.int32, (rows, n), 1)
        mask = (kv_pos <= q_pos) & (kv_pos < kv_len)
        s = jnp.where(mask, s, MASK_VALUE)
        # A masked slot may hold anything, NaN included, and 0 * NaN is NaN: zero it.
        v = jnp.where(tok0 + lax.broadcasted_iota(jnp.int32, (n, d), 0) < kv_len, v, 0)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        # Every row with a position >= 0 sees position 0 in step 0, so from then on m is a real
        # logit and a step wholly past a row's diagonal adds exp(MASK_VALUE - m) == 0. A negative
        # position (context_lens below a sequence's rows, which only traced input can hold) sees
        # nothing at all: select, so exp(MASK_VALUE - MASK_VALUE) == 1 never counts and such rows
        # give zeros, as in the reference.
        p = jnp.where(mask, jnp.exp(s - m_next), 0.0)
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        acc_next = alpha * acc_prev + dot(p.astype(v.dtype), v, ((1,), (0,)))
        return m_next, l_next, acc_next

    return lax.fori_loop(0, steps, body, init_carry(rows, d))


def _num_tiles(num_tokens, num_seqs, block_q):
    # Each live sequence needs cdiv(q_len, block_q) tiles: summed, at most
    # (T + S * (block_q - 1)) // block_q; and every tile holds a token, so at most T.
    return max(1, min(num_tokens, (num_tokens + num_seqs * (block_q - 1)) // block_q))


def _plan_tiles(context_lens, query_start_loc, num_seqs, *, num_tokens, block_q, num_tiles,
                capacity):
    """Cuts each live sequence's rows into tiles of block_q tokens (jnp, traced values).

    Returns per tile int32[num_tiles]: seq, q_pos0 (position of its first token), kv_len (kv
    positions it reads: its last token's position + 1, clipped to capacity; 0 for an empty tile),
    first_token, and per token int32[T]: tile, slot (its row within the tile) and valid.
    """
    s_total = context_lens.shape[0]
    live = jnp.arange(s_total) < num_seqs
    qsl = query_start_loc
    q_len = jnp.where(live, jnp.maximum(qsl[1:] - qsl[:-1], 0), 0)
    tiles_of = (q_len + block_q - 1) // block_q
    tile_end = jnp.cumsum(tiles_of)
    tile_first = tile_end - tiles_of

    i = jnp.arange(num_tiles, dtype=jnp.int32)
    seq = jnp.sum(tile_end[None, :] <= i[:, None], axis=1)
    real = seq < s_total
    seq = jnp.minimum(seq, s_total - 1)
    j = (i - tile_first[seq]) * block_q  # the tile's first token, counted within its sequence
    ntok = jnp.clip(q_len[seq] - j, 0, block_q)
    q_pos0 = context_lens[seq] - q_len[seq] + j
    kv_len = jnp.where(real, jnp.clip(q_pos0 + ntok, 0, capacity), 0)
    q_pos0 = jnp.where(real, q_pos0, 0)
    first_token = jnp.where(real, qsl[seq] + j, 0)
    ntok = jnp.where(real, ntok, 0)

    # The token side, as the reference reads it: row t belongs to the first live sequence
    # ending after it.
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    tseq = jnp.sum(live[None, :] & (qsl[1:][None, :] <= t[:, None]), axis=1)
    tseq = jnp.minimum(tseq, s_total - 1)
    valid = (t >= qsl[0]) & (t < qsl[jnp.clip(num_seqs, 0, s_total)])
    offset = jnp.where(valid, t - qsl[tseq], 0)
    tile = jnp.where(valid, tile_first[tseq] + offset // block_q, 0)
    slot = offset % block_q
    return (seq.astype(jnp.int32), q_pos0.astype(jnp.int32), kv_len.astype(jnp.int32),
            first_token, ntok, tile, slot, valid)


def _pack_q(q, num_kv_heads, group_rows, first_token, ntok, block_q):
    """q [T, H, D] -> tiles [num_tiles, KVH, group_rows * block_q, D], group-major, zero-padded."""
    t_total, h, d = q.shape
    group = h // num_kv_heads
    q4 = q.reshape(t_total, num_kv_heads, group, d)
    q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, group_rows - group), (0, 0)))
    r = jnp.arange(block_q)
    idx = jnp.clip(first_token[:, None] + r[None, :], 0, t_total - 1)  # [num_tiles, block_q]
    tiles = q4[idx]  # [num_tiles, block_q, KVH, Gp, D]
    # Rows past the tile's tokens belong to another sequence or to padding (which may be NaN).
    tiles = jnp.where((r[None, :] < ntok[:, None])[:, :, None, None, None], tiles, 0)
    tiles = jnp.transpose(tiles, (0, 2, 3, 1, 4))  # [num_tiles, KVH, Gp, block_q, D]
    return tiles.reshape(tiles.shape[0], num_kv_heads, group_rows * block_q, d)


def _unpack_out(out, num_heads, tile, slot, valid, block_q):
    """tiles [num_tiles, KVH, Gp * block_q, D] -> [T, H, D]; invalid rows are zeros."""
    num_tiles, kvh, rows, d = out.shape
    group_rows = rows // block_q
    o = out.reshape(num_tiles, kvh, group_rows, block_q, d)
    o = jnp.transpose(o, (0, 3, 1, 2, 4)).reshape(num_tiles * block_q, kvh, group_rows, d)
    o = o[tile * block_q + slot][:, :, : num_heads // kvh]  # [T, KVH, G, D]
    o = jnp.where(valid[:, None, None, None], o, 0)
    return o.reshape(o.shape[0], num_heads, d)


def _ragged_cost(num_tiles, rows, kvh, d, capacity, q, block_tables):
    """Every tile reading the whole table: QK^T and PV of its rows, one exp per score, its pages
    read once per kv head; plus the step's q, output and tables."""
    return kernel_cost(flops=4 * num_tiles * kvh * rows * capacity * d,
                       transcendentals=num_tiles * kvh * rows * capacity,
                       bytes_accessed=2 * num_tiles * kvh * capacity * d * q.dtype.itemsize
                       + 2 * q.size * q.dtype.itemsize + block_tables.size * 4)


# ---------------------------------------------------------------------------------------------
# GPU (Triton-style) kernel
# ---------------------------------------------------------------------------------------------


def _gpu_kernel(layer_ref, q_pos_ref, kv_len_ref, bt_ref, q_ref, k_ref, v_ref, o_ref, *, scale,
                block_q, n):
    """One program: query tile i, kv head h.

    layer_ref int32[1], q_pos_ref, kv_len_ref int32[num_tiles] (whole arrays); bt_ref
    int32[padded max_blocks] (the tile's sequence's row); q_ref, o_ref [rows, D]; k_ref, v_ref
    the stacked pool [L, KVH, num_blocks, bs, D] (whole, gathered through the table at layer
    layer_ref[0]), read n tokens a step.
    """
    i, h = pl.program_id(0), pl.program_id(1)
    kv_len = kv_len_ref[i]
    load = gpu_page_loader(k_ref, v_ref, bt_ref, (layer_ref[0], h), cdiv(kv_len, k_ref.shape[-2]), n)
    m, l, acc = _attend_causal(q_ref[...], q_pos_ref[i], kv_len, block_q, n, cdiv(kv_len, n),
                               load, scale)
    o_ref[...] = finish(acc, l, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "tokens_per_step",
                                             "num_stages"))
def _ragged_gpu(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, num_seqs, layer, *,
                scale, interpret, block_q, tokens_per_step, num_stages):
    t_total, h, d = q.shape
    _, kvh, _, block_size, _ = k_pages.shape
    s_total, max_blocks = block_tables.shape
    group_rows = pl.next_power_of_2(h // kvh)
    rows = group_rows * block_q
    num_tiles = _num_tiles(t_total, s_total, block_q)
    seq, q_pos0, kv_len, first, ntok, tile, slot, valid = _plan_tiles(
        context_lens, query_start_loc, num_seqs, num_tokens=t_total, block_q=block_q,
        num_tiles=num_tiles, capacity=max_blocks * block_size)
    qt = _pack_q(q, kvh, group_rows, first, ntok, block_q)
    # Each tile's block-table row, padded so every step's slice of pages is in bounds (the
    # padding is 0, the null block, and masked anyway).
    pages_per_step = max(1, tokens_per_step // block_size)
    bt = jnp.pad(block_tables[seq], ((0, 0), (0, round_up(max_blocks, pages_per_step) - max_blocks)))
    whole = pl.no_block_spec  # the whole array: the kernel indexes or gathers it itself
    tile_spec = pl.BlockSpec((None, None, rows, d), lambda i, h_: (i, h_, 0, 0))
    params = None
    if pltriton is not None:
        params = pltriton.CompilerParams(num_warps=4, num_stages=num_stages)
    out = pl.pallas_call(
        functools.partial(_gpu_kernel, scale=scale, block_q=block_q, n=tokens_per_step),
        grid=(num_tiles, kvh),
        in_specs=[whole, whole, whole, pl.BlockSpec((None, bt.shape[1]), lambda i, h_: (i, 0)),
                  tile_spec, whole, whole],
        out_specs=tile_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        compiler_params=params,
        cost_estimate=_ragged_cost(num_tiles, rows, kvh, d, max_blocks * block_size, q,
                                   block_tables),
        interpret=interpret,
        name="ragged_paged_attention_gpu",
    )(layer.reshape(1), q_pos0, kv_len, bt, qt, k_pages, v_pages)
    return _unpack_out(out, h, tile, slot, valid, block_q)


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic-style) kernel
# ---------------------------------------------------------------------------------------------


def _tpu_kernel(layer_ref, seq_ref, q_pos_ref, kv_len_ref, bt_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf,
                v_buf, sems, *, scale, block_q, pages_per_block, max_blocks):
    """One program: query tile i, kv head h.

    layer_ref int32[1], seq_ref, q_pos_ref, kv_len_ref int32[num_tiles] and bt_ref
    int32[S * max_blocks] in SMEM (flat: SMEM pads a 2-D array's minor dimension); q_ref, o_ref
    [rows, D] in VMEM; k_hbm, v_hbm the stacked pool [L, KVH, num_blocks, bs, D] in HBM, read at
    layer layer_ref[0]; k_buf, v_buf [2, pages_per_block, bs, D] VMEM; sems: DMA semaphores
    [2 (k, v), 2 (slot)]. Every tile of a sequence reads its pages again.
    """
    i, h = pl.program_id(0), pl.program_id(1)
    block_size = k_hbm.shape[-2]
    n = pages_per_block * block_size
    kv_len = kv_len_ref[i]
    steps = cdiv(kv_len, n)
    copies = tpu_page_copies(bt_ref, seq_ref[i], max_blocks, cdiv(kv_len, block_size),
                             pages_per_block, (layer_ref[0], h), k_hbm, v_hbm, k_buf, v_buf, sems)
    load = tpu_double_buffered(k_buf, v_buf, n, steps, copies)
    q = q_ref[...].astype(jnp.float32)
    m, l, acc = _attend_causal(q, q_pos_ref[i], kv_len, block_q, n, steps, load, scale)
    o_ref[...] = finish(acc, l, o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "block_q", "pages_per_block"))
def _ragged_tpu(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, num_seqs, layer, *,
                scale, interpret, block_q, pages_per_block):
    t_total, h, d = q.shape
    _, kvh, _, block_size, _ = k_pages.shape
    s_total, max_blocks = block_tables.shape
    group_rows = h // kvh
    rows = group_rows * block_q
    num_tiles = _num_tiles(t_total, s_total, block_q)
    seq, q_pos0, kv_len, first, ntok, tile, slot, valid = _plan_tiles(
        context_lens, query_start_loc, num_seqs, num_tokens=t_total, block_q=block_q,
        num_tiles=num_tiles, capacity=max_blocks * block_size)
    qt = _pack_q(q, kvh, group_rows, first, ntok, block_q)
    tile_spec = pl.BlockSpec((None, None, rows, d), lambda i, h_, *_: (i, h_, 0, 0))
    buf_shape = (2, pages_per_block, block_size, d)
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=5,
        grid=(num_tiles, kvh),
        in_specs=[tile_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=tile_spec,
        scratch_shapes=[pltpu.VMEM(buf_shape, k_pages.dtype), pltpu.VMEM(buf_shape, k_pages.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))],
    )
    out = pl.pallas_call(
        functools.partial(_tpu_kernel, scale=scale, block_q=block_q,
                          pages_per_block=pages_per_block, max_blocks=max_blocks),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(qt.shape, q.dtype),
        # Each program starts and waits all of its own copies, so programs are independent.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=_ragged_cost(num_tiles, rows, kvh, d, max_blocks * block_size, q,
                                   block_tables),
        interpret=interpret,
        name="ragged_paged_attention_tpu",
    )(layer.reshape(1), seq, q_pos0, kv_len, block_tables.reshape(-1), qt, k_pages, v_pages)
    return _unpack_out(out, h, tile, slot, valid, block_q)


# ---------------------------------------------------------------------------------------------
# the Python boundary
# ---------------------------------------------------------------------------------------------


def max_tile_rows(head_dim):
    """The largest query tile, in rows: MAX_TILE_ROWS, halved for head_dim 256 (a tile's q and
    accumulator hold rows x head_dim values each, in registers on a GPU)."""
    return max(GPU_MIN_ROWS, min(MAX_TILE_ROWS, MAX_TILE_ROWS * 128 // max(head_dim, 128)))


def default_block_q(num_tokens, num_seqs, group_rows, min_rows, max_rows=MAX_TILE_ROWS):
    """Tokens per query tile: about the mean tokens per sequence (T / S, so a decode-only step gets
    the smallest tile), at least min_rows rows and at most max_rows, a power of two."""
    lo = pl.next_power_of_2(ceil_div(min_rows, group_rows))
    hi = max(lo, pow2_floor(max_rows // group_rows))
    want = pl.next_power_of_2(max(1, ceil_div(num_tokens, max(num_seqs, 1))))
    return int(min(max(want, lo), hi, max(lo, pl.next_power_of_2(max(num_tokens, 1)))))


def _check(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, num_seqs, layer):
    """Shape and dtype checks, and value checks where the values are concrete.

    Returns (k_pages, v_pages, num_seqs, layer): the pools stacked [L, KVH, num_blocks, bs, D]
    (a lone layer gets a leading axis of 1) and num_seqs and layer as int32 scalars."""
    if getattr(q, "ndim", None) != 3 or q.shape[0] == 0:
        raise ValueError(f"q must be [num_tokens >= 1, num_heads, head_dim]; got shape "
                         f"{np.shape(q)}")
    if getattr(k_pages, "ndim", None) != (4 if layer is None else 5):
        want = ("[num_kv_heads, num_blocks, block_size, head_dim]" if layer is None else
                "[num_layers, num_kv_heads, num_blocks, block_size, head_dim] (a layer is given)")
        raise ValueError(f"k_pages must be {want}; got shape {np.shape(k_pages)}")
    if getattr(v_pages, "shape", None) != k_pages.shape:
        raise ValueError(f"v_pages shape {np.shape(v_pages)} differs from k_pages shape "
                         f"{k_pages.shape}")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape[-4:]
    if k_pages.shape[-1] != head_dim:
        raise ValueError(f"head_dim mismatch: q has shape {q.shape} (head_dim {head_dim}) but "
                         f"k_pages has shape {k_pages.shape} (head_dim {k_pages.shape[-1]})")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads % num_kv_heads != 0: q has shape {q.shape} ({num_heads} "
                         f"heads) but k_pages has shape {k_pages.shape} ({num_kv_heads} kv heads)")
    if not (q.dtype == k_pages.dtype == v_pages.dtype) or q.dtype not in DTYPES:
        raise ValueError(f"q, k_pages and v_pages must share one float dtype of f32/bf16/f16; "
                         f"got {q.dtype}, {k_pages.dtype}, {v_pages.dtype}")
    if getattr(block_tables, "dtype", None) != jnp.int32 or block_tables.ndim != 2:
        raise ValueError(f"block_tables must be int32[num_seqs, max_blocks]; got "
                         f"{getattr(block_tables, 'dtype', type(block_tables))}"
                         f"{list(np.shape(block_tables))}")
    s_total, max_blocks = block_tables.shape
    if s_total == 0:
        raise ValueError(f"block_tables must have at least one row; got shape {block_tables.shape}")
    if getattr(context_lens, "dtype", None) != jnp.int32 or context_lens.shape != (s_total,):
        raise ValueError(f"context_lens must be int32[{s_total}] (one per block_tables row); got "
                         f"{getattr(context_lens, 'dtype', type(context_lens))}"
                         f"{list(np.shape(context_lens))}")
    if (getattr(query_start_loc, "dtype", None) != jnp.int32
            or query_start_loc.shape != (s_total + 1,)):
        raise ValueError(f"query_start_loc must be int32[{s_total + 1}]; got "
                         f"{getattr(query_start_loc, 'dtype', type(query_start_loc))}"
                         f"{list(np.shape(query_start_loc))}")
    if np.shape(num_seqs) != () or not jnp.issubdtype(jnp.result_type(num_seqs), jnp.integer):
        raise ValueError(f"num_seqs must be an integer scalar; got {jnp.result_type(num_seqs)}"
                         f"{list(np.shape(num_seqs))}")

    if layer is None:
        k_pages, v_pages, layer = k_pages[None], v_pages[None], 0
    elif np.shape(layer) != () or not jnp.issubdtype(jnp.result_type(layer), jnp.integer):
        raise ValueError(f"layer must be an integer scalar; got {jnp.result_type(layer)}{list(np.shape(layer))}")
    elif concrete(layer) is not None and not 0 <= int(concrete(layer)) < k_pages.shape[0]:
        raise ValueError(f"layer must lie in [0, {k_pages.shape[0]}) (k_pages has shape {k_pages.shape}); "
                         f"got {int(concrete(layer))}")
    pools = (k_pages, v_pages, jnp.asarray(layer, jnp.int32))
    n_live = concrete(num_seqs)
    if n_live is None:
        return (*pools[:2], jnp.asarray(num_seqs, jnp.int32), pools[2])
    n_live = int(n_live)
    if not 0 <= n_live <= s_total:
        raise ValueError(f"num_seqs must lie in [0, {s_total}] (block_tables has shape "
                         f"{block_tables.shape}); got {n_live}")
    qsl, lens = concrete(query_start_loc), concrete(context_lens)
    if qsl is not None:
        live_qsl = qsl[: n_live + 1]
        if live_qsl[0] < 0 or np.any(np.diff(live_qsl) < 0) or live_qsl[-1] > num_tokens:
            raise ValueError(f"query_start_loc[:num_seqs + 1] must rise from >= 0 to <= "
                             f"{num_tokens} (q has shape {q.shape}); got {live_qsl.tolist()}")
        if lens is not None:
            live_lens, q_len = lens[:n_live], np.diff(live_qsl)
            if np.any(live_lens < q_len):
                raise ValueError(f"context_lens (including this step's tokens) must be >= each "
                                 f"sequence's query rows {q_len.tolist()}; got "
                                 f"{live_lens.tolist()}")
            capacity = max_blocks * block_size
            if n_live and live_lens.max() > capacity:
                raise ValueError(f"block_tables of shape {block_tables.shape} ({max_blocks} blocks "
                                 f"of {block_size} tokens) holds {capacity} tokens but "
                                 f"max(context_lens) is {live_lens.max()}")
    return (*pools[:2], jnp.asarray(num_seqs, jnp.int32), pools[2])


def _block_q(q, k_pages, block_tables, block_q, min_rows, group_rows):
    if block_q is None:
        block_q = default_block_q(q.shape[0], block_tables.shape[0], group_rows, min_rows,
                                  max_tile_rows(q.shape[2]))
    if not is_pow2(block_q):
        raise ValueError(f"block_q must be a power of two; got {block_q}")
    return int(block_q)


def ragged_paged_attention_gpu(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                               num_seqs, *, layer=None, scale=None, interpret=False, block_q=None,
                               tokens_per_step=None, limits: DeviceLimits | None = None):
    """The Triton-style kernel, with its tuning knobs (see the module docstring).

    block_q: tokens per query tile (a power of two; tile rows = block_q x the group padded to a
    power of two, at least 16). tokens_per_step: kv tokens each loop step reads (a power of two
    >= 16: whole pages when at least a page, else part of one); default: the most, up to
    TOKENS_PER_STEP, that fits the device's shared memory with a two-stage pipeline. limits: the
    device the kernel is compiled for (default: the local one).
    """
    k_pages, v_pages, num_seqs, layer = _check(q, k_pages, v_pages, block_tables, context_lens,
                                               query_start_loc, num_seqs, layer)
    _, interpret, limits = resolve("gpu", interpret, limits)
    block_size, head_dim = k_pages.shape[-2], q.shape[2]
    group_rows = pl.next_power_of_2(q.shape[1] // k_pages.shape[1])
    block_q = _block_q(q, k_pages, block_tables, block_q, GPU_MIN_ROWS, group_rows)
    rows = group_rows * block_q
    tokens_per_step, stages = gpu_plan(head_dim, rows, q.dtype.itemsize, limits, tokens_per_step,
                                       interpret, block_tables.shape[1] * block_size,
                                       "ragged_paged_attention")
    tokens_per_step = fit_step_to_pages(tokens_per_step, block_size)
    if not interpret:
        check_triton("k_pages", k_pages.shape, head_dim, tokens_per_step, block_size)
        if rows < GPU_MIN_ROWS:
            raise ValueError(f"the compiled gpu variant needs query tiles of >= {GPU_MIN_ROWS} "
                             f"rows; got block_q {block_q} x group {group_rows}")
    return _ragged_gpu(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, num_seqs,
                       layer, scale=softmax_scale(scale, head_dim), interpret=interpret,
                       block_q=block_q, tokens_per_step=int(tokens_per_step), num_stages=stages)


def ragged_paged_attention_tpu(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                               num_seqs, *, layer=None, scale=None, interpret=False, block_q=None,
                               pages_per_block=None, limits: DeviceLimits | None = None):
    """The Mosaic-style kernel. block_q: tokens per query tile (a power of two); pages_per_block:
    pages copied per double-buffer slot (default TOKENS_PER_STEP tokens' worth)."""
    k_pages, v_pages, num_seqs, layer = _check(q, k_pages, v_pages, block_tables, context_lens,
                                               query_start_loc, num_seqs, layer)
    _, interpret, limits = resolve("tpu", interpret, limits)
    block_size = k_pages.shape[-2]
    group_rows = q.shape[1] // k_pages.shape[1]
    block_q = _block_q(q, k_pages, block_tables, block_q, TPU_MIN_ROWS, group_rows)
    if pages_per_block is None:
        pages_per_block = max(1, TOKENS_PER_STEP // block_size)
    pages_per_block = int(min(pages_per_block, block_tables.shape[1]))
    check_vmem(group_rows * block_q, q.shape[2], pages_per_block * block_size, q.dtype.itemsize,
               limits, "ragged_paged_attention")
    return _ragged_tpu(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, num_seqs,
                       layer, scale=softmax_scale(scale, q.shape[2]), interpret=interpret,
                       block_q=block_q, pages_per_block=pages_per_block)


def ragged_paged_attention(q, k_pages, v_pages, block_tables, context_lens, query_start_loc,
                           num_seqs, *, layer=None, scale=None, variant="auto", interpret=None,
                           limits: DeviceLimits | None = None):
    """Causal attention for a step's tokens of many sequences; see the module docstring.
    Returns [T, H, D] in q's dtype."""
    variant, interpret, limits = resolve(variant, interpret, limits)
    fn = ragged_paged_attention_gpu if variant == "gpu" else ragged_paged_attention_tpu
    return fn(q, k_pages, v_pages, block_tables, context_lens, query_start_loc, num_seqs,
              layer=layer, scale=scale, interpret=interpret, limits=limits)
