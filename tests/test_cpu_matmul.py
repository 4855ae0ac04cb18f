"""The native CPU matmul (pagedjax/native/matmul.cc) and the step layout that uses it.

Products against float64 at shapes that reach every block size of x (1 to 12 rows, and row
counts that split into uneven blocks), depths on and off its 64-input runs, and output counts
that are not a multiple of a panel (zero-padded, then dropped); each row's result bitwise the
same whatever rows share the call; the panels' round trip; and the engine's weights in that
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


def test_turned_off_by_the_environment():
    code = "from pagedjax import native; print(native.matmul_available(), native.matmul_unavailable_reason())"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PAGEDJAX_NATIVE_MATMUL": "0"}).stdout
    assert out.startswith("False turned off by PAGEDJAX_NATIVE_MATMUL=0")
