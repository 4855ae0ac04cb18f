"""What the engine returns, with vLLM's names and shapes (pagedjax.outputs as vllm.outputs).

    RequestOutput(request_id, prompt, prompt_token_ids, prompt_logprobs, outputs, finished,
                  metrics, num_cached_tokens)
      outputs: one CompletionOutput per sample (index, text, token_ids, cumulative_logprob,
               logprobs, finish_reason, stop_reason)
      logprobs: per generated token a dict {token id: Logprob(logprob, rank, decoded_token)} with
               the sampled token and the top `SamplingParams.logprobs`; ranks count from 1
      prompt_logprobs: the same per prompt token, None for the first (nothing predicts it)
      metrics: a RequestStateStats (timestamps and counts of the request)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's log-probability, its rank among all tokens (1 = the most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None   # "stop", "length", "abort", "error"; None while running
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """A request's timestamps (perf_counter seconds) and counts, with vLLM V1's names."""

    num_generation_tokens: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0          # first scheduled
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    finished_ts: float = 0.0
    num_preemptions: int = 0

    @property
    def first_token_latency(self) -> float:
        """Time to first token (0 until there is one)."""
        return self.first_token_ts - self.arrival_time if self.first_token_ts else 0.0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestStateStats | None = None
    num_cached_tokens: int = 0
    # engine-internal per-sample records (pagedjax.metrics.RequestRecord) of a finished request
    records: list = field(default_factory=list, repr=False)
