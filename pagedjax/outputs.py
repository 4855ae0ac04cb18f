"""What the engine returns, with vLLM's names: RequestOutput and its CompletionOutputs."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedjax.metrics import RequestRecord


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    cumulative_logprob: float | None = None
    logprobs: list | None = None
    stop_reason: str | int | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: list[RequestRecord] = field(default_factory=list)
    num_cached_tokens: int = 0


def format_logprobs(token_ids, lp, k):
    """Per generated token: {token id: logprob} for the top k and the sampled token (vLLM's shape)."""
    if lp is None:
        return None
    out = []
    for tok, (sampled_lp, ids, vals) in zip(token_ids, lp):
        d = dict(zip(ids[:k], vals[:k]))
        d[tok] = sampled_lp
        out.append(d)
    return out
