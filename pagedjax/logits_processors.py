"""vLLM's logits processors on the device, for a step's rows at once (inputs: see
pagedjax.scheduler.logits_inputs).

In vLLM's order: the bias row (allowed_token_ids, bad_words, min_tokens bans and logit_bias, all
folded into one additive f32[S, V] by the host), then the penalties as vLLM defines them:

    repetition  a token of the prompt or the output so far: logit / p if logit > 0, else logit * p
    frequency   logit -= f * (times the token appears in the output so far)
    presence    logit -= p * (1 if it appears in the output so far)

Log-probabilities are not taken from these logits: the engine returns the model's own (raw)
log-probabilities, as vLLM does by default.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pagedjax.scheduler.logits_inputs import LogitsInputs


def apply_logits_processors(logits: jax.Array, li: LogitsInputs) -> jax.Array:
    """logits f32[S, V] -> the processed logits f32[S, V]."""
    S, V = logits.shape
    L = li.token_ids.shape[1]
    pos = jnp.arange(L, dtype=jnp.int32)[None, :]
    seen = pos < li.lens[:, None]
    in_output = seen & (pos >= li.prompt_lens[:, None])
    rows = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[:, None], (S, L))
    ids = jnp.where(seen, li.token_ids, V)    # V: out of range, dropped by the scatters
    output_counts = jnp.zeros((S, V), jnp.float32).at[rows, ids].add(in_output.astype(jnp.float32), mode="drop")
    occurs = jnp.zeros((S, V), jnp.bool_).at[rows, ids].set(True, mode="drop")

    logits = logits + li.bias
    rep = jnp.where(occurs, li.repetition_penalty[:, None], 1.0)
    logits = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = logits - li.frequency_penalty[:, None] * output_counts
    return logits - li.presence_penalty[:, None] * (output_counts > 0)
