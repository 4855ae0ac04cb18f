"""The native CPU matmul (pagedjax/native/matmul.cc) and the step layout that uses it.

Products against float64 at shapes that reach every block size of x (1 to 12 rows, and row
counts that split into uneven blocks), depths on and off its 64-input runs, and output counts
that are not a multiple of a panel (zero-padded, then dropped); each row's result bitwise the
same whatever rows share the call; the panels' round trip; the packed forms (4-bit, 8-bit and
bfloat16 records of weights exactly of those forms) giving the float32 panels' result bit for
bit, and a weight one value off its form staying float32; the AVX2 build (what CPUs without
AVX-512 run) giving the same bits as this CPU's own; and the engine's weights in that
layout: held where the kernel runs, given back in the model's layout, replaced without a
compilation."""

from __future__ import annotations

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import require_native_matmul
from pagedjax import native
from pagedjax.model.llama import init_random_params, unstack_layers
from pagedjax.model.step_weights import from_step_layout, to_step_layout


@pytest.fixture(autouse=True)
def _needs_kernel():
    require_native_matmul()


@jax.jit
def product(x, w):
    return x @ w


@pytest.mark.parametrize("T,K,N", [(1, 64, 32), (5, 65, 70), (12, 576, 192), (13, 1, 32), (32, 576, 1536),
                                   (37, 1536, 576), (300, 130, 96)])
def test_matmul_matches_float64(T, K, N):
    rng = np.random.default_rng(T * K + N)
    x = rng.standard_normal((T, K)).astype(np.float32)
    w = rng.standard_normal((N, K)).astype(np.float32)
    y = np.asarray(product(x, native.Panels.from_out_in(jnp.asarray(w))))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert y.shape == (T, N) and y.dtype == np.float32
    # float32 sums of K products: within a few units of float32 rounding of the largest output
    assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()


def test_a_rows_result_does_not_depend_on_the_rows_beside_it():
    rng = np.random.default_rng(0)
    w = native.Panels.from_out_in(jnp.asarray(rng.standard_normal((96, 200)).astype(np.float32)))
    x = rng.standard_normal((40, 200)).astype(np.float32)
    whole = np.asarray(product(x, w))
    for rows in ([0], [7, 8, 9], list(range(13)), list(range(39, 17, -1))):
        part = np.asarray(product(x[rows], w))
        np.testing.assert_array_equal(part, whole[rows])
    # and with other rows around it
    other = np.concatenate([rng.standard_normal((5, 200)).astype(np.float32), x[3:4]])
    np.testing.assert_array_equal(np.asarray(product(other, w))[-1], whole[3])


def test_panels_round_trip_and_travel_through_jit():
    w = jnp.asarray(np.random.default_rng(1).standard_normal((70, 48)).astype(np.float32))
    p = native.Panels.from_out_in(w)
    assert p.panels.shape == (3, 48, 32) and p.n == 70
    np.testing.assert_array_equal(p.to_out_in(), w)
    leaves, treedef = jax.tree.flatten(p)
    assert len(leaves) == 1 and jax.tree.unflatten(treedef, leaves).n == 70


@pytest.mark.parametrize("tied", [True, False])
def test_step_layout_gives_the_models_weights_back_exactly(tied):
    from pagedjax.model.llama import ModelConfig

    cfg = ModelConfig(vocab_size=80, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                      max_position_embeddings=64, tie_word_embeddings=tied)
    params = init_random_params(cfg, jax.random.key(0))
    held = to_step_layout(params, unstacked=True, panels=True)
    assert isinstance(held["layers"][0]["q_proj"], native.Panels) and isinstance(held["head"], native.Panels)
    assert held["layers"][0]["input_layernorm"].shape == (64,)   # vectors stay as they are
    back = from_step_layout(held)
    assert jax.tree.structure(back) == jax.tree.structure(params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)
    # unstacked alone (no panels) round-trips too
    for a, b in zip(jax.tree.leaves(from_step_layout(unstack_layers(params))), jax.tree.leaves(params)):
        np.testing.assert_array_equal(a, b)


def test_the_engine_holds_panels_gives_the_model_back_and_updates_without_compiling():
    from pagedjax import LLM, SamplingParams

    llm = LLM("tiny-random", attention_backend="native", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=32, num_blocks=64)
    eng = llm.llm_engine
    assert eng.runner.weights.layout == {"unstacked": True, "panels": True}
    assert isinstance(eng.runner.step_params["layers"][0]["down_proj"], native.Panels)
    params = eng.params
    assert isinstance(params["layers"], dict) and "head" not in params
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    before = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], sp, use_tqdm=False)]
    n = eng.num_compilations
    eng.update_weights(jax.tree.map(lambda w: w * 1.0, params))
    after = [o.outputs[0].token_ids for o in llm.generate(["a b c", "d e"], sp, use_tqdm=False)]
    assert after == before and eng.num_compilations == n


def exactly_of_form(kind, n, k, rng):
    """A float32 [n, k] weight whose every value is exactly of a packed form: "q4", a half-precision
    scale and minimum per 32 inputs of an output and 4-bit integers (GGUF Q4_1's dequantized
    values); "q8", a scale times integers in -127..127 (Q8_0); "bf16"."""
    if kind == "bf16":
        return np.asarray(jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16), np.float32)
    half = lambda a: a.astype(np.float16).astype(np.float32)  # noqa: E731
    scale = half(rng.uniform(1e-3, 2e-2, (n, k // 32, 1)))
    if kind == "q4":
        q = rng.integers(0, 16, (n, k // 32, 32)).astype(np.float32)
        q[..., 0], q[..., 1] = 0, 15                         # as a quantizer leaves them: min 0, max 15
        w = scale * q + half(rng.uniform(-0.2, 0.0, (n, k // 32, 1)))
    else:
        q = rng.integers(-127, 128, (n, k // 32, 32)).astype(np.float32)
        q[..., 0] = 127
        w = scale * q
    return w.astype(np.float32).reshape(n, k)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


@pytest.mark.parametrize("kind,record", [("q4", 768), ("q8", 1152), ("bf16", 2048)])
@pytest.mark.parametrize("T,K,N", [(1, 32, 32), (13, 96, 70), (40, 576, 192)])
def test_packed_forms_give_the_float32_panels_result_bit_for_bit(kind, record, T, K, N):
    rng = np.random.default_rng(T + K + N)
    w = exactly_of_form(kind, N, K, rng)
    packed, plain = native.Panels.from_out_in(w, pack=True), native.Panels.from_out_in(w, pack=False)
    assert packed.kind == kind and plain.kind == "f32"
    assert packed.panels.shape == (-(-N // 32), K // 32, record) and packed.panels.dtype == np.uint8
    assert packed.nbytes == plain.nbytes * record // 4096
    np.testing.assert_array_equal(bits(packed.to_out_in()), bits(w))
    x = rng.standard_normal((T, K)).astype(np.float32)
    y = np.asarray(product(x, packed))
    np.testing.assert_array_equal(bits(y), bits(product(x, plain)))
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()
    # the form travels through jit as static data
    leaves, treedef = jax.tree.flatten(packed)
    assert len(leaves) == 1 and jax.tree.unflatten(treedef, leaves).kind == kind


@pytest.mark.parametrize("kind", ["f32", "q4", "q8", "bf16"])
def test_the_avx2_build_gives_the_same_bits(kind):
    """CPUs without AVX-512 take 8-wide loops (blocks of up to 6 rows times half a panel, the whole
    panel for one or two rows); every output is the same chain of fused multiply-adds, so the build
    with -mno-avx512f gives this CPU's own build's result bit for bit, at every block size."""
    if not {"avx2", "fma"} <= native.cpu_flags():
        pytest.skip("the AVX2 path needs a CPU with AVX2 and FMA")
    target = native.register_matmul_build(("-mno-avx512f",))
    rng = np.random.default_rng(11)
    K, N = 160, 96
    w = rng.standard_normal((N, K)).astype(np.float32) if kind == "f32" else exactly_of_form(kind, N, K, rng)
    p = native.Panels.from_out_in(w, pack=kind != "f32")
    assert p.kind == kind
    ref_w = w.T.astype(np.float64)
    for T in (1, 2, 3, 7, 8, 13, 32, 37):
        x = rng.standard_normal((T, K)).astype(np.float32)
        y = np.asarray(jax.jit(lambda x, w: native.matmul(x, w, kind, target=target))(x, p.panels))
        np.testing.assert_array_equal(bits(y), bits(product(x, p)))
        ref = x.astype(np.float64) @ ref_w
        assert np.abs(y - ref).max() <= 1e-6 * np.abs(ref).max()


def test_a_weight_one_value_off_its_form_stays_float32():
    rng = np.random.default_rng(3)
    w = exactly_of_form("q4", 64, 64, rng)
    w[5, 17] = np.nextafter(w[5, 17], np.float32(1))
    p = native.Panels.from_out_in(w, pack=True)
    assert p.kind == "f32"
    np.testing.assert_array_equal(bits(p.to_out_in()), bits(w))
    # a negative zero is not the positive zero an 8-bit form would give back
    w = exactly_of_form("q8", 32, 32, rng)
    w[3, 4] = -0.0
    np.testing.assert_array_equal(bits(native.Panels.from_out_in(w, pack=True).to_out_in()), bits(w))
    # nor is a non-finite value of any form; inputs not a multiple of 32 are never packed
    w = exactly_of_form("bf16", 32, 64, rng)
    w[0, 0] = np.nan
    assert native.Panels.from_out_in(w, pack=True).kind == "bf16"    # NaN is a bfloat16 too
    w[0, 0] = 1 + 2.0 ** -20                                         # a float32 with more bits is not
    assert native.Panels.from_out_in(w, pack=True).kind == "f32"
    assert native.Panels.from_out_in(exactly_of_form("bf16", 32, 48, rng), pack=True).kind == "f32"


def test_packed_panels_of_the_wrong_size_are_refused():
    x = jnp.ones((2, 64), jnp.float32)
    bad = jnp.zeros((1, 2, 700), jnp.uint8)
    with pytest.raises(Exception, match="packed panels"):
        jax.block_until_ready(native.matmul(x, bad, "q4"))


def test_f32_panels_kept_by_the_environment():
    code = ("import numpy as np; from pagedjax import native; "
            "w = np.zeros((32, 32), np.float32); print(native.packing_enabled(), native.Panels.from_out_in(w).kind)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PAGEDJAX_NATIVE_MATMUL": "f32"}).stdout
    assert out.split() == ["False", "f32"]


def test_weights_updated_into_another_form_compile_once_and_give_the_float32_panels_tokens(monkeypatch):
    from pagedjax import LLM, SamplingParams

    kw = dict(attention_backend="native", max_model_len=64, max_num_seqs=4, max_num_batched_tokens=32, num_blocks=64)
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["a b c", "d e"]
    packed, plain = LLM("tiny-random", **kw), LLM("tiny-random", **kw)
    as_bf16 = jax.tree.map(lambda w: w.astype(jnp.bfloat16).astype(jnp.float32), packed.llm_engine.params)
    n = packed.llm_engine.num_compilations
    packed.llm_engine.update_weights(as_bf16)    # random float32 weights -> every projection bfloat16
    assert packed.llm_engine.runner.step_params["layers"][0]["q_proj"].kind == "bf16"
    got = [o.outputs[0].token_ids for o in packed.generate(prompts, sp, use_tqdm=False)]
    assert packed.llm_engine.num_compilations > n   # the step compiled again for the new form
    monkeypatch.setenv("PAGEDJAX_NATIVE_MATMUL", "f32")
    plain.llm_engine.update_weights(as_bf16)
    assert plain.llm_engine.runner.step_params["layers"][0]["q_proj"].kind == "f32"
    assert [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)] == got


def test_turned_off_by_the_environment():
    code = "from pagedjax import native; print(native.matmul_available(), native.matmul_unavailable_reason())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PAGEDJAX_NATIVE_MATMUL": "0"}).stdout
    assert out.startswith("False turned off by PAGEDJAX_NATIVE_MATMUL=0")
