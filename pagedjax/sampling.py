"""On-device sampling: greedy, temperature, top-k, top-p, min-p, per-request seeds.

Every row carries its own parameters and seed, and the random key of a row is
fold_in(key(seed), position of the token being sampled): a request's samples depend only on
its own seed and tokens, never on who shares its batch, and a request preempted and
recomputed samples exactly what it would have.

Log-probabilities are those of the model's distribution (log_softmax of the raw logits,
before temperature and truncation), as vLLM returns them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.sampling_params import SamplingParams

__all__ = ["SamplingParams", "sample"]


def _row_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    def one(seed, pos):
        key = jax.random.fold_in(jax.random.key(seed[0]), seed[1])
        return jax.random.fold_in(key, pos)

    return jax.vmap(one)(seeds, positions)


def _sample_random(logits, temperature, top_k, top_p, min_p, seeds, positions):
    V = logits.shape[-1]
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    # one descending sort serves top-k, top-p and min-p
    order = jnp.argsort(-scaled, axis=-1)
    sorted_logits = jnp.take_along_axis(scaled, order, axis=-1)
    rank = jnp.arange(V)[None, :]
    keep = jnp.where(top_k[:, None] > 0, rank < top_k[:, None], True)
    probs = jax.nn.softmax(jnp.where(keep, sorted_logits, -jnp.inf), axis=-1)
    # top-p: keep the smallest prefix whose mass reaches top_p (the token crossing it included)
    mass_before = jnp.cumsum(probs, axis=-1) - probs
    keep &= mass_before < top_p[:, None]
    keep &= probs >= min_p[:, None] * probs[:, :1]
    keep = keep.at[:, 0].set(True)
    masked = jnp.where(keep, sorted_logits, -jnp.inf)
    u = jax.vmap(lambda k: jax.random.uniform(k, (V,), minval=1e-20, maxval=1.0))(_row_keys(seeds, positions))
    gumbel = -jnp.log(-jnp.log(u))
    choice = _argmax(masked + gumbel)   # row 0 of `keep` is always kept: a finite max
    return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0]


def _argmax(logits: jax.Array) -> jax.Array:
    """jnp.argmax over the last axis (the first index of the maximum) of finite logits, as a max
    and a min over indices: two reductions XLA vectorises on a CPU, where its variadic argmax
    reduction is not (0.9 vs 3.6 ms for [32, 49152] on the 2-core CPU)."""
    V = logits.shape[-1]
    m = jnp.max(logits, axis=-1, keepdims=True)
    return jnp.min(jnp.where(logits == m, jnp.arange(V, dtype=jnp.int32), V), axis=-1)


def greedy(logits: jax.Array, num_logprobs: int = 0):
    """The greedy token of every row and the log-probabilities the step returns: logits f32[S, V]
    (finite). Returns (token int32[S], its logprob f32[S], logsumexp f32[S], top ids
    int32[S, num_logprobs], top logprobs f32[S, num_logprobs]). The whole [S, V] log_softmax is
    only built when top logprobs are asked for."""
    tokens = _argmax(logits)
    m = jnp.max(logits, axis=-1, keepdims=True)
    lse = m + jnp.log(jnp.sum(jnp.exp(logits - m), axis=-1, keepdims=True))
    token_logprob = jnp.take_along_axis(logits, tokens[:, None], axis=-1)[:, 0] - lse[:, 0]
    if num_logprobs:
        top_lp, top_ids = jax.lax.top_k(logits - lse, num_logprobs)
    else:
        top_lp = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return tokens, token_logprob, lse[:, 0], top_ids.astype(jnp.int32), top_lp


def resample(logits: jax.Array, lse: jax.Array, greedy_tokens: jax.Array, temperature: jax.Array,
             top_k: jax.Array, top_p: jax.Array, min_p: jax.Array, seeds: jax.Array, positions: jax.Array):
    """Rows with temperature > 0 sampled (top-k, top-p, min-p, seeded), the others keep their
    greedy token; returns (token int32[S], its logprob f32[S] from `greedy`'s logsumexp, its rank
    int32[S]: 1 + the tokens with a higher logit)."""
    drawn = _sample_random(logits, temperature, top_k, top_p, min_p, seeds, positions)
    tokens = jnp.where(temperature == 0, greedy_tokens, drawn).astype(jnp.int32)
    return (tokens,) + logprob_and_rank(logits, lse, tokens)


def sample_processed(logits: jax.Array, raw: jax.Array, lse: jax.Array, temperature: jax.Array, top_k: jax.Array,
                     top_p: jax.Array, min_p: jax.Array, seeds: jax.Array, positions: jax.Array, *, random: bool):
    """Tokens chosen from processed logits (pagedjax.logits_processors; -inf where banned), their
    logprob and rank from the model's raw logits and logsumexp. A row whose processors banned every
    token chooses from its raw logits. random=False: every row is greedy (nothing drawn)."""
    allowed = jnp.any(logits > -jnp.inf, axis=-1, keepdims=True)
    logits = jnp.where(allowed, logits, raw)
    tokens = _argmax(logits)
    if random:
        drawn = _sample_random(logits, temperature, top_k, top_p, min_p, seeds, positions)
        tokens = jnp.where(temperature == 0, tokens, drawn)
    tokens = tokens.astype(jnp.int32)
    return (tokens,) + logprob_and_rank(raw, lse, tokens)


def logprob_and_rank(logits: jax.Array, lse: jax.Array, tokens: jax.Array):
    """(logprob f32[S], rank int32[S]) of each row's token: logit - logsumexp, and 1 + the tokens
    with a higher logit."""
    chosen = jnp.take_along_axis(logits, tokens[:, None], axis=-1)
    rank = 1 + jnp.sum(logits > chosen, axis=-1).astype(jnp.int32)
    return chosen[:, 0] - lse, rank


def sample(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array,
           seeds: jax.Array, positions: jax.Array, num_logprobs: int = 0):
    """`greedy`, then `resample` unless every row is greedy, in one function. logits f32[S, V];
    per-row temperature (0 = greedy), top_k (0 = off), top_p, min_p, seeds uint32[S, 2],
    positions int32[S]. Returns (token int32[S], logprob f32[S], top ids int32[S, num_logprobs],
    top logprobs f32[S, num_logprobs]).

    The engine does not call this: under one jit, XLA on a CPU moves part of the random branch
    out of the `lax.cond` and every step pays ~5 ms at [32, 49152] even when no row samples.
    The runner instead runs `greedy` in the step and `resample` as a second jitted call, only
    when the host sees a row with temperature > 0."""
    tokens, logprob, lse, top_ids, top_lps = greedy(logits, num_logprobs)
    tokens, logprob, _ = jax.lax.cond(
        jnp.all(temperature == 0), lambda: (tokens, logprob, jnp.ones_like(tokens)),
        lambda: resample(logits, lse, tokens, temperature, top_k, top_p, min_p, seeds, positions))
    return tokens, logprob, top_ids, top_lps
