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


def kept_by_sorting(scaled, top_k, top_p, min_p):
    """The filters as their definitions read, with a sort (numpy, float64 cumulative mass)."""
    S, V = scaled.shape
    out = np.zeros((S, V), bool)
    for r in range(S):
        order = np.argsort(-scaled[r], kind="stable")
        x = scaled[r, order].astype(np.float64)
        keep = np.ones(V, bool) if top_k[r] <= 0 else np.arange(V) < top_k[r]
        p = np.where(keep, np.exp(x - x[0]), 0.0)
        p /= p.sum()
        keep &= np.cumsum(p) - p < top_p[r]
        keep &= p >= min_p[r] * p[0]
        keep[0] = True
        out[r, order[keep]] = True
    return out


def test_filters_keep_what_their_definitions_keep():
    """top-k, top-p over the top-k distribution, min-p: the thresholds read off the candidates
    and, past them, found by bisection keep exactly the tokens a sort keeps."""
    from pagedjax.sampling import CANDIDATES, kept

    rng = np.random.default_rng(3)
    S, V = 12, 3000
    scaled = (rng.standard_normal((S, V)) * rng.uniform(0.3, 6, (S, 1))).astype(np.float32)
    top_k = np.array([0, 1, 5, 40, CANDIDATES, CANDIDATES + 1, 1000, 0, 0, 0, 20, V], np.int32)
    top_p = np.array([1, 1, 0.9, 0.5, 1, 1, 0.95, 0.99, 0.3, 1, 0.8, 0.999], np.float32)  # 0.99 on a flat row: bisection
    min_p = np.array([0, 0, 0, 0, 0, 0, 0, 0, 0.1, 0.05, 0.2, 0], np.float32)
    got = np.asarray(kept(jnp.asarray(scaled), jnp.asarray(top_k), jnp.asarray(top_p), jnp.asarray(min_p)))
    want = kept_by_sorting(scaled, top_k, top_p, min_p)
    assert (want.sum(-1) > CANDIDATES).any()  # some rows reach past the candidates
    np.testing.assert_array_equal(got.sum(-1), want.sum(-1))
    np.testing.assert_array_equal(got, want)


def test_draws_follow_the_filtered_distribution():
    """20,000 seeded draws from one row: every token drawn is kept, and the frequencies match the
    renormalised kept probabilities (total variation within 1.5x what exact draws give on average)."""
    from pagedjax.sampling import _sample_random

    rng = np.random.default_rng(4)
    V, N = 700, 20000
    logits = np.tile(rng.standard_normal(V).astype(np.float32) * 2, (N, 1))
    for top_k, top_p, min_p in ((0, 1.0, 0.0), (30, 0.9, 0.0), (0, 0.8, 0.02)):
        args = [jnp.full(N, x, dt) for x, dt in ((0.7, jnp.float32), (top_k, jnp.int32), (top_p, jnp.float32),
                                                   (min_p, jnp.float32))]
        seeds = jnp.stack([jnp.arange(N, dtype=jnp.uint32), jnp.zeros(N, jnp.uint32)], -1)
        tokens = np.asarray(_sample_random(jnp.asarray(logits), *args, seeds, jnp.zeros(N, jnp.int32)))
        scaled = logits[:1] / 0.7
        keep = kept_by_sorting(scaled, [top_k], [top_p], [min_p])[0]
        assert keep[tokens].all()
        p = np.where(keep, np.exp(scaled[0] - scaled[0].max()), 0.0)
        p /= p.sum()
        freq = np.bincount(tokens, minlength=V) / N
        expected = 0.5 * np.sqrt(2 / np.pi) * np.sum(np.sqrt(p * (1 - p) / N))   # TV of exact draws, on average
        assert 0.5 * np.abs(freq - p).sum() < 1.5 * expected + 0.002, (top_k, top_p, min_p, expected)
        # the same seeds draw the same tokens
        np.testing.assert_array_equal(
            np.asarray(_sample_random(jnp.asarray(logits), *args, seeds, jnp.zeros(N, jnp.int32))), tokens)
