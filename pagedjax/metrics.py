"""Per-request and per-step records, and summaries with vLLM's definitions. Pure Python + numpy.

Per request (as vLLM's `bench serve` defines them):
    queue time  first scheduled - arrival
    TTFT        first token - arrival
    TPOT        (e2e - TTFT) / (output tokens - 1), for requests with more than one token
    ITL         every gap between consecutive tokens of a request
    e2e         last token (finish) - arrival
Per step (StepStats, recorded by the scheduler): running / waiting / swapped requests, prefill and
decode tokens, blocks used, real tokens held, KV utilization (real tokens / allocated slots),
preemptions, prefix-cache queries and hits, and which request sat in which seat (the occupancy
timeline). Per engine step (StepTiming, recorded by LLMEngine): the host and device time of each
phase and the compiled bucket it ran.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

logger = logging.getLogger(__name__)
PERCENTILES = (50, 90, 99)


@dataclass
class StepStats:
    step: int
    time: float
    num_running: int
    num_waiting: int
    num_swapped: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_rows: int
    used_blocks: int
    allocated_slots: int
    real_tokens: int
    kv_utilization: float
    kv_usage: float
    num_preempted: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    occupancy: list | None = None   # seat -> request id scheduled in it this step (None: idle)


@dataclass
class StepTiming:
    """Where one LLMEngine.step's wall time went, in seconds, and the compiled bucket it ran
    ((T tokens, S rows, P block-table columns); None when the step ran nothing on the device).
    execute covers the device step, its block copies and swaps, and fetching its results."""

    step: int
    bucket: tuple | None
    schedule: float
    pack: float = 0.0
    execute: float = 0.0
    update: float = 0.0
    outputs: float = 0.0
    shape: dict | None = None   # what the step computed (step_shape), the inputs of a step-cost model
    start: float = 0.0          # perf_counter when the step began

    @property
    def total(self) -> float:
        return self.schedule + self.pack + self.execute + self.update + self.outputs


def step_shape(out, step, block_size: int) -> dict:
    """What one step computed, as the terms of a step-cost model: the compiled bucket's tokens,
    rows and block-table cells (T, S, S * P), the real tokens and rows, the context tokens and
    pages attention reads, and the blocks swapped or copied around it."""
    n = int(step.attention.num_seqs)
    return shape_of(out, step.bucket, step.num_tokens, step.attention.context_lens[:n], block_size)


def shape_of(out, bucket: tuple[int, int, int], num_tokens: int, context_lens, block_size: int) -> dict:
    """step_shape from its parts: the bucket (T, S, P), the real tokens and each real row's context."""
    T, S, P = bucket
    ctx = [int(c) for c in context_lens]
    return {"tokens": T, "rows": S, "table": S * P, "num_tokens": int(num_tokens), "num_rows": len(ctx),
            "context": sum(ctx), "pages": sum(-(-c // block_size) for c in ctx),
            "swap_blocks": len(out.swap_in) + len(out.swap_out),
            "copy_blocks": len(out.block_copies) + len(out.block_copies_after)}


@dataclass
class RequestRecord:
    request_id: str
    group_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    arrival: float
    first_scheduled: float | None
    first_token: float | None
    finished: float | None
    token_times: list[float]
    finish_reason: str | None
    num_preemptions: int
    num_cached_tokens: int

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def e2e(self) -> float | None:
        end = self.token_times[-1] if self.token_times else self.finished
        return None if end is None else end - self.arrival

    @property
    def tpot(self) -> float | None:
        if self.num_output_tokens < 2 or self.ttft is None:
            return None
        return (self.e2e - self.ttft) / (self.num_output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]


def summarize(values, percentiles=PERCENTILES) -> dict:
    """mean and percentiles (numpy's linear interpolation, as vLLM's benchmark) of non-None values."""
    xs = np.asarray([v for v in values if v is not None], dtype=np.float64)
    if xs.size == 0:
        return {"n": 0, "mean": None, **{f"p{p}": None for p in percentiles}}
    return {"n": int(xs.size), "mean": float(xs.mean()),
            **{f"p{p}": float(np.percentile(xs, p)) for p in percentiles}}


@dataclass
class MetricsRecorder:
    max_num_seqs: int
    record_occupancy: bool = True
    steps: list[StepStats] = field(default_factory=list)
    finished: list[RequestRecord] = field(default_factory=list)
    recent_preemptions: deque = field(default_factory=deque)   # step of each preemption, last 100 steps
    last_preemption_warning: int = -(10**9)

    def record_step(self, stats: StepStats) -> None:
        if not self.record_occupancy:
            stats.occupancy = None
        self.steps.append(stats)
        self._warn_on_sustained_preemption(stats)

    def _warn_on_sustained_preemption(self, stats: StepStats) -> None:
        window = self.recent_preemptions
        window.extend([stats.step] * stats.num_preempted)
        while window and window[0] <= stats.step - 100:
            window.popleft()
        if len(window) > 5 and stats.step - self.last_preemption_warning >= 100:
            self.last_preemption_warning = stats.step
            logger.warning(
                "%d preemptions in the last 100 steps: the KV pool is too small for this concurrency. "
                "Lower max_num_seqs, raise num_blocks / gpu_memory_utilization, or lower max_model_len.",
                len(window))

    def record_finished(self, req) -> RequestRecord:
        t = req.times
        rec = RequestRecord(
            request_id=req.request_id, group_id=req.group_id, num_prompt_tokens=req.num_prompt_tokens,
            num_output_tokens=req.num_output_tokens, arrival=t.arrival, first_scheduled=t.first_scheduled,
            first_token=t.first_token, finished=t.finished, token_times=list(t.token_times),
            finish_reason=req.finish_reason, num_preemptions=req.num_preemptions,
            num_cached_tokens=max(req.num_cached_tokens, 0))
        self.finished.append(rec)
        return rec

    def reset(self) -> None:
        self.steps.clear()
        self.finished.clear()

    # -- summaries ---------------------------------------------------------------------------------
    def request_summary(self) -> dict:
        recs = self.finished
        return {
            "num_requests": len(recs),
            "queue_time": summarize(r.queue_time for r in recs),
            "ttft": summarize(r.ttft for r in recs),
            "tpot": summarize(r.tpot for r in recs),
            "itl": summarize(x for r in recs for x in r.itls),
            "e2e": summarize(r.e2e for r in recs),
        }

    def step_summary(self, busy_only: bool = True) -> dict:
        """KV and batch statistics over the steps (busy_only: steps that ran something)."""
        steps = [s for s in self.steps if s.num_rows] if busy_only else self.steps
        if not steps:
            return {"num_steps": 0}
        util = np.array([s.kv_utilization for s in steps if s.allocated_slots])
        queries = sum(s.prefix_query_tokens for s in self.steps)
        hits = sum(s.prefix_hit_tokens for s in self.steps)
        return {
            "num_steps": len(steps),
            "mean_kv_utilization": float(util.mean()) if util.size else None,
            "min_kv_utilization": float(util.min()) if util.size else None,
            "mean_kv_usage": float(np.mean([s.kv_usage for s in steps])),
            "peak_kv_usage": float(max(s.kv_usage for s in steps)),
            "mean_running": float(np.mean([s.num_running for s in steps])),
            "peak_running": max(s.num_running for s in steps),
            "preemptions": sum(s.num_preempted for s in self.steps),
            "prefill_tokens": sum(s.num_prefill_tokens for s in self.steps),
            "decode_tokens": sum(s.num_decode_tokens for s in self.steps),
            "prefix_query_tokens": queries,
            "prefix_hit_tokens": hits,
            "prefix_hit_rate": hits / queries if queries else 0.0,
        }

    def occupancy_matrix(self, max_steps: int | None = None) -> list[list]:
        """steps x seats of request ids (None = idle seat), for timeline plots."""
        steps = self.steps[:max_steps] if max_steps else self.steps
        return [s.occupancy or [None] * self.max_num_seqs for s in steps]

    def to_dict(self) -> dict:
        return {"requests": self.request_summary(), "steps": self.step_summary(),
                "finished": [dict(asdict(r), ttft=r.ttft, tpot=r.tpot, e2e=r.e2e) for r in self.finished]}


def step_stats(scheduler, out, now: float) -> StepStats:
    """What a scheduler has just scheduled (`out`), and its queues and KV use, as a StepStats."""
    usage = scheduler.kv.usage()
    occupancy = [None] * scheduler.config.max_num_seqs
    for req in out.scheduled:
        seat = scheduler.seats.get(req.request_id)
        if seat is not None:
            occupancy[seat] = req.request_id
    return StepStats(
        step=out.step, time=now, num_running=len(scheduler.running), num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.swapped), num_prefill_tokens=out.num_prefill_tokens,
        num_decode_tokens=out.num_decode_tokens, num_rows=out.num_rows,
        used_blocks=usage.used_blocks, allocated_slots=usage.allocated_slots,
        real_tokens=usage.real_tokens, kv_utilization=usage.utilization, kv_usage=usage.usage,
        num_preempted=len(out.preempted), prefix_query_tokens=out.prefix_query_tokens,
        prefix_hit_tokens=out.prefix_hit_tokens, occupancy=occupancy)
