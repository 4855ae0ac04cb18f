"""Pallas decode attention over a paged KV cache, and over a contiguous one for comparison.

    paged_attention(q, k_pages, v_pages, block_tables, lengths, *, scale=None,
                    variant="auto", interpret=None) -> [B, H, D]
    contiguous_attention(q, k, v, lengths, *, scale=None, variant="auto", interpret=None)

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
         gathering `pages_per_block` pages a step straight from the pool through the block table,
         with an online softmax. A kv head's group of query heads is padded to 16 rows (Triton's
         dot needs every dimension >= 16, every array a power of two). When the batch alone cannot
         fill the GPU, splits divide a sequence's pages between programs (flash-decoding) and the
         partial results are merged in jnp.
  "tpu"  Mosaic-style Pallas, lowering through Mosaic on TPU. Grid (sequence, kv head). Lengths and
         the (flattened) block tables are scalar-prefetched into SMEM; the pool stays in HBM
         (memory_space=pl.ANY) and each step's pages are copied into VMEM with async copies,
         double-buffered so the next step's copies overlap this step's compute.
  "auto" "tpu" on a TPU backend, "gpu" otherwise (on CPU it interprets faster).
interpret=None interprets on CPU and compiles on GPU/TPU; True forces interpretation; a
pltpu.InterpretParams() runs the TPU variant under the TPU interpreter, which also checks DMA and
semaphore use.

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

try:  # Triton is deprecated as a Pallas backend from jax 0.11 but still ships; CPU/TPU need not care
    from jax.experimental.pallas import triton as pltriton
except ImportError:  # pragma: no cover
    pltriton = None

__all__ = [
    "paged_attention",
    "contiguous_attention",
    "paged_attention_gpu",
    "paged_attention_tpu",
    "contiguous_attention_gpu",
    "contiguous_attention_tpu",
]

VARIANTS = ("auto", "gpu", "tpu")
# Triton's dot needs every dimension >= 16: a kv head's query-head group is padded to this many rows.
GPU_MIN_ROWS = 16
# Tokens per inner step. Bigger steps mean fewer loop trips and bigger tiles; a short context
# wastes at most one step of masked work.
TOKENS_PER_STEP = 128
# A finite stand-in for -inf: exp(MASK_VALUE - m) is exactly 0, and MASK_VALUE - MASK_VALUE is 0,
# never the NaN that -inf - -inf gives.
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


# ---------------------------------------------------------------------------------------------
# shared math (runs inside both the Triton and the Mosaic kernels)
# ---------------------------------------------------------------------------------------------


def _dot(a, b, contract):
    # Default f32 precision is TF32 on NVIDIA GPUs and a single bf16 pass on TPU: HIGHEST keeps
    # f32 caches exact. Other dtypes multiply exactly and accumulate in f32 anyway.
    prec = lax.Precision.HIGHEST if a.dtype == jnp.float32 else None
    return lax.dot_general(a, b, (contract, ((), ())), precision=prec,
                           preferred_element_type=jnp.float32)


def _init_carry(rows, d):
    """(running max m [rows, 1], running sum l [rows, 1], unnormalised output acc [rows, d]), f32."""
    return (jnp.full((rows, 1), MASK_VALUE, jnp.float32), jnp.zeros((rows, 1), jnp.float32),
            jnp.zeros((rows, d), jnp.float32))


def _attend_steps(q, length, tok_first, n, steps, load, scale):
    """Online softmax of q [rows, D] over `steps` steps of n tokens from position tok_first.

    load(i, tok0) -> (k, v), each [n, D]: step i's tokens, positions tok0 .. tok0 + n - 1. Positions
    >= length are masked. Callers stop at length, so every step holds a valid position and the
    running max is a real logit from the first step on (masked entries then get exp() == 0).
    Returns the carry of `_init_carry` after the last step.
    """
    rows, d = q.shape

    def body(i, carry):
        m_prev, l_prev, acc_prev = carry
        tok0 = tok_first + i * n
        k, v = load(i, tok0)
        s = _dot(q, k, ((1,), (1,))) * scale  # [rows, n]
        s = jnp.where(tok0 + lax.broadcasted_iota(jnp.int32, (1, n), 1) < length, s, MASK_VALUE)
        # A masked slot may hold anything, NaN included, and 0 * NaN is NaN: zero it.
        v = jnp.where(tok0 + lax.broadcasted_iota(jnp.int32, (n, d), 0) < length, v, 0)
        m_next = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        alpha = jnp.exp(m_prev - m_next)
        p = jnp.exp(s - m_next)
        l_next = alpha * l_prev + jnp.sum(p, axis=1, keepdims=True)
        acc_next = alpha * acc_prev + _dot(p.astype(v.dtype), v, ((1,), (0,)))
        return m_next, l_next, acc_next

    return lax.fori_loop(0, steps, body, _init_carry(rows, d))


def _finish(acc, l, dtype):
    # l == 0 only when no position was valid (length 0): give zeros, not 0/0.
    return (acc / jnp.where(l > 0, l, 1.0)).astype(dtype)


def _cdiv(a, b):
    # lax.div, not //: jnp's floor division lowers through sign(), which Mosaic can only lower
    # knowing the TPU generation. Every operand here is non-negative, where the two agree.
    return lax.div(a + b - 1, b)


def _round_up(x, m):
    return -(-x // m) * m


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
    steps = _cdiv(jnp.maximum(jnp.minimum(first + tokens_per_split, length) - first, 0), n)

    if paged:
        block_size = k_ref.shape[2]
        pages_per_block = n // block_size
        num_pages = _cdiv(length, block_size)

        def load(i, tok0):
            page0 = lax.div(tok0, block_size)
            idx = page0 + lax.broadcasted_iota(jnp.int32, (pages_per_block,), 0)
            # Entries past the sequence's last page may be stale: follow the null block instead.
            pages = jnp.where(idx < num_pages, bt_ref[pl.ds(page0, pages_per_block)], 0)
            return k_ref[h, pages].reshape(n, d), v_ref[h, pages].reshape(n, d)
    else:
        def load(i, tok0):
            return k_ref[b, h, pl.ds(tok0, n)], v_ref[b, h, pl.ds(tok0, n)]

    m, l, acc = _attend_steps(q_ref[...], length, first, n, steps, load, scale)
    o_ref[...] = acc
    m_ref[...] = m.reshape(rows)
    l_ref[...] = l.reshape(rows)


def _gpu_call(kernel_kwargs, lengths, bt, q, k, v, *, num_splits, interpret):
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
        params = pltriton.CompilerParams(num_warps=4, num_stages=2)
    o, m, l = pl.pallas_call(
        functools.partial(_gpu_kernel, **kernel_kwargs),
        grid=(b, kvh, num_splits),
        in_specs=in_specs,
        out_specs=[split_spec(d), split_spec(), split_spec()],
        out_shape=[jax.ShapeDtypeStruct((num_splits, b, kvh, rows, d), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, b, kvh, rows), jnp.float32),
                   jax.ShapeDtypeStruct((num_splits, b, kvh, rows), jnp.float32)],
        compiler_params=params,
        interpret=interpret,
        name="paged_attention_gpu" if bt is not None else "contiguous_attention_gpu",
    )(*args)
    # Merge the splits' partial softmaxes; an empty split has m = MASK_VALUE, l = 0, o = 0 and
    # drops out (its weight exp(MASK_VALUE - m_max) is 0, or it is all there is and l stays 0).
    m_max = jnp.max(m, axis=0)
    w = jnp.exp(m - m_max)
    acc = jnp.sum(o * w[..., None], axis=0)
    l_sum = jnp.sum(l * w, axis=0)
    return _finish(acc, l_sum[..., None], q.dtype)[:, :, :group]


def _gpu_num_splits(programs, max_steps, interpret):
    """Splits per sequence so that about two programs run per SM (never in interpret mode)."""
    if interpret:
        return 1
    sms = getattr(jax.devices()[0], "core_count", None) or 132
    return int(max(1, min(_cdiv_py(2 * sms, programs), max_steps, 32)))


def _cdiv_py(a, b):
    return -(-a // b)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "pages_per_block", "num_splits"))
def _paged_gpu(q, k_pages, v_pages, block_tables, lengths, *, scale, interpret, pages_per_block,
               num_splits):
    b, h, d = q.shape
    kvh, _, block_size, _ = k_pages.shape
    max_blocks = block_tables.shape[1]
    pages_per_split = _round_up(_cdiv_py(max_blocks, num_splits), pages_per_block)
    # Pad the table so every step's slice of pages_per_block entries is in bounds; the padding
    # is 0, the null block, and is masked anyway.
    bt = jnp.pad(block_tables, ((0, 0), (0, pages_per_split * num_splits - max_blocks)))
    kw = dict(scale=scale, n=pages_per_block * block_size,
              tokens_per_split=pages_per_split * block_size, max_tokens=max_blocks * block_size,
              paged=True)
    out = _gpu_call(kw, lengths, bt, q.reshape(b, kvh, h // kvh, d), k_pages, v_pages,
                    num_splits=num_splits, interpret=interpret)
    return out.reshape(b, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tokens_per_step", "num_splits"))
def _contiguous_gpu(q, k, v, lengths, *, scale, interpret, tokens_per_step, num_splits):
    b, h, d = q.shape
    kvh, max_len = k.shape[1], k.shape[2]
    tokens_per_split = _round_up(_cdiv_py(max_len, num_splits), tokens_per_step)
    pad = tokens_per_split * num_splits - max_len
    if pad:  # a slice must not run off the end (Triton would read out of bounds): costs a copy
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    kw = dict(scale=scale, n=tokens_per_step, tokens_per_split=tokens_per_split,
              max_tokens=max_len, paged=False)
    out = _gpu_call(kw, lengths, None, q.reshape(b, kvh, h // kvh, d), k, v,
                    num_splits=num_splits, interpret=interpret)
    return out.reshape(b, h, d)


# ---------------------------------------------------------------------------------------------
# TPU (Mosaic-style) kernels
# ---------------------------------------------------------------------------------------------


def _tpu_attend(q_ref, o_ref, k_buf, v_buf, length, n, steps, copies, scale):
    """Double-buffered loop: step i computes on slot i % 2 while step i + 1's copies fill the other.

    copies(step, slot) -> the async copies (descriptors) that bring step's K and V into slot.
    """
    d = q_ref.shape[1]

    @pl.when(steps > 0)
    def _():
        for c in copies(0, 0):
            c.start()

    def load(i, tok0):
        slot = lax.rem(i, 2)

        @pl.when(i + 1 < steps)
        def _():
            for c in copies(i + 1, 1 - slot):
                c.start()

        for c in copies(i, slot):
            c.wait()
        # Compute in f32: Mosaic merges [pages, bs, D] into [pages * bs, D] cleanly only on
        # 32-bit tiles (a bf16 tile is 16 rows, which an 8-token block would straddle).
        k = k_buf[slot].astype(jnp.float32).reshape(n, d)
        v = v_buf[slot].astype(jnp.float32).reshape(n, d)
        return k, v

    q = q_ref[...].astype(jnp.float32)
    m, l, acc = _attend_steps(q, length, 0, n, steps, load, scale)
    o_ref[...] = _finish(acc, l, o_ref.dtype)


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
    n = pages_per_block * block_size
    length = jnp.minimum(lengths_ref[b], max_blocks * block_size)
    num_pages = _cdiv(length, block_size)

    def copies(step, slot):
        # One DMA per page; a slot's copies all signal one semaphore and are waited one by one.
        # A step's pages past the sequence's end copy the null block (in bounds, then masked).
        out = []
        for j in range(pages_per_block):
            idx = step * pages_per_block + j
            entry = bt_ref[b * max_blocks + jnp.minimum(idx, max_blocks - 1)]
            page = jnp.where(idx < num_pages, entry, 0)
            for hbm, buf, sem in ((k_hbm, k_buf, sems.at[0, slot]), (v_hbm, v_buf, sems.at[1, slot])):
                out.append(pltpu.make_async_copy(hbm.at[h, page], buf.at[slot, j], sem))
        return out

    _tpu_attend(q_ref, o_ref, k_buf, v_buf, length, n, _cdiv(length, n), copies, scale)


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

    _tpu_attend(q_ref, o_ref, k_buf, v_buf, length, n, _cdiv(length, n), copies, scale)


def _tpu_call(kernel, scalars, q, k, v, buf_shape, interpret, name):
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
    out = _tpu_call(kernel, (lengths, block_tables.reshape(-1)), q.reshape(b, kvh, h // kvh, d),
                    k_pages, v_pages, (2, pages_per_block, block_size, d), interpret,
                    "paged_attention_tpu")
    return out.reshape(b, h, d)


@functools.partial(jax.jit, static_argnames=("scale", "interpret", "tokens_per_step"))
def _contiguous_tpu(q, k, v, lengths, *, scale, interpret, tokens_per_step):
    b, h, d = q.shape
    kvh, max_len = k.shape[1], k.shape[2]
    pad = _round_up(max_len, tokens_per_step) - max_len
    if pad:  # a DMA must not run off the end of the slab: costs a copy
        k = jnp.pad(k, ((0, 0), (0, 0), (0, pad), (0, 0)))
        v = jnp.pad(v, ((0, 0), (0, 0), (0, pad), (0, 0)))
    kernel = functools.partial(_tpu_contiguous_kernel, scale=scale, n=tokens_per_step,
                               max_len=max_len)
    out = _tpu_call(kernel, (lengths,), q.reshape(b, kvh, h // kvh, d), k, v,
                    (2, tokens_per_step, d), interpret, "contiguous_attention_tpu")
    return out.reshape(b, h, d)


# ---------------------------------------------------------------------------------------------
# the Python boundary
# ---------------------------------------------------------------------------------------------


def _is_pow2(x):
    return x > 0 and x & (x - 1) == 0


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
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in _DTYPES:
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


def _resolve(variant, interpret):
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}; got {variant!r}")
    backend = jax.default_backend()
    if variant == "auto":
        variant = "tpu" if backend == "tpu" else "gpu"
    if interpret is None:
        interpret = backend == "cpu"
    if variant == "gpu" and isinstance(interpret, pltpu.InterpretParams):
        raise ValueError("interpret=pltpu.InterpretParams() applies to variant='tpu' only")
    return variant, interpret


def _check_triton(shape_name, shape, block, head_dim):
    # Interpret mode accepts any sizes; Triton lowering does not, so say so before it fails deep.
    if not (_is_pow2(block) and _is_pow2(head_dim) and head_dim >= 16):
        raise ValueError(f"the compiled gpu variant needs power-of-two block sizes and head_dim "
                         f">= 16 (Triton); {shape_name} has shape {shape}")


def paged_attention_gpu(q, k_pages, v_pages, block_tables, lengths, *, scale=None, interpret=False,
                        pages_per_block=None, num_splits=None):
    """The Triton-style kernel, with its tuning knobs (see the module docstring).

    pages_per_block: pages gathered per step (a power of two with pages_per_block * block_size
    >= 16; default TOKENS_PER_STEP tokens' worth, no more than the table needs). num_splits:
    programs per (sequence, kv head); default 1 when interpreting, else enough to fill the GPU.
    """
    _check_paged(q, k_pages, v_pages, block_tables, lengths)
    block_size, head_dim = k_pages.shape[2], q.shape[2]
    max_blocks = block_tables.shape[1]
    if not interpret:
        _check_triton("k_pages", k_pages.shape, block_size, head_dim)
    if pages_per_block is None:
        pages_per_block = min(max(1, TOKENS_PER_STEP // block_size), pl.next_power_of_2(max_blocks))
        pages_per_block = max(pages_per_block, _cdiv_py(GPU_MIN_ROWS, block_size))
    if num_splits is None:
        num_splits = _gpu_num_splits(q.shape[0] * k_pages.shape[0],
                                     _cdiv_py(max_blocks, pages_per_block), interpret)
    return _paged_gpu(q, k_pages, v_pages, block_tables, lengths, scale=_scale(scale, head_dim),
                      interpret=interpret, pages_per_block=int(pages_per_block),
                      num_splits=int(num_splits))


def paged_attention_tpu(q, k_pages, v_pages, block_tables, lengths, *, scale=None, interpret=False,
                        pages_per_block=None):
    """The Mosaic-style kernel. pages_per_block: pages copied per double-buffer slot (default
    TOKENS_PER_STEP tokens' worth, no more than the table holds)."""
    _check_paged(q, k_pages, v_pages, block_tables, lengths)
    block_size, head_dim = k_pages.shape[2], q.shape[2]
    if pages_per_block is None:
        pages_per_block = min(max(1, TOKENS_PER_STEP // block_size), block_tables.shape[1])
    return _paged_tpu(q, k_pages, v_pages, block_tables, lengths, scale=_scale(scale, head_dim),
                      interpret=interpret, pages_per_block=int(pages_per_block))


def contiguous_attention_gpu(q, k, v, lengths, *, scale=None, interpret=False,
                             tokens_per_step=None, num_splits=None):
    """The Triton-style kernel over a contiguous cache [B, KVH, max_len, D]."""
    _check_contiguous(q, k, v, lengths)
    max_len, head_dim = k.shape[2], q.shape[2]
    if tokens_per_step is None:
        tokens_per_step = max(GPU_MIN_ROWS, min(TOKENS_PER_STEP, pl.next_power_of_2(max_len)))
    if not interpret:
        _check_triton("k", k.shape, tokens_per_step, head_dim)
    if num_splits is None:
        num_splits = _gpu_num_splits(q.shape[0] * k.shape[1], _cdiv_py(max_len, tokens_per_step),
                                     interpret)
    return _contiguous_gpu(q, k, v, lengths, scale=_scale(scale, head_dim), interpret=interpret,
                           tokens_per_step=int(tokens_per_step), num_splits=int(num_splits))


def contiguous_attention_tpu(q, k, v, lengths, *, scale=None, interpret=False,
                             tokens_per_step=None):
    """The Mosaic-style kernel over a contiguous cache [B, KVH, max_len, D]."""
    _check_contiguous(q, k, v, lengths)
    if tokens_per_step is None:  # a multiple of 8 rows, the sublane tile
        tokens_per_step = min(TOKENS_PER_STEP, _round_up(k.shape[2], 8))
    return _contiguous_tpu(q, k, v, lengths, scale=_scale(scale, q.shape[2]), interpret=interpret,
                           tokens_per_step=int(tokens_per_step))


def _scale(scale, head_dim):
    return float(head_dim**-0.5 if scale is None else scale)


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
                    interpret=None):
    """Decode attention over a paged KV cache; see the module docstring. Returns [B, H, D]."""
    variant, interpret = _resolve(variant, interpret)
    fn = paged_attention_gpu if variant == "gpu" else paged_attention_tpu
    return fn(q, k_pages, v_pages, block_tables, lengths, scale=scale, interpret=interpret)


def contiguous_attention(q, k, v, lengths, *, scale=None, variant="auto", interpret=None):
    """Decode attention over a contiguous cache k, v [B, KVH, max_len, D]. Returns [B, H, D]."""
    variant, interpret = _resolve(variant, interpret)
    fn = contiguous_attention_gpu if variant == "gpu" else contiguous_attention_tpu
    return fn(q, k, v, lengths, scale=scale, interpret=interpret)
