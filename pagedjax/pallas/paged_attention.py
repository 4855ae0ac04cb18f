"""Pallas decode attention over a paged KV cache, and over a contiguous one for comparison.

    paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                    variant="auto", interpret=None, limits=None) -> [B, H, D]
    contiguous_attention(q, k, v, lengths, *, scale=None, variant="auto", interpret=None,
                         limits=None)

Arguments (B sequences, H query heads, KVH kv heads, D head_dim):
  q            [B, H, D]                         one query token per sequence, same dtype as the cache
  k_pages      [KVH, num_blocks, block_size, D]  the block pool, f32 or bf16; v_pages the same
  block_tables int32[B, max_blocks_per_seq]      logical block i of sequence b is physical block
                                                 block_tables[b, i]. Unused entries are 0, the null
                                                 block; the kernels never follow an entry at or past
                                                 cdiv(lengths[b], block_size) (they read block 0)
  lengths      int32[B]                          tokens in the cache per sequence; 0 marks a padding
                                                 row and gives zeros. Slots at positions
                                                 >= lengths[b] are never used, even if they hold NaN
  k, v         [B, KVH, max_len, D]              a contiguous cache (contiguous_attention)
  scale        softmax scale, default D ** -0.5
GQA: query head h reads kv head h // (H // KVH); any H % KVH == 0 (SmolLM2: 9 heads over 3).
Softmax and accumulation run in f32; the output has q's dtype. Bad shapes and dtypes raise
ValueError here at the Python boundary. A length longer than the block table (or max_len) can
only be caught when lengths is concrete; under jit the kernels read the first
max_blocks_per_seq * block_size positions, exactly as the reference does.

Variants (both run on CPU in interpret mode, the default there):
  "gpu"  Triton-style Pallas, lowering through the Pallas Triton backend on NVIDIA GPUs. Grid
         (sequence, kv head, split). Each program loops over only its sequence's valid pages,
         reading `tokens_per_step` tokens a step straight from the pool through the block table
         (whole pages, or part of one when a page's K and V would not fit the shared memory),
         with an online softmax. A kv head's group of query heads is padded to 16 rows (Triton's
         dot needs every dimension >= 16, every array a power of two). When the batch alone cannot
         fill the GPU, splits divide a sequence's pages between programs (flash-decoding) and the
         partial results are merged in jnp. The step and the pipeline depth are chosen so that a
         program fits the shared memory of the device `limits` describe (227 KiB on an H100, 163
         KiB on an A100): see pagedjax.pallas.common.
  "tpu"  Mosaic-style Pallas, lowering through Mosaic on TPU. Grid (sequence, kv head). Lengths and
         the (flattened) block tables are scalar-prefetched into SMEM; the pool stays in HBM
         (memory_space=pl.ANY) and each step's pages are copied into VMEM with async copies,
         double-buffered so the next step's copies overlap this step's compute.
  "auto" "tpu" on a TPU backend, "gpu" otherwise (on CPU it interprets faster).
interpret=None interprets on CPU and compiles on GPU/TPU; True forces interpretation; a
pltpu.InterpretParams() runs the TPU variant under the TPU interpreter, which also checks DMA and
semaphore use. limits (a pagedjax.pallas.DeviceLimits) is the device the kernel is tiled and
compiled for: default the local one; pagedjax.aot passes a named TPU's or GPU's.

The contiguous kernels are the same loops with the gather replaced by a slice, so paged against
contiguous measures the cost of the indirection alone.

Shapes and tuning are static, values are not: new lengths and block tables reuse the compiled
kernel (the per-variant functions are jitted inside). Call them inside your own jax.jit step
anyway: an eager call also pulls lengths to the host to check them against the cache.
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
    TOKENS_PER_STEP,
    DeviceLimits,
    cdiv,
    ceil_div,
    check_vmem,
    dot,
    finish,
    fit_step_to_pages,
    gpu_page_loader,
    gpu_tiling,
    init_carry,
    is_pow2,
    kernel_cost,
    pltriton,
    resolve,
    round_up,
    softmax_scale,
    tpu_double_buffered,
    tpu_page_copies,
)

__all__ = [
    "paged_attention",
    "contiguous_attention",
    "paged_attention_gpu",
    "paged_attention_tpu",
    "contiguous_attention_gpu",
    "contiguous_attention_tpu",
]


def _attend_steps(q, length, tok_first, n, steps, load, scale):
    """Online softmax of q [rows, D] over `steps` steps of n tokens from position tok_first.

    load(i, tok0) -> (k, v), each [n, D]: step i's tokens, positions tok0 .. tok0 + n - 1. Positions
    >= length are masked. Callers stop at length, so every step holds a valid position and the
    running max is a real logit from the first step on (masked entries then get exp() == 0).
    Returns the carry of `init_carry` after the last step.
    """
    rows, d = q.shape

    def body(i, carry):
        m_prev, l_prev, acc_prev = carry
        tok0 = tok_first + i * n
        k, v = load(i, tok0)
        s = dot(q, k, ((1,), (1,))) * scale  # [rows, n]
        s = jnp.where(tok0 + lax.broadcasted_iota(jnp.int32, (1, n), 1) < length, s, MASK_VALUE)
        # A masked slot may hold anything, NaN included, and 0 * NaN is NaN: zero it.
        v = jnp.where(tok0 + lax.broadcasted_iota(jnp.int32, (n, d), 0) < length, v, 0)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        acc_next = alpha * acc_prev + dot(p.astype(v.dtype), v, ((1,), (0,)))
        return m_next, l_next, acc_next

    return lax.fori_loop(0, steps, body, init_carry(rows, d))


def _decode_cost(b, h, kvh, d, max_tokens, itemsize, table_bytes=0):
    """Every sequence at the full table: QK^T and PV, one exp per score, K/V read once per kv head."""
    return kernel_cost(flops=4 * b * h * max_tokens * d, transcendentals=b * h * max_tokens,
                       bytes_accessed=2 * b * kvh * max_tokens * d * itemsize
                       + 2 * b * h * d * itemsize + table_bytes)


# ---------------------------------------------------------------------------------------------
# GPU (Triton-style) kernels
# ---------------------------------------------------------------------------------------------


def _gpu_kernel(lengths_ref, *refs, scale, n, tokens_per_split, max_tokens, paged):
    """One program: sequence b, kv head h, split s: tokens s * tokens_per_split up to the next split.

    lengths_ref int32[B] (whole array); paged: bt_ref int32[padded max_blocks] (row b), k_ref/v_ref
    [KVH, num_blocks, bs, D]; contiguous: k_ref/v_ref [B, KVH, padded max_len, D] (whole arrays,
    read by gather or slice). q_ref [Gp, D]. Outputs: o_ref [Gp, D] f32 unnormalised, m_ref and
    l_ref [Gp] f32 (the running max and sum, for merging splits).
    """
    if paged:
        bt_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref = refs
    else:
        q_ref, k_ref, v_ref, o_ref, m_ref, l_ref = refs
    b, h, split = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    rows, d = q_ref.shape
    length = jnp.minimum(lengths_ref[b], max_tokens)
    first = split * tokens_per_split
    steps = cdiv(jnp.maximum(jnp.minimum(first + tokens_per_split, length) - first, 0), n)

    if paged:
        load = gpu_page_loader(k_ref, v_ref, bt_ref, (h,), cdiv(length, k_ref.shape[2]), n)
    else:
        def load(i, tok0):
            return k_ref[b, h, pl.ds(tok0, n)], v_ref[b, h, pl.ds(tok0, n)]

    m, l, acc = _attend_steps(q_ref[...], length, first, n, steps, load, scale)
    o_ref[...] = acc
    m_ref[...] = m.reshape(rows)
    l_ref[...] = l.reshape(rows)


def _gpu_call(kernel_kwargs, lengths, bt, q, k, v, *, num_splits, num_stages, interpret, cost):
    """Runs _gpu_kernel over grid (B, KVH, num_splits) and merges the splits."""
    b, kvh, group, d = q.shape
    rows = max(GPU_MIN_ROWS, pl.next_power_of_2(group))
    qp = jnp.pad(q, ((0, 0), (0, 0), (0, rows - group), (0, 0)))
    whole = pl.no_block_spec  # the whole array: the kernel gathers or slices it itself
    in_specs = [whole]
    args = [lengths]
    if bt is not None:
        in_specs.append(pl.BlockSpec((None, bt.shape[1]), lambda b_, h_, s_: (b_, 0)))
        args.append(bt)
    in_specs += [pl.BlockSpec((None, None, rows, d), lambda b_, h_, s_: (b_, h_, 0, 0)), whole, whole]
    args += [qp, k, v]

    def split_spec(*tail):  # one [rows, *tail] tile per (split, sequence, kv head)
        return pl.BlockSpec((None, None, None, rows, *tail),
                            lambda b_, h_, s_: (s_, b_, h_, 0, *(0 for _ in tail)))

    params = None
    if pltriton is not None:
        params = pltriton.CompilerParams(num_warps=4, num_stages=num_stages)
    o, m, l = pl.pallas_call(
        functools.partial(_gpu_kernel, **kernel_kwargs),
        grid=(b, kvh, num_splits),
        in_specs=in_specs,
        out_specs=[split_spec(d), split_spec(), split_spec()],
        out_shape=[jax.ShapeDtypeStruct((num_splits, b, kvh, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, b, kvh, rows), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, b, kvh, rows), jnp.float32)],
        compiler_params=params,
        cost_estimate=cost,
        interpret=interpret,
        name="paged_attention_gpu" if bt is not None else "contiguous_attention_gpu",
    )(*args)
    # Merge the splits' partial softmaxes; an empty split has m = MASK_VALUE, l = 0, o = 0 and
    # drops out (its weight exp(MASK_VALUE - m_max) is 0, or it is all there is and l stays 0).
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max)
    acc = jnp.sum(o * w[..., None], axis=0)
    l_sum = jnp.sum(l * w, axis=0)
    return finish(acc, l_sum[..., None], q.dtype)[:, :, :group]


def _gpu_num_splits(programs, max_steps, interpret, limits):
    """Splits per sequence so that about two programs run per SM (never in interpret mode)."""
    if interpret:
        return 1
    sms = limits.core_count or 132
    return int(max(1, min(ceil_div(2 * sms, programs), max_steps, 32)))


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tokens_per_step", "num_splits",
                                             "num_stages"))
def _paged_gpu(q, k_pages, v_pages, block_tables, lengths, *, scale, interpret, tokens_per_step,
               num_splits, num_stages):
    b, h, d = q.shape
    kvh, _, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    pages_per_step = max(1, tokens_per_step // block_size)
    pages_per_split = round_up(ceil_div(max_blocks, num_splits), pages_per_step)
    # Pad the table so every step's slice of pages is in bounds; the padding is 0, the null
    # block, and is masked anyway.
    bt = jnp.pad(block_tables, ((0, 0), (0, pages_per_split * num_splits - max_blocks)))
    max_tokens = max_blocks * block_size
    kw = dict(scale=scale, n=tokens_per_step, tokens_per_split=pages_per_split * block_size,
              max_tokens=max_tokens, paged=True)
    cost = _decode_cost(b, h, kvh, d, max_tokens, q.dtype.itemsize, block_tables.size * 4)
    out = _gpu_call(kw, lengths, bt, q.reshape(b, kvh, h // kvh, d), k_pages, v_pages,
                    num_splits=num_splits, num_stages=num_stages, interpret=interpret, cost=cost)
    return out.reshape(b, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tokens_per_step", "num_splits",
                                             "num_stages"))
def _contiguous_gpu(q, k, v, lengths, *, scale, interpret, tokens_per_step, num_splits, num_stages):
    b, h, d = q.shape
    kvh, max_len = k.shape[1], k.shape[2]
    tokens_per_split = round_up(ceil_div(max_len, num_splits), tokens_per_step)
    pad = tokens_per_split * num_splits - max_len
    if pad:  # a slice must not run off the end (Triton would read out of bounds): costs a copy
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    kw = dict(scale=scale, n=tokens_per_step, tokens_per_split=tokens_per_split,
              max_tokens=max_len, paged=False)
    cost = _decode_cost(b, h, kvh, d, max_len, q.dtype.itemsize)
    out = _gpu_call(kw, lengths, None, q.reshape(b, kvh, h // kvh, d), k, v,
                    num_splits=num_splits, num_stages=num_stages, interpret=interpret, cost=cost)
    return out.reshape(b, h, d)


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic-style) kernels
# ---------------------------------------------------------------------------------------------


def _tpu_attend(q_ref, o_ref, k_buf, v_buf, length, n, copies, scale):
    """The double-buffered loop over cdiv(length, n) steps; see `tpu_double_buffered`."""
    steps = cdiv(length, n)
    load = tpu_double_buffered(k_buf, v_buf, n, steps, copies)
    m, l, acc = _attend_steps(q_ref[...].astype(jnp.float32), length, 0, n, steps, load, scale)
    o_ref[...] = finish(acc, l, o_ref.dtype)


def _tpu_paged_kernel(lengths_ref, bt_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, *,
                      scale, pages_per_block, max_blocks):
    """One program: sequence b, kv head h.

    lengths_ref int32[B] and bt_ref int32[B * max_blocks] in SMEM (flat: SMEM pads a 2-D array's
    minor dimension); q_ref, o_ref [G, D] in VMEM; k_hbm, v_hbm [KVH, num_blocks, bs, D] in HBM;
    k_buf, v_buf [2, pages_per_block, bs, D] VMEM; sems: DMA semaphores [2 (k, v), 2 (slot)].
    The whole block table is prefetched, so B * max_blocks must fit in SMEM (as in JAX's kernel).
    """
    b, h = pl.program_id(0), pl.program_id(1)
    block_size = k_hbm.shape[2]
    length = jnp.minimum(lengths_ref[b], max_blocks * block_size)
    copies = tpu_page_copies(bt_ref, b, max_blocks, cdiv(length, block_size), pages_per_block, (h,),
                             k_hbm, v_hbm, k_buf, v_buf, sems)
    _tpu_attend(q_ref, o_ref, k_buf, v_buf, length, pages_per_block * block_size, copies, scale)


def _tpu_contiguous_kernel(lengths_ref, q_ref, k_hbm, v_hbm, o_ref, k_buf, v_buf, sems, *,
                           scale, n, max_len):
    """One program: sequence b, kv head h. k_hbm, v_hbm [B, KVH, padded max_len, D] in HBM;
    k_buf, v_buf [2, n, D] VMEM; otherwise as _tpu_paged_kernel."""
    b, h = pl.program_id(0), pl.program_id(1)
    length = jnp.minimum(lengths_ref[b], max_len)

    def copies(step, slot):
        src = pl.ds(step * n, n)
        return [pltpu.make_async_copy(k_hbm.at[b, h, src], k_buf.at[slot], sems.at[0, slot]),
                pltpu.make_async_copy(v_hbm.at[b, h, src], v_buf.at[slot], sems.at[1, slot])]

    _tpu_attend(q_ref, o_ref, k_buf, v_buf, length, n, copies, scale)


def _tpu_call(kernel, scalars, q, k, v, buf_shape, interpret, name, cost):
    b, kvh, group, d = q.shape
    q_spec = pl.BlockSpec((None, None, group, d), lambda b_, h_, *_: (b_, h_, 0, 0))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(b, kvh),
        in_specs=[q_spec, pl.BlockSpec(memory_space=pl.ANY), pl.BlockSpec(memory_space=pl.ANY)],
        out_specs=q_spec,
        scratch_shapes=[pltpu.VMEM(buf_shape, k.dtype), pltpu.VMEM(buf_shape, k.dtype),
                        pltpu.SemaphoreType.DMA((2, 2))],
    )
    return pl.pallas_call(
        kernel,
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
        # Each program starts and waits all of its own copies, so programs are independent.
        compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel", "parallel")),
        cost_estimate=cost,
        interpret=interpret,
        name=name,
    )(*scalars, q, k, v)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "pages_per_block"))
def _paged_tpu(q, k_pages, v_pages, block_tables, lengths, *, scale, interpret, pages_per_block):
    b, h, d = q.shape
    kvh, _, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    kernel = functools.partial(_tpu_paged_kernel, scale=scale, pages_per_block=pages_per_block,
                               max_blocks=max_blocks)
    cost = _decode_cost(b, h, kvh, d, max_blocks * block_size, q.dtype.itemsize,
                        block_tables.size * 4)
    out = _tpu_call(kernel, (lengths, block_tables.reshape(-1)), q.reshape(b, kvh, h // kvh, d),
                    k_pages, v_pages, (2, pages_per_block, block_size, d), interpret,
                    "paged_attention_tpu", cost)
    return out.reshape(b, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tokens_per_step"))
def _contiguous_tpu(q, k, v, lengths, *, scale, interpret, tokens_per_step):
    b, h, d = q.shape
    kvh, max_len = k.shape[1], k.shape[2]
    pad = round_up(max_len, tokens_per_step) - max_len
    if pad:  # a DMA must not run off the end of the slab: costs a copy
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    kernel = functools.partial(_tpu_contiguous_kernel, scale=scale, n=tokens_per_step,
                               max_len=max_len)
    cost = _decode_cost(b, h, kvh, d, max_len, q.dtype.itemsize)
    out = _tpu_call(kernel, (lengths,), q.reshape(b, kvh, h // kvh, d), k, v,
                    (2, tokens_per_step, d), interpret, "contiguous_attention_tpu", cost)
    return out.reshape(b, h, d)


# ---------------------------------------------------------------------------------------------
# the Python boundary
# ---------------------------------------------------------------------------------------------


def _check_common(q, k, v, lengths, k_name, v_name, kv_heads_axis):
    if getattr(q, "ndim", None) != 3:
        raise ValueError(f"q must be [batch, num_heads, head_dim]; got shape {np.shape(q)}")
    if getattr(k, "ndim", None) != 4:
        raise ValueError(f"{k_name} must be 4-D; got shape {np.shape(k)}")
    if v.shape != k.shape:
        raise ValueError(f"{v_name} shape {v.shape} differs from {k_name} shape {k.shape}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k.shape[kv_heads_axis]
    if k.shape[-1] != head_dim:
        raise ValueError(f"head_dim mismatch: q has shape {q.shape} (head_dim {head_dim}) but "
                         f"{k_name} has shape {k.shape} (head_dim {k.shape[-1]})")
    if num_kv_heads == 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads % num_kv_heads != 0: q has shape {q.shape} ({num_heads} heads) "
                         f"but {k_name} has shape {k.shape} ({num_kv_heads} kv heads)")
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        raise ValueError(f"q, {k_name} and {v_name} must share one float dtype of f32/bf16/f16; "
                         f"got {q.dtype}, {k.dtype}, {v.dtype}")
    if lengths.dtype != jnp.int32 or lengths.shape != (batch,):
        raise ValueError(f"lengths must be int32[{batch}]; got {lengths.dtype}{list(lengths.shape)}")


def _check_lengths(lengths, capacity, what):
    """Checks concrete lengths against the cache's capacity; traced lengths cannot be checked."""
    try:
        values = np.asarray(lengths)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return
    if values.size == 0:
        return
    if values.min() < 0:
        raise ValueError(f"lengths must be >= 0; got {values.tolist()}")
    if values.max() > capacity:
        raise ValueError(f"{what} holds {capacity} tokens but max(lengths) is {values.max()}")


def check_triton(shape_name, shape, head_dim, tokens_per_step, block_size=None):
    """Interpret mode accepts any sizes; Triton lowering does not: say so before it fails deep."""
    if not (is_pow2(head_dim) and head_dim >= 16) or (block_size and not is_pow2(block_size)):
        raise ValueError(f"the compiled gpu variant needs power-of-two block sizes and head_dim "
                         f">= 16 (Triton); {shape_name} has shape {shape}")
    if not (is_pow2(tokens_per_step) and tokens_per_step >= GPU_MIN_ROWS):
        raise ValueError(f"the compiled gpu variant needs tokens_per_step a power of two >= "
                         f"{GPU_MIN_ROWS} (Triton); got {tokens_per_step}")


def gpu_plan(head_dim, rows, itemsize, limits, tokens_per_step, interpret, max_tokens, what):
    """(tokens_per_step, num_stages) of a GPU kernel: the caller's step if given (two stages),
    else the longest that fits the device's shared memory (see `common.gpu_tiling`). Interpreted
    kernels keep TOKENS_PER_STEP-sized steps whatever the device."""
    cap = max(GPU_MIN_ROWS, min(TOKENS_PER_STEP, pl.next_power_of_2(max(1, max_tokens))))
    if tokens_per_step is not None:
        return int(tokens_per_step), 2
    if interpret:
        return cap, 2
    plan = gpu_tiling(head_dim, rows, itemsize, limits, cap)
    if plan is None:
        raise ValueError(f"{what}: no tiling of head_dim {head_dim} with {rows} query rows fits the "
                         f"{limits.shared_memory_per_block} bytes of shared memory per block on "
                         f"{limits.name or 'this GPU'}")
    return plan


def paged_attention_gpu(q, k_pages, v_pages, block_tables, lengths, *, scale=None, interpret=False,
                        tokens_per_step=None, num_splits=None, limits: DeviceLimits | None = None):
    """The Triton-style kernel, with its tuning knobs (see the module docstring).

    tokens_per_step: tokens each loop step reads (a power of two >= 16: whole pages when at least a
    page, else part of one); default: the most, up to TOKENS_PER_STEP, that fits the device's
    shared memory with a two-stage pipeline. num_splits: programs per (sequence, kv head);
    default 1 when interpreting, else enough to fill the device's SMs. limits: the device the
    kernel is compiled for (default: the local one).
    """
    _check_paged(q, k_pages, v_pages, block_tables, lengths)
    _, interpret, limits = resolve("gpu", interpret, limits)
    block_size, head_dim = k_pages.shape[2], q.shape[2]
    max_blocks = block_tables.shape[1]
    rows = max(GPU_MIN_ROWS, pl.next_power_of_2(q.shape[1] // k_pages.shape[0]))
    tokens_per_step, stages = gpu_plan(head_dim, rows, q.dtype.itemsize, limits, tokens_per_step,
                                       interpret, max_blocks * block_size, "paged_attention")
    tokens_per_step = fit_step_to_pages(tokens_per_step, block_size)
    if not interpret:
        check_triton("k_pages", k_pages.shape, head_dim, tokens_per_step, block_size)
    if num_splits is None:
        num_splits = _gpu_num_splits(q.shape[0] * k_pages.shape[0],
                                     ceil_div(max_blocks * block_size, tokens_per_step), interpret,
                                     limits)
    return _paged_gpu(q, k_pages, v_pages, block_tables, lengths,
                      scale=softmax_scale(scale, head_dim), interpret=interpret,
                      tokens_per_step=int(tokens_per_step), num_splits=int(num_splits),
                      num_stages=stages)


def paged_attention_tpu(q, k_pages, v_pages, block_tables, lengths, *, scale=None, interpret=False,
                        pages_per_block=None, limits: DeviceLimits | None = None):
    """The Mosaic-style kernel. pages_per_block: pages copied per double-buffer slot (default
    TOKENS_PER_STEP tokens' worth, no more than the table holds)."""
    _check_paged(q, k_pages, v_pages, block_tables, lengths)
    _, interpret, limits = resolve("tpu", interpret, limits)
    block_size, head_dim = k_pages.shape[2], q.shape[2]
    if pages_per_block is None:
        pages_per_block = min(max(1, TOKENS_PER_STEP // block_size), block_tables.shape[1])
    check_vmem(q.shape[1] // k_pages.shape[0], head_dim, pages_per_block * block_size,
               q.dtype.itemsize, limits, "paged_attention")
    return _paged_tpu(q, k_pages, v_pages, block_tables, lengths,
                      scale=softmax_scale(scale, head_dim), interpret=interpret,
                      pages_per_block=int(pages_per_block))


def contiguous_attention_gpu(q, k, v, lengths, *, scale=None, interpret=False,
                             tokens_per_step=None, num_splits=None,
                             limits: DeviceLimits | None = None):
    """The Triton-style kernel over a contiguous cache [B, KVH, max_len, D]."""
    _check_contiguous(q, k, v, lengths)
    _, interpret, limits = resolve("gpu", interpret, limits)
    max_len, head_dim = k.shape[2], q.shape[2]
    rows = max(GPU_MIN_ROWS, pl.next_power_of_2(q.shape[1] // k.shape[1]))
    tokens_per_step, stages = gpu_plan(head_dim, rows, q.dtype.itemsize, limits, tokens_per_step,
                                       interpret, max_len, "contiguous_attention")
    if not interpret:
        check_triton("k", k.shape, head_dim, tokens_per_step)
    if num_splits is None:
        num_splits = _gpu_num_splits(q.shape[0] * k.shape[1], ceil_div(max_len, tokens_per_step),
                                     interpret, limits)
    return _contiguous_gpu(q, k, v, lengths, scale=softmax_scale(scale, head_dim),
                           interpret=interpret, tokens_per_step=int(tokens_per_step),
                           num_splits=int(num_splits), num_stages=stages)


def contiguous_attention_tpu(q, k, v, lengths, *, scale=None, interpret=False,
                             tokens_per_step=None, limits: DeviceLimits | None = None):
    """The Mosaic-style kernel over a contiguous cache [B, KVH, max_len, D]."""
    _check_contiguous(q, k, v, lengths)
    _, interpret, limits = resolve("tpu", interpret, limits)
    if tokens_per_step is None:  # a multiple of 8 rows, the sublane tile
        tokens_per_step = min(TOKENS_PER_STEP, round_up(k.shape[2], 8))
    check_vmem(q.shape[1] // k.shape[1], q.shape[2], tokens_per_step, q.dtype.itemsize, limits,
               "contiguous_attention")
    return _contiguous_tpu(q, k, v, lengths, scale=softmax_scale(scale, q.shape[2]),
                           interpret=interpret, tokens_per_step=int(tokens_per_step))


def _check_paged(q, k_pages, v_pages, block_tables, lengths):
    _check_common(q, k_pages, v_pages, lengths, "k_pages", "v_pages", kv_heads_axis=0)
    if block_tables.dtype != jnp.int32:
        raise ValueError(f"block_tables must be int32; got {block_tables.dtype} with shape "
                         f"{block_tables.shape}")
    if block_tables.ndim != 2 or block_tables.shape[0] != q.shape[0]:
        raise ValueError(f"block_tables must be [batch={q.shape[0]}, max_blocks_per_seq]; got shape "
                         f"{block_tables.shape}")
    block_size = k_pages.shape[2]
    _check_lengths(lengths, block_tables.shape[1] * block_size,
                   f"block_tables of shape {block_tables.shape} ({block_tables.shape[1]} blocks of "
                   f"{block_size} tokens)")


def _check_contiguous(q, k, v, lengths):
    _check_common(q, k, v, lengths, "k", "v", kv_heads_axis=1)
    if k.shape[0] != q.shape[0]:
        raise ValueError(f"k must be [batch={q.shape[0]}, num_kv_heads, max_len, head_dim]; got "
                         f"shape {k.shape}")
    _check_lengths(lengths, k.shape[2], f"k of shape {k.shape}")


def paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None, variant="auto",
                    interpret=None, limits: DeviceLimits | None = None):
    """Decode attention over a paged KV cache; see the module docstring. Returns [B, H, D]."""
    variant, interpret, limits = resolve(variant, interpret, limits)
    fn = paged_attention_gpu if variant == "gpu" else paged_attention_tpu
    return fn(q, k_pages, v_pages, block_tables, lengths, scale=scale, interpret=interpret,
              limits=limits)


def contiguous_attention(q, k, v, lengths, *, scale=None, variant="auto", interpret=None,
                         limits: DeviceLimits | None = None):
    """Decode attention over a contiguous cache k, v [B, KVH, max_len, D]. Returns [B, H, D]."""
    variant, interpret, limits = resolve(variant, interpret, limits)
    fn = contiguous_attention_gpu if variant == "gpu" else contiguous_attention_tpu
    return fn(q, k, v, lengths, scale=scale, interpret=interpret, limits=limits)
