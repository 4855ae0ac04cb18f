"""The engine's model on the training side: log-probabilities of whole completions under the
current params, differentiable, for policy-gradient updates (see scripts/grpo_toy.py).

    logps, mask = completion_logprobs(params, cfg, prompts, completions)   # f32[B, L], bool[B, L]
    loss = -(advantages[:, None] * logps * mask).sum() / mask.sum()

The forward is `pagedjax.model.llama.causal_forward`: the same layers the engine runs, with dense
causal attention. Sequences are padded to a length bucket (powers of two from 16) and the batch to
a multiple of 8, so a training loop compiles once per bucket, not once per batch.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.llama import ModelConfig, causal_forward, compute_logits


@functools.partial(jax.jit, static_argnames=("cfg",))
def token_logprobs(params: Any, cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """log p(token_ids[:, t + 1] | token_ids[:, :t + 1]) for every t: f32[B, L - 1]."""
    hidden = causal_forward(params, cfg, token_ids)
    logits = compute_logits(params, cfg, hidden[:, :-1].reshape(-1, hidden.shape[-1]))
    logits = logits.reshape(token_ids.shape[0], token_ids.shape[1] - 1, -1)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, token_ids[:, 1:, None], axis=-1)[..., 0]


def length_bucket(n: int, smallest: int = 16) -> int:
    b = smallest
    while b < n:
        b *= 2
    return b


def pack(prompts: Sequence[Sequence[int]], completions: Sequence[Sequence[int]]):
    """(token_ids int32[B', L'], mask bool[B', L' - 1]): prompt + completion per row, padded to the
    length and batch buckets; mask[b, t] marks the logprob of completion token t + 1 of row b."""
    rows = [list(p) + list(c) for p, c in zip(prompts, completions)]
    L = length_bucket(max(len(r) for r in rows) + 1)
    B = -(-len(rows) // 8) * 8
    ids = np.zeros((B, L), np.int32)
    mask = np.zeros((B, L - 1), bool)
    for b, (p, c) in enumerate(zip(prompts, completions)):
        ids[b, :len(p) + len(c)] = list(p) + list(c)
        mask[b, len(p) - 1:len(p) - 1 + len(c)] = True
    return ids, mask


def completion_logprobs(params: Any, cfg: ModelConfig, prompts: Sequence[Sequence[int]],
                        completions: Sequence[Sequence[int]]):
    """Per-token log-probabilities of each completion after its prompt under `params`:
    (logps f32[B', L' - 1], mask bool[B', L' - 1]) with the completion tokens where mask is True
    (rows past len(prompts) are padding). Differentiable in params (call it inside jax.grad with
    the packed arrays: `pack` + `token_logprobs`)."""
    ids, mask = pack(prompts, completions)
    return token_logprobs(params, cfg, ids), mask
