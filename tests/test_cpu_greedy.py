"""The native CPU greedy choice (pagedjax/native/greedy.cc) against the XLA ops it replaces.

Rows with ties (the first index wins), with NaN, +inf and -inf (zeroed, reported not finite,
token 0 and logprob -log V, as the XLA path gives), a maximum at the first and the last index,
one row, one-token vocabularies, and vocabularies that are not a multiple of a vector: the token
and the zeroed logits bit for bit, the logprob and logsumexp within float32 rounding of the exact
values (float64) and near XLA's, whose float32 sums drift further. Then
the engine: the native path's step picks it, and the engine's greedy tokens and logprobs agree
with the XLA choice in the same step."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from helpers import require_native
from pagedjax import native
from pagedjax.sampling import finite_greedy


@pytest.fixture(autouse=True)
def _needs_kernel():
    require_native()
    if not native.greedy_available():
        pytest.fail(f"the native greedy kernel did not build: {native.greedy_unavailable_reason()}")


@functools.partial(jax.jit, static_argnames=("native_kernel",))
def choose(logits, native_kernel):
    safe, finite, (tokens, logprob, lse, top_ids, top_lps) = finite_greedy(logits * 1, native_kernel=native_kernel)
    return safe, finite, tokens, logprob, lse, top_ids, top_lps


def logits_with_edge_rows(S, V, seed):
    x = np.random.default_rng(seed).standard_normal((S, V)).astype(np.float32) * 4
    edits = {0: ("tie", None), 1: ("nan", np.nan), 2: ("inf", np.inf), 3: ("-inf", -np.inf), 4: ("first", None),
             5: ("last", None)}
    for row, (kind, value) in edits.items():
        if row >= S:
            continue
        if kind == "tie":
            x[row, [V // 3, V // 2, V - 1]] = 100.0
        elif kind == "first":
            x[row, 0] = 100.0
        elif kind == "last":
            x[row, -1] = 100.0
        else:
            x[row, V // 2] = value
    return x


@pytest.mark.parametrize("S,V", [(8, 49152), (7, 1000), (1, 17), (6, 1), (33, 130)])
def test_native_greedy_matches_the_xla_choice(S, V):
    x = jnp.asarray(logits_with_edge_rows(S, V, S * V))
    want = [np.asarray(a) for a in choose(x, False)]
    got = [np.asarray(a) for a in choose(x, True)]
    for name, w, g in zip(["safe", "finite", "tokens", "logprob", "lse", "top_ids", "top_lps"], want, got):
        assert w.shape == g.shape and w.dtype == g.dtype, name
        if name in ("logprob", "lse"):   # XLA's float32 sums drift; the kernel's are within rounding
            np.testing.assert_allclose(g, w, rtol=3e-5, atol=3e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(g, w, err_msg=name)
    finite = got[1]
    safe = want[0].astype(np.float64)
    exact_lse = safe.max(-1) + np.log(np.exp(safe - safe.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(got[4], exact_lse, rtol=3e-7, atol=1e-6)
    np.testing.assert_allclose(got[3], safe.max(-1) - exact_lse, rtol=3e-7, atol=1e-6)
    if V > 1:
        assert not finite[[r for r in (1, 2, 3) if r < S]].any()
        if S > 0:
            assert got[2][0] == (V // 3 if V > 2 else 0)     # ties: the first index
    for r in np.flatnonzero(~finite):
        assert got[2][r] == 0 and np.all(got[0][r] == 0)
        np.testing.assert_allclose(got[3][r], -np.log(V), rtol=1e-6)


def test_the_native_path_step_chooses_natively_and_agrees_with_xla():
    """The step the native backend runs takes the kernel; on a model's logits (random weights,
    one row's logits made non-finite by a hook) its results equal the XLA choice's in the same
    step: tokens, finiteness and the logits it keeps bit for bit, logprobs to rounding."""
    from pagedjax.attention import init_kv_cache
    from pagedjax.model.llama import ModelConfig, init_random_params
    from pagedjax.model.step_weights import StepWeights
    from pagedjax.runner import make_step
    from pagedjax.scheduler.batch import StepInput

    cfg = ModelConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                      num_kv_heads=2, head_dim=16)
    params = StepWeights(init_random_params(cfg, jax.random.key(0)), unstacked=True).arrays
    poison = lambda logits, step: logits.at[3, 5].set(jnp.nan)  # noqa: E731
    step = make_step(cfg, backend="native", logits_hook=poison)
    assert step.keywords["native_greedy"]
    xla_step = functools.partial(step.func, **{**step.keywords, "native_greedy": False})
    inputs = StepInput.padding(16, 8, 4)
    inputs.token_ids[:] = np.arange(16) * 37 % 1000
    inputs.logits_indices[:] = np.arange(8) * 2
    results = [fn(params, init_kv_cache(cfg, 8, 16, jnp.float32), inputs) for fn in (step, xla_step)]
    (tokens, logprob, _, _, _, finite), (safe, lse) = [jax.tree.map(np.asarray, r[:2]) for r in results][0]
    (want_tokens, want_logprob, _, _, _, want_finite), (want_safe, want_lse) = \
        [jax.tree.map(np.asarray, r[:2]) for r in results][1]
    np.testing.assert_array_equal(tokens, want_tokens)
    np.testing.assert_array_equal(finite, want_finite)
    assert not finite[3] and finite.sum() == 7
    np.testing.assert_array_equal(safe, want_safe)
    np.testing.assert_allclose(logprob, want_logprob, rtol=3e-5, atol=3e-5)
    np.testing.assert_allclose(lse, want_lse, rtol=3e-5, atol=3e-5)
