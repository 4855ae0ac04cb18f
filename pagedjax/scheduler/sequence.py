"""A request's state on the host: tokens, progress, status, timestamps. No JAX.

One `Request` is one sequence of tokens. A prompt asked for with `n > 1` starts as one
request (the parent) that prefills the prompt once; when its last prompt token is scheduled,
the scheduler forks `n - 1` children that share every prompt block copy-on-write and sample
their first token from the parent's logits with their own seeds. From then on each is a
request of its own; `group_id` ties them together for the caller.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from pagedjax.sampling_params import SamplingParams

PLACEHOLDER = -1   # a token id in all_token_ids whose value the device has not returned yet


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2     # freed by recompute preemption, waiting to be recomputed
    SWAPPED = 3       # blocks on the host pool, resumed first when device blocks free up
    FINISHED_STOPPED = 4
    FINISHED_LENGTH = 5
    FINISHED_ABORTED = 6
    FINISHED_ERROR = 7

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return {RequestStatus.FINISHED_STOPPED: "stop", RequestStatus.FINISHED_LENGTH: "length",
                RequestStatus.FINISHED_ABORTED: "abort", RequestStatus.FINISHED_ERROR: "error"}.get(self)


@dataclass
class RequestTimes:
    """Wall or virtual clock readings; the metrics module derives TTFT, TPOT, ITL from them."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)
    finished: float | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float = 0.0
    eos_token_id: int | None = None
    seed: int = 0                     # the effective seed (drawn by the engine if params have none)
    group_id: str | None = None       # the parent's id for every member of an n > 1 group
    sample_index: int = 0             # which of the group's n samples this is
    extra_key: object = None          # mixed into prefix hashes (an adapter id)
    max_tokens: int | None = None     # the tokens it may generate: min(sampling max_tokens, what fits
                                      # max_model_len), set by Scheduler.add_request
    bad_words_token_ids: list[list[int]] | None = None  # sampling_params.bad_words, tokenized

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list = field(default_factory=list)
    # (logprob, top ids, top logprobs, rank) of prompt tokens 1, 2, ... (token 0 has none)
    prompt_logprobs: list = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    block_hashes: list = field(default_factory=list)
    num_cached_tokens: int = -1       # prefix-cache hit at first admission (-1: not admitted yet)
    num_preemptions: int = 0
    forked: bool = False              # an n > 1 parent that has forked its children
    children: list[str] = field(default_factory=list)
    error: str | None = None
    order: tuple = ()                 # FCFS key: (arrival, admission counter, sample index)
    times: RequestTimes = None        # type: ignore[assignment]
    # tokens handed to the device whose sampled value is not back yet (async scheduling): they
    # stand at the end of all_token_ids as PLACEHOLDER; pending_row is the newest one's row in
    # its step's sampled tokens, from which the next step takes it on the device
    num_pending: int = 0
    pending_row: int = -1
    _sampling_row: tuple | None = field(default=None, repr=False)
    record: object = field(default=None, repr=False)  # its metrics.RequestRecord once finished

    def __post_init__(self):
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        if self.times is None:
            self.times = RequestTimes(self.arrival_time)
        if self.group_id is None:
            self.group_id = self.request_id

    # -- derived ---------------------------------------------------------------------------
    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def length_reached(self) -> bool:
        """Its pending tokens bring it to max_tokens: it finishes once they are back, whatever they are."""
        return bool(self.num_pending) and self.max_tokens is not None and \
            self.num_output_tokens + self.num_pending >= self.max_tokens

    @property
    def max_num_tokens(self) -> int:
        """Prompt + max_tokens: the most KV this request can ever hold."""
        limit = self.max_tokens if self.max_tokens is not None else self.sampling_params.max_tokens
        return self.num_prompt_tokens + (limit if limit is not None else 0)

    @property
    def skip_prefix_cache(self) -> bool:
        """Prompt logprobs need the logits at every prompt token: no prefix-cache hits until the
        request (the first of its group: the one that prefills the prompt) has them all."""
        return (self.sampling_params.prompt_logprobs is not None and self.sample_index == 0
                and len(self.prompt_logprobs) < self.num_prompt_tokens - 1)

    @property
    def num_seats(self) -> int:
        """Seats (of max_num_seqs) this request stands for: an unforked n > 1 parent keeps one
        for each sample, so its children never find the batch full."""
        return self.sampling_params.n if self.needs_fork else 1

    @property
    def needs_fork(self) -> bool:
        return self.sampling_params.n > 1 and not self.forked and self.sample_index == 0

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        return self.status.finish_reason

    @property
    def sampling_row(self) -> tuple:
        """(temperature, top_k or 0, top_p, min_p, seed low 32 bits, seed high 32 bits), cached
        for the params it was made from: the packer writes it into the step's sampling arrays
        every step."""
        cached = self._sampling_row
        sp = self.sampling_params
        if cached is None or cached[0] is not sp:  # (params replaced: a new row)
            cached = self._sampling_row = (sp, (sp.temperature, max(sp.top_k, 0), sp.top_p, sp.min_p,
                                                self.seed & 0xFFFFFFFF, (self.seed >> 32) & 0xFFFFFFFF))
        return cached[1]

    def add_placeholder(self, row: int) -> None:
        """A token is being sampled for this request in row `row` of the step just dispatched."""
        self.all_token_ids.append(PLACEHOLDER)
        self.num_pending += 1
        self.pending_row = row

    def drop_pending(self) -> None:
        """Forget the tokens still being sampled (the request finished or is computed again)."""
        if self.num_pending:
            del self.all_token_ids[-self.num_pending:]
            self.num_pending = 0

    def append_output_token(self, token_id: int, now: float, logprob=None) -> None:
        """Append a sampled token; it takes the place of the oldest placeholder if there is one."""
        if self.num_pending:
            self.all_token_ids[self.num_prompt_tokens + len(self.output_token_ids)] = token_id
            self.num_pending -= 1
        else:
            self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)
        if logprob is not None:
            self.output_logprobs.append(logprob)
        if self.times.first_token is None:
            self.times.first_token = now
        self.times.token_times.append(now)


def derive_seed(seed: int, index: int) -> int:
    """Seed of sample `index` of a group: distinct, deterministic, in [0, 2**63)."""
    if index == 0:
        return seed
    x = (seed * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9) & (2**64 - 1)
    x ^= x >> 31
    return x & (2**63 - 1)
