"""The Pallas kernels (both variants, CPU interpret mode) against the jnp reference.

Every case draws fresh random inputs, scatters each sequence over shuffled physical blocks of a
pool that is NaN everywhere a sequence does not own (null block 0, spare blocks, the slots past
a sequence's length), and includes lengths 0, 1, a block, a block plus one and the maximum.
Kernels are always called inside jax.jit: un-jitted interpretation costs ~0.4 s a call.
"""

import functools
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax import export  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

import pagedjax.pallas.paged_attention  # noqa: E402,F401
from pagedjax.pallas.testing import paged_case, to_contiguous  # noqa: E402
from pagedjax.pallas import (  # noqa: E402
    contiguous_attention,
    contiguous_attention_reference,
    paged_attention,
    paged_attention_reference,
)

# pagedjax.pallas.paged_attention is the function; the module holds the per-variant entry points.
kernels = sys.modules["pagedjax.pallas.paged_attention"]

F32_TOL, BF16_TOL = 1e-5, 2e-2


def check(out, ref, lengths, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32 = np.asarray(out.astype(jnp.float32))
    ref32 = np.asarray(ref.astype(jnp.float32))
    assert np.all(np.isfinite(out32)), "NaN/inf in the output: a masked or unowned slot leaked"
    err = np.max(np.abs(out32 - ref32)) / np.max(np.abs(ref32))
    assert err <= (F32_TOL if dtype == jnp.float32 else BF16_TOL), f"relative error {err:.3g}"
    zero_rows = np.asarray(lengths) == 0
    assert np.all(out32[zero_rows] == 0.0), "length-0 rows must give exact zeros"


ref_jit = jax.jit(paged_attention_reference)

# Each (block_size, heads, kv heads, head_dim, dtype) is one compile per variant, so the cases
# cover every block size, GQA ratio, head_dim and dtype without the full cross product.
CASES = [
    (8, 4, 4, 64, jnp.float32),  # GQA 1
    (16, 9, 3, 64, jnp.float32),  # GQA 3, SmolLM2's heads
    (32, 8, 2, 128, jnp.float32),  # GQA 4
    (64, 8, 1, 64, jnp.bfloat16),  # GQA 8
    (128, 9, 3, 128, jnp.bfloat16),
    (8, 8, 2, 64, jnp.bfloat16),
]


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim,dtype", CASES)
def test_kernel_matches_reference(variant, block_size, num_heads, num_kv_heads, head_dim, dtype):
    seed = block_size * 1000 + num_heads * 10 + num_kv_heads + (variant == "tpu") * 7
    q, k_pages, v_pages, tables, lengths = paged_case(
        seed, block_size=block_size, num_heads=num_heads, num_kv_heads=num_kv_heads,
        head_dim=head_dim, dtype=dtype)
    out = jax.jit(functools.partial(paged_attention, variant=variant))(q, k_pages, v_pages, tables,
                                                                      lengths)
    check(out, ref_jit(q, k_pages, v_pages, tables, lengths), lengths, dtype)


@pytest.mark.parametrize("block_size,tokens_per_step,num_splits",
                         [(16, 16, 1), (16, 32, 3), (16, 64, 2), (32, 16, 2), (64, 16, 1)])
def test_gpu_steps_and_splits(block_size, tokens_per_step, num_splits):
    # The compiled GPU path splits sequences when the batch is small (never on CPU by default):
    # cover the split merge, empty splits, several pages per step, and steps that read part of a
    # page (what the kernel does when a page's K and V would not fit a GPU's shared memory).
    q, k_pages, v_pages, tables, lengths = paged_case(
        tokens_per_step * 10 + num_splits + block_size, block_size=block_size, num_heads=9,
        num_kv_heads=3, head_dim=64, dtype=jnp.float32, max_blocks=6)
    f = jax.jit(functools.partial(kernels.paged_attention_gpu, interpret=True,
                                  tokens_per_step=tokens_per_step, num_splits=num_splits))
    check(f(q, k_pages, v_pages, tables, lengths), ref_jit(q, k_pages, v_pages, tables, lengths),
          lengths, jnp.float32)


def test_tpu_pages_per_block_not_dividing_table():
    # 3 pages a step over a 7-entry table: the last step copies the null block for what is missing.
    q, k_pages, v_pages, tables, lengths = paged_case(
        5, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.float32,
        max_blocks=7)
    f = jax.jit(functools.partial(kernels.paged_attention_tpu, interpret=True, pages_per_block=3))
    check(f(q, k_pages, v_pages, tables, lengths), ref_jit(q, k_pages, v_pages, tables, lengths),
          lengths, jnp.float32)


def test_tpu_variant_under_tpu_interpreter():
    # The TPU interpreter checks DMA and semaphore semantics (reads of un-awaited copies see NaN,
    # unbalanced semaphores fail). Tiny, since it runs ~1 s per call.
    q, k_pages, v_pages, tables, lengths = paged_case(
        9, block_size=8, num_heads=2, num_kv_heads=1, head_dim=64, dtype=jnp.float32,
        max_blocks=3, batch_lengths=[0, 3, 17])
    params = pltpu.InterpretParams(detect_races=True)
    f = jax.jit(functools.partial(kernels.paged_attention_tpu, interpret=params, pages_per_block=1))
    try:
        out = f(q, k_pages, v_pages, tables, lengths)
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise
    check(out, ref_jit(q, k_pages, v_pages, tables, lengths), lengths, jnp.float32)


@pytest.mark.parametrize("variant,tokens_per_step,num_splits", [
    ("gpu", None, None), ("gpu", 16, 2), ("tpu", None, None), ("tpu", 16, None),
])
def test_contiguous_kernel_matches_reference(variant, tokens_per_step, num_splits):
    q, k_pages, v_pages, tables, lengths = paged_case(
        21, block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=jnp.float32)
    max_len = 58  # not a multiple of the step: the kernel pads the slab
    lengths = jnp.minimum(lengths, max_len)
    k, v = to_contiguous(k_pages, tables, max_len), to_contiguous(v_pages, tables, max_len)
    if variant == "gpu":
        fn = functools.partial(kernels.contiguous_attention_gpu, interpret=True,
                               tokens_per_step=tokens_per_step, num_splits=num_splits)
    else:
        fn = functools.partial(kernels.contiguous_attention_tpu, interpret=True,
                               tokens_per_step=tokens_per_step)
    out = jax.jit(fn)(q, k, v, lengths)
    check(out, jax.jit(contiguous_attention_reference)(q, k, v, lengths), lengths, jnp.float32)


def test_contiguous_public_entry_point():
    q, k_pages, v_pages, tables, lengths = paged_case(
        22, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64, dtype=jnp.bfloat16)
    k, v = to_contiguous(k_pages, tables, 32), to_contiguous(v_pages, tables, 32)
    out = jax.jit(contiguous_attention)(q, k, v, lengths)
    check(out, jax.jit(contiguous_attention_reference)(q, k, v, lengths), lengths, jnp.bfloat16)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_compiles_once_for_new_lengths_and_tables(variant):
    traces = []

    def step(q, k_pages, v_pages, tables, lengths):
        traces.append(1)
        return paged_attention(q, k_pages, v_pages, tables, lengths, variant=variant)

    f = jax.jit(step)
    for seed in range(3):  # same shapes, new lengths and freshly shuffled block tables
        rng = np.random.default_rng(seed)
        bl = [int(x) for x in rng.integers(0, 33, size=6)]
        args = paged_case(seed, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64,
                          dtype=jnp.float32, batch_lengths=bl)
        # Same pool size every time, so only values change.
        q, k_pages, v_pages, tables, lengths = args
        pad = 40 - k_pages.shape[1]
        k_pages = jnp.pad(k_pages, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=np.nan)
        v_pages = jnp.pad(v_pages, ((0, 0), (0, pad), (0, 0), (0, 0)), constant_values=np.nan)
        check(f(q, k_pages, v_pages, tables, lengths),
              ref_jit(q, k_pages, v_pages, tables, lengths), lengths, jnp.float32)
    assert len(traces) == 1 and f._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# lowering: interpret mode does not enforce Triton's or Mosaic's limits, so lower for real
# ---------------------------------------------------------------------------------------------

# Pallas Triton calls are custom calls without export stability guarantees; we only lower here.
_TRITON = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
S = jax.ShapeDtypeStruct


@pytest.mark.skipif(kernels.pltriton is None, reason="this jax has no Pallas Triton backend")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size", [8, 128])
def test_lowers_for_cuda_and_tpu(dtype, block_size):
    b, h, kvh, d, nb, mb = 4, 9, 3, 64, 37, 5  # odd pool and table sizes; GQA 3 padded to 16 rows
    paged = [S((b, h, d), dtype), S((kvh, nb, block_size, d), dtype),
             S((kvh, nb, block_size, d), dtype), S((b, mb), jnp.int32), S((b,), jnp.int32)]
    contig = [S((b, h, d), dtype), S((b, kvh, 100, d), dtype), S((b, kvh, 100, d), dtype),
              S((b,), jnp.int32)]
    for platform, fn, args in [
        ("cuda", kernels.paged_attention_gpu, paged),
        ("tpu", kernels.paged_attention_tpu, paged),
        ("cuda", kernels.contiguous_attention_gpu, contig),
        ("tpu", kernels.contiguous_attention_tpu, contig),
    ]:
        exp = export.export(jax.jit(functools.partial(fn, interpret=False)), platforms=[platform],
                            disabled_checks=_TRITON)(*args)
        text = exp.mlir_module()
        assert ("xla.gpu.triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)


# ---------------------------------------------------------------------------------------------
# bad input at the Python boundary
# ---------------------------------------------------------------------------------------------


def _good():
    return paged_case(0, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64,
                      dtype=jnp.float32, max_blocks=3, batch_lengths=[0, 5, 24])


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_bad_input_raises_value_error(variant):
    q, k_pages, v_pages, tables, lengths = _good()
    call = functools.partial(paged_attention, variant=variant)

    with pytest.raises(ValueError, match=r"head_dim.*\(3, 4, 32\).*k_pages.*\(2, \d+, 8, 64\)"):
        call(q[..., :32], k_pages, v_pages, tables, lengths)
    with pytest.raises(ValueError, match=r"num_kv_heads.*\(3, 3, 64\).*k_pages"):
        call(q[:, :3], k_pages, v_pages, tables, lengths)
    with pytest.raises(ValueError, match=r"block_tables must be int32.*int64.*\(3, 3\)"):
        call(q, k_pages, v_pages, np.asarray(tables, np.int64), lengths)
    with pytest.raises(ValueError, match=r"block_tables must be int32.*float32"):
        call(q, k_pages, v_pages, tables.astype(jnp.float32), lengths)
    with pytest.raises(ValueError, match=r"block_tables of shape \(3, 2\).*16 tokens.*24"):
        call(q, k_pages, v_pages, tables[:, :2], lengths)
    with pytest.raises(ValueError, match=r"v_pages shape"):
        call(q, k_pages, v_pages[:1], tables, lengths)
    with pytest.raises(ValueError, match=r"lengths must be int32\[3\]"):
        call(q, k_pages, v_pages, tables, lengths.astype(jnp.float32))
    with pytest.raises(ValueError, match=r"dtype"):
        call(q.astype(jnp.bfloat16), k_pages, v_pages, tables, lengths)


def test_bad_input_contiguous_and_options():
    q, k_pages, v_pages, tables, lengths = _good()
    k = to_contiguous(k_pages, tables, 24)
    with pytest.raises(ValueError, match=r"k of shape \(3, 2, 20, 64\).*20 tokens.*24"):
        contiguous_attention(q, k[:, :, :20], k[:, :, :20], lengths)
    with pytest.raises(ValueError, match=r"head_dim.*k has shape"):
        contiguous_attention(q, k[..., :32], k[..., :32], lengths)
    with pytest.raises(ValueError, match=r"variant"):
        paged_attention(q, k_pages, v_pages, tables, lengths, variant="cuda")
    with pytest.raises(ValueError, match=r"InterpretParams"):
        paged_attention(q, k_pages, v_pages, tables, lengths, variant="gpu",
                        interpret=pltpu.InterpretParams())
    with pytest.raises(ValueError, match=r"power-of-two.*k_pages"):  # Triton's limits, compiled only
        kernels.paged_attention_gpu(q[..., :48], k_pages[..., :48], v_pages[..., :48], tables,
                                    lengths, interpret=False)
