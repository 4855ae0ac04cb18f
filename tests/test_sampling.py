"""The on-device sampler's pieces: the greedy path the step runs every time, and the resampling
the runner adds only when a row samples (pagedjax/sampling.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.sampling import _argmax, greedy, resample, sample


def test_argmax_is_the_first_index_of_the_maximum():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, 1000)).astype(np.float32)
    x[1, [3, 700]] = 9.0          # a tie: the first index wins, as with jnp.argmax
    x[2, :] = 0.0                 # all equal
    x[3, -1] = 50.0               # the last column
    x[4, :] = -np.inf
    x[4, 17] = -1.0               # -inf elsewhere (masked rows of the random path)
    np.testing.assert_array_equal(np.asarray(_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))


def test_greedy_logprobs_are_log_softmax():
    logits = jax.random.normal(jax.random.key(1), (5, 300)) * 4
    tokens, logprob, lse, top_ids, top_lps = greedy(logits, num_logprobs=3)
    logp = jax.nn.log_softmax(logits, axis=-1)
    np.testing.assert_array_equal(tokens, jnp.argmax(logits, -1))
    np.testing.assert_allclose(logprob, logp[jnp.arange(5), tokens], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, jax.nn.logsumexp(logits, -1), rtol=1e-6)
    want_lp, want_ids = jax.lax.top_k(logp, 3)
    np.testing.assert_array_equal(top_ids, want_ids)
    np.testing.assert_allclose(top_lps, want_lp, rtol=1e-6, atol=1e-6)


def test_resample_keeps_greedy_rows_and_draws_within_top_k():
    S, V = 8, 200
    logits = jax.random.normal(jax.random.key(2), (S, V)) * 3
    temperature = jnp.asarray([0, 1.0, 0, 0.7, 1.5, 0, 1.0, 1.0], jnp.float32)
    top_k = jnp.asarray([0, 5, 0, 1, 3, 0, 0, 2], jnp.int32)
    args = (temperature, top_k, jnp.ones(S), jnp.zeros(S), jnp.arange(2 * S, dtype=jnp.uint32).reshape(S, 2),
            jnp.arange(S, dtype=jnp.int32))
    g, _, lse, _, _ = greedy(logits)
    tokens, logprob, rank = resample(logits, lse, g, *args)
    tokens, logprob = np.asarray(tokens), np.asarray(logprob)
    ranks = np.argsort(np.argsort(-np.asarray(logits), axis=-1), axis=-1)[np.arange(S), tokens]
    np.testing.assert_array_equal(rank, ranks + 1)  # vLLM's rank: 1 + the tokens more likely
    for i in range(S):
        if temperature[i] == 0:
            assert tokens[i] == int(g[i])
        elif int(top_k[i]) > 0:
            assert ranks[i] < int(top_k[i]), (i, ranks[i])
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    np.testing.assert_allclose(logprob, logp[np.arange(S), tokens], rtol=1e-5, atol=1e-5)
    # the one-call version gives the same, and the all-greedy case skips the draw
    both = sample(logits, *args)
    np.testing.assert_array_equal(both[0], tokens)
    np.testing.assert_allclose(both[1], logprob, rtol=1e-6)
    only_greedy = sample(logits, jnp.zeros(S), *args[1:])
    np.testing.assert_array_equal(only_greedy[0], g)
