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


CANDIDATES = 256      # top-k and top-p thresholds are read off this many highest logits of a row
BLOCK = 256           # the inverse-CDF draw: block sums first, then one block's running sum


def kept(scaled: jax.Array, top_k: jax.Array, top_p: jax.Array, min_p: jax.Array) -> jax.Array:
    """Which tokens a row may draw, bool[S, V], from temperature-scaled logits: top-k (0 = all),
    then top-p over the top-k distribution (the smallest set of the most likely tokens whose mass
    reaches top_p, the token that crosses it included), then min-p (probability at least min_p x
    the most likely one's); the most likely token always.

    No sort of the vocabulary (a [32, 49152] argsort took ~330 ms on a 2-core CPU): each filter is
    a threshold on the logit, read off the row's CANDIDATES highest logits (`lax.top_k`); a row
    whose top-k or top-p set reaches past them finds its threshold by bisection over the whole
    row (40 halvings, to float32 resolution). Tokens tied at a threshold are kept together."""
    S, V = scaled.shape
    top = jnp.max(scaled, axis=-1)
    weights = jnp.exp(scaled - top[:, None])
    use_k = (top_k > 0) & (top_k < V)
    use_p = top_p < 1.0

    K = min(V, CANDIDATES)
    rows = jnp.arange(S)
    cand = jax.lax.cond(jnp.any(use_k | use_p), lambda: jax.lax.top_k(scaled, K)[0],
                        lambda: jnp.zeros((S, K), scaled.dtype))

    def bisect(fits):
        """The largest threshold t (to float32 resolution) with fits(t), row by row."""
        def halve(_, bounds):
            lo, hi = bounds
            mid = (lo + hi) / 2
            ok = fits(mid)
            return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

        return jax.lax.fori_loop(0, 40, halve, (jnp.min(scaled, axis=-1) - 1.0, top + 1.0))[0]

    # top-k: the k-th highest logit; past the candidates, the largest t with >= k tokens at or above it
    tau_k = jnp.where(use_k, cand[rows, jnp.clip(top_k - 1, 0, K - 1)], -jnp.inf)
    k_far = use_k & (top_k > K)
    tau_k = jax.lax.cond(jnp.any(k_far), lambda: jnp.where(
        k_far, bisect(lambda t: jnp.sum(scaled >= t[:, None], axis=-1) >= top_k), tau_k), lambda: tau_k)

    # top-p over the top-k distribution: the candidate whose mass crosses top_p, when one does
    in_k = jnp.where(scaled >= tau_k[:, None], weights, 0.0)
    z = jnp.sum(in_k, axis=-1)
    p = jnp.where(cand >= tau_k[:, None], jnp.exp(cand - top[:, None]), 0.0) / z[:, None]
    mass = jnp.cumsum(p, axis=-1)
    last = jnp.sum((mass - p < top_p[:, None]) & (p > 0), axis=-1) - 1
    tau_p = jnp.where(use_p, cand[rows, jnp.maximum(last, 0)], -jnp.inf)
    p_far = use_p & (mass[:, -1] < top_p)

    def p_beyond():
        # the tokens strictly above t hold less than top_p: every token at or above t is kept
        lo = bisect(lambda t: jnp.sum(jnp.where(scaled > t[:, None], in_k, 0.0), axis=-1) >= top_p * z)
        return jnp.where(p_far, jnp.nextafter(lo, jnp.inf), tau_p)

    tau_p = jax.lax.cond(jnp.any(p_far), p_beyond, lambda: tau_p)
    tau_min = jnp.where(min_p > 0, top + jnp.log(jnp.maximum(min_p, 1e-30)), -jnp.inf)
    tau = jnp.minimum(jnp.maximum(jnp.maximum(tau_k, tau_p), tau_min), top)
    return scaled >= tau[:, None]


def _draw(weights: jax.Array, u: jax.Array) -> jax.Array:
    """Inverse-CDF draw per row from unnormalised weights f32[S, V] >= 0 (some > 0) and uniforms
    u f32[S] in [0, 1): the first index whose running sum exceeds u x the total. Two levels (block
    sums, then one block), so no running sum over the whole vocabulary is built."""
    S, V = weights.shape
    nb = -(-V // BLOCK)
    blocks = jnp.pad(weights, ((0, 0), (0, nb * BLOCK - V))).reshape(S, nb, BLOCK)
    ends = jnp.cumsum(jnp.sum(blocks, axis=-1), axis=-1)
    target = u * ends[:, -1]
    b = jnp.minimum(jnp.sum(ends <= target[:, None], axis=-1), nb - 1)
    # never past the first block at which the total is reached (rounding could put the target there)
    b = jnp.minimum(b, _argmax((ends >= ends[:, -1:]).astype(jnp.int32)))
    start = jnp.where(b > 0, jnp.take_along_axis(ends, jnp.maximum(b - 1, 0)[:, None], axis=-1)[:, 0], 0.0)
    inner = jnp.take_along_axis(blocks, b[:, None, None], axis=1)[:, 0]
    run = start[:, None] + jnp.cumsum(inner, axis=-1)
    i = jnp.sum(run <= target[:, None], axis=-1)
    last = BLOCK - 1 - _argmax(jnp.flip(inner > 0, -1).astype(jnp.int32))   # nor past its last weighted token
    return (b * BLOCK + jnp.minimum(i, last)).astype(jnp.int32)


def _sample_random(logits, temperature, top_k, top_p, min_p, seeds, positions):
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    scaled = logits / t
    keep = kept(scaled, top_k, top_p, min_p)
    weights = jnp.where(keep, jnp.exp(scaled - jnp.max(scaled, axis=-1, keepdims=True)), 0.0)
    u = jax.vmap(lambda k: jax.random.uniform(k, ()))(_row_keys(seeds, positions))
    return _draw(weights, u)


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


def finite_greedy(logits: jax.Array, *, native_kernel: bool = False):
    """The step's choice from its logits f32[S, V]: (safe, finite, `greedy(safe)`), where a row
    with any non-finite logit is zeroed in `safe` (`finite` False: the engine ends that request
    with an error). native_kernel: the same from pagedjax.native.greedy, one pass per row on a
    CPU (`safe`, `finite` and the token exactly; the logprob and logsumexp summed in double, so
    within float32 rounding of exact where XLA's float32 sums drift ~1e-5), where XLA's fusions
    over the whole [S, V] cost a step ~4 ms at [32, 49152] on 2 cores."""
    if native_kernel:
        from pagedjax import native

        safe, tokens, logprob, lse, finite = native.greedy(logits)
        S = logits.shape[0]
        return safe, finite, (tokens, logprob, lse, jnp.zeros((S, 0), jnp.int32), jnp.zeros((S, 0), jnp.float32))
    finite = jnp.all(jnp.isfinite(logits), axis=-1)
    safe = jnp.where(finite[:, None], logits, 0.0)
    return safe, finite, greedy(safe)


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
