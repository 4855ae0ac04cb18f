"""The ragged paged-attention kernels (both variants, CPU interpret mode) against the jnp reference.

Every case draws fresh random inputs and scatters each sequence over shuffled physical blocks of a
pool that is NaN everywhere a sequence does not own (null block 0, spare blocks, the slots past a
sequence's context); table entries past a sequence's last page are stale, not 0. Padding query
rows are NaN too, and padding seats (>= num_seqs) carry garbage lengths, tables and
query_start_loc entries, which must all be ignored. Kernels are always called inside jax.jit:
un-jitted interpretation costs ~0.4 s a call.
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

import pagedjax.pallas.ragged_paged_attention  # noqa: E402,F401
from pagedjax.pallas import ragged_paged_attention, ragged_paged_attention_reference  # noqa: E402
from pagedjax.pallas.testing import ragged_case  # noqa: E402

# pagedjax.pallas.ragged_paged_attention is the function; the module holds the per-variant entry
# points.
kernels = sys.modules["pagedjax.pallas.ragged_paged_attention"]

F32_TOL, BF16_TOL = 1e-5, 2e-2


def check(out, ref, args, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    out32 = np.asarray(out.astype(jnp.float32))
    ref32 = np.asarray(ref.astype(jnp.float32))
    assert np.all(np.isfinite(out32)), "NaN/inf in the output: a masked or unowned slot leaked"
    err = np.max(np.abs(out32 - ref32)) / np.max(np.abs(ref32))
    assert err <= (F32_TOL if dtype == jnp.float32 else BF16_TOL), f"relative error {err:.3g}"
    last = int(args[5][int(args[6])])
    assert np.all(out32[last:] == 0.0), "padding rows must give exact zeros"


ref_jit = jax.jit(ragged_paged_attention_reference)

# Each scenario is one compile per variant; together they cover head_dim 64 and 128, GQA 1, 3 and
# 8, f32 and bf16, and block sizes 8 to 32, without the full cross product.
SCENARIOS = {
    # one token per sequence, contexts of 1, a block, a block plus one, the maximum
    "decode": dict(seqs=[(1, 1), (16, 1), (17, 1), (64, 1), (40, 1), (23, 1)],
                   block_size=16, num_heads=9, num_kv_heads=3, head_dim=64, dtype=jnp.float32,
                   num_tokens=8, num_seats=8, max_blocks=4),
    # whole prompts, nothing cached before them
    "prefill": dict(seqs=[(13, 13), (8, 8), (1, 1), (30, 30)],
                    block_size=8, num_heads=4, num_kv_heads=4, head_dim=128, dtype=jnp.float32,
                    num_tokens=56, num_seats=6, max_blocks=4),
    # one long chunk starting mid-block (position 30 of blocks of 16) among decodes, and a live
    # sequence with no tokens this step
    "mixed": dict(seqs=[(5, 1), (70, 40), (33, 1), (0, 0), (1, 1), (48, 1), (17, 1), (9, 1)],
                  block_size=16, num_heads=8, num_kv_heads=1, head_dim=64, dtype=jnp.bfloat16,
                  num_tokens=48, num_seats=10, max_blocks=5),
    # a prefix-cached sequence whose chunk starts after 300 cached tokens (mid-block), beside a
    # short prefill and decodes
    "prefix": dict(seqs=[(324, 24), (5, 5), (100, 1), (31, 1), (64, 1)],
                   block_size=32, num_heads=9, num_kv_heads=3, head_dim=128, dtype=jnp.bfloat16,
                   num_tokens=40, num_seats=6, max_blocks=11),
}


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_kernel_matches_reference(variant, scenario):
    cfg = SCENARIOS[scenario]
    seed = list(SCENARIOS).index(scenario) * 10 + (variant == "tpu")
    args = ragged_case(seed, **cfg)
    f = jax.jit(functools.partial(ragged_paged_attention, variant=variant))
    check(f(*args), ref_jit(*args), args, cfg["dtype"])


@pytest.mark.parametrize("variant,block_size,block_q,step", [
    ("gpu", 8, 2, 8),  # many tiles per chunk, one page a step
    ("gpu", 8, 8, 32),
    ("gpu", 32, 4, 16),  # half a page a step (a GPU's shared memory may not hold a whole page)
    ("tpu", 8, 4, 3),  # 3 pages a step over an 11-entry table: the last step copies the null block
])
def test_tiles_and_steps(variant, block_size, block_q, step):
    cfg = dict(SCENARIOS["prefix"], dtype=jnp.float32, block_size=block_size,
               max_blocks=-(-328 // block_size))
    args = ragged_case(7, **cfg)
    if variant == "gpu":  # the GPU kernel's step is in tokens, the TPU kernel's in pages
        fn = functools.partial(kernels.ragged_paged_attention_gpu, tokens_per_step=step)
    else:
        fn = functools.partial(kernels.ragged_paged_attention_tpu, pages_per_block=step)
    f = jax.jit(functools.partial(fn, interpret=True, block_q=block_q))
    check(f(*args), ref_jit(*args), args, jnp.float32)


@pytest.mark.parametrize("variant", ["gpu", "tpu"])
def test_layer_of_a_stacked_pool(variant):
    # A model's layer loop passes the whole stacked pool [L, KVH, ...] and a traced layer index;
    # the kernel must read that layer in place, and nothing of the other layers (all NaN here).
    cfg = dict(SCENARIOS["mixed"], dtype=jnp.float32)
    q, k, v, bt, cl, qsl, n = ragged_case(11, **cfg)
    nan = jnp.full_like(k, jnp.nan)
    k3, v3 = jnp.stack([nan, k, nan]), jnp.stack([nan, v, nan])
    f = jax.jit(functools.partial(ragged_paged_attention, variant=variant))
    out = f(q, k3, v3, bt, cl, qsl, n, layer=jnp.int32(1))
    ref = ref_jit(q, k, v, bt, cl, qsl, n)
    check(out, ref, (q, k, v, bt, cl, qsl, n), jnp.float32)
    ref3 = jax.jit(functools.partial(ragged_paged_attention_reference, layer=jnp.int32(1)))(q, k3, v3, bt, cl, qsl, n)
    np.testing.assert_array_equal(np.asarray(ref3), np.asarray(ref))
    with pytest.raises(ValueError, match=r"layer must lie in \[0, 3\)"):
        ragged_paged_attention(q, k3, v3, bt, cl, qsl, n, layer=3, variant=variant)
    with pytest.raises(ValueError, match=r"k_pages must be \[num_layers, num_kv_heads"):
        ragged_paged_attention(q, k, v, bt, cl, qsl, n, layer=0, variant=variant)


def test_tpu_variant_under_tpu_interpreter():
    # The TPU interpreter checks DMA and semaphore semantics (reads of un-awaited copies see NaN,
    # unbalanced semaphores fail). Tiny, since it runs ~1 s per call.
    args = ragged_case(9, [(12, 5), (3, 1)], block_size=8, num_heads=2, num_kv_heads=1,
                       head_dim=64, dtype=jnp.float32, num_tokens=8, num_seats=3, max_blocks=2)
    params = pltpu.InterpretParams(detect_races=True)
    f = jax.jit(functools.partial(kernels.ragged_paged_attention_tpu, interpret=params, block_q=4,
                                  pages_per_block=1))
    try:
        out = f(*args)
    except Exception:
        pltpu.reset_tpu_interpret_mode_state()
        raise
    check(out, ref_jit(*args), args, jnp.float32)


@pytest.mark.parametrize("variant", ["auto", "tpu"])
def test_compiles_once_for_new_values(variant):
    traces = []

    def step(*args):
        traces.append(1)
        return ragged_paged_attention(*args, variant=variant)

    f = jax.jit(step)
    rng = np.random.default_rng(3)
    for draw in range(3):  # same shapes; new batch composition, lengths, tables and num_seqs
        seqs = []
        for _ in range(int(rng.integers(1, 6))):
            q_len = int(rng.choice([0, 1, 1, int(rng.integers(2, 9))]))
            seqs.append((q_len + int(rng.integers(0, 40 - q_len)), q_len))
        args = ragged_case(draw, seqs, block_size=8, num_heads=4, num_kv_heads=2, head_dim=64,
                           dtype=jnp.float32, num_tokens=40, num_seats=6, max_blocks=5,
                           num_blocks=32)
        check(f(*args), ref_jit(*args), args, jnp.float32)
    assert len(traces) == 1 and f._cache_size() == 1


# ---------------------------------------------------------------------------------------------
# lowering: interpret mode does not enforce Triton's or Mosaic's limits, so lower for real
# ---------------------------------------------------------------------------------------------

# Pallas Triton calls are custom calls without export stability guarantees; we only lower here.
_TRITON = [export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
S = jax.ShapeDtypeStruct


@pytest.mark.skipif(kernels.pltriton is None, reason="this jax has no Pallas Triton backend")
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("block_size,num_heads,num_kv_heads,head_dim",
                         [(8, 9, 3, 64), (16, 4, 4, 64), (128, 8, 1, 128)])
def test_lowers_for_cuda_and_tpu(dtype, block_size, num_heads, num_kv_heads, head_dim):
    t, s, nb, mb = 40, 5, 37, 5  # odd pool and table sizes
    pool = S((num_kv_heads, nb, block_size, head_dim), dtype)
    args = [S((t, num_heads, head_dim), dtype), pool, pool, S((s, mb), jnp.int32),
            S((s,), jnp.int32), S((s + 1,), jnp.int32), S((), jnp.int32)]
    for platform, fn in [("cuda", kernels.ragged_paged_attention_gpu),
                         ("tpu", kernels.ragged_paged_attention_tpu)]:
        exp = export.export(jax.jit(functools.partial(fn, interpret=False)), platforms=[platform],
                            disabled_checks=_TRITON)(*args)
        text = exp.mlir_module()
        assert ("xla.gpu.triton" in text) if platform == "cuda" else ("tpu_custom_call" in text)


# ---------------------------------------------------------------------------------------------
# bad input at the Python boundary
# ---------------------------------------------------------------------------------------------


def test_bad_input_raises_value_error():
    q, k, v, bt, cl, qsl, n = ragged_case(0, [(12, 5), (3, 1)], block_size=8, num_heads=4,
                                          num_kv_heads=2, head_dim=64, dtype=jnp.float32,
                                          num_tokens=8, num_seats=3, max_blocks=2)
    call = functools.partial(ragged_paged_attention, variant="gpu")

    with pytest.raises(ValueError, match=r"q must be \[num_tokens >= 1"):
        call(q[0], k, v, bt, cl, qsl, n)
    with pytest.raises(ValueError, match=r"q must be \[num_tokens >= 1.*\(0, 4, 64\)"):
        call(q[:0], k, v, bt, cl, qsl, n)
    with pytest.raises(ValueError, match=r"head_dim.*\(8, 4, 32\).*k_pages"):
        call(q[..., :32], k, v, bt, cl, qsl, n)
    with pytest.raises(ValueError, match=r"num_kv_heads.*\(8, 3, 64\).*k_pages"):
        call(q[:, :3], k, v, bt, cl, qsl, n)
    with pytest.raises(ValueError, match=r"v_pages shape"):
        call(q, k, v[:1], bt, cl, qsl, n)
    with pytest.raises(ValueError, match=r"dtype"):
        call(q.astype(jnp.bfloat16), k, v, bt, cl, qsl, n)
    with pytest.raises(ValueError, match=r"block_tables must be int32.*float32\[3, 2\]"):
        call(q, k, v, bt.astype(jnp.float32), cl, qsl, n)
    with pytest.raises(ValueError, match=r"context_lens must be int32\[3\].*\[2\]"):
        call(q, k, v, bt, cl[:2], qsl, n)
    with pytest.raises(ValueError, match=r"query_start_loc must be int32\[4\].*int64"):
        call(q, k, v, bt, cl, np.asarray(qsl, np.int64), n)
    with pytest.raises(ValueError, match=r"num_seqs must be an integer scalar"):
        call(q, k, v, bt, cl, qsl, jnp.float32(2))
    with pytest.raises(ValueError, match=r"num_seqs must lie in \[0, 3\]"):
        call(q, k, v, bt, cl, qsl, 4)
    with pytest.raises(ValueError, match=r"query_start_loc.*<= 8.*\[0, 5, 9\]"):
        call(q, k, v, bt, cl, qsl.at[2].set(9), n)
    with pytest.raises(ValueError, match=r"context_lens.*>= .*\[5, 1\].*\[4, 3\]"):
        call(q, k, v, bt, cl.at[0].set(4), qsl, n)
    with pytest.raises(ValueError, match=r"block_tables of shape \(3, 1\).*8 tokens.*12"):
        call(q, k, v, bt[:, :1], cl, qsl, n)
    with pytest.raises(ValueError, match=r"block_q must be a power of two"):
        kernels.ragged_paged_attention_gpu(q, k, v, bt, cl, qsl, n, interpret=True, block_q=3)
    # Triton's limits apply only when compiling.
    with pytest.raises(ValueError, match=r"query tiles of >= 16 rows"):
        kernels.ragged_paged_attention_gpu(q, k, v, bt, cl, qsl, n, interpret=False, block_q=4)
    with pytest.raises(ValueError, match=r"tokens_per_step a power of two >= 16.*got 8"):
        kernels.ragged_paged_attention_gpu(q, k, v, bt, cl, qsl, n, interpret=False,
                                           tokens_per_step=8)
    with pytest.raises(ValueError, match=r"InterpretParams"):
        call(q, k, v, bt, cl, qsl, n, interpret=pltpu.InterpretParams())
