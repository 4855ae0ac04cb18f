"""Continuous batching on the host: who runs this step, with how many tokens, in which blocks.

`schedule()` returns a `SchedulerOutput` that says exactly what the runner must do this step; `update_from_output()`
takes the sampled tokens back, appends them, finishes requests and frees their blocks. No JAX here.
It is two halves, `advance()` (the step is on the device) and `resolve()` (its tokens are back),
between which async scheduling schedules the next step.

Policy (`scheduling="continuous"`, vLLM's): running requests first, oldest first, each given
the rest of its prompt (chunked to the token budget) or one decode token; then swapped
requests are resumed; then waiting requests are admitted in FCFS order while the token
budget (`max_num_batched_tokens`), the seats (`max_num_seqs`) and the blocks for their next
chunk last. The first waiting request that does not fit stops admission (no overtaking).

When a running request cannot get its next block, the newest running request is preempted,
all its blocks at once: freed and recomputed later (`preemption_mode="recompute"`), or copied
to the host pool and resumed first (`"swap"`). Victims are always requests not yet scheduled
this step (the running list is in FCFS order and victims come off its end), so nothing a
step was promised is taken back.

`scheduling="static"` is the baseline: a batch of up to `max_num_seqs` waiting requests is formed only when
the previous batch has completely finished; finished members' seats stay empty until then.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence

from pagedjax.config import EngineConfig
from pagedjax.metrics import MetricsRecorder, step_stats
from pagedjax.scheduler.admission import check_request
from pagedjax.scheduler.kv_cache_manager import KVCacheManager
from pagedjax.scheduler.output import SchedulerOutput
from pagedjax.scheduler.sequence import Request, RequestStatus, derive_seed

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, config: EngineConfig, num_blocks: int | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.config = config
        num_blocks = num_blocks or config.num_blocks
        if num_blocks is None:
            raise ValueError("num_blocks must be given (the KV pool size in blocks)")
        self.num_blocks = num_blocks
        self.kv = KVCacheManager(
            num_blocks, config.block_size, max_model_len=config.max_model_len,
            enable_prefix_caching=config.enable_prefix_caching, allocation=config.allocation,
            contiguous_reserve=config.contiguous_reserve,
            num_host_blocks=(num_blocks if config.num_host_blocks is None else config.num_host_blocks)
            if config.preemption_mode == "swap" else 0)
        self.clock = clock
        self.requests: dict[str, Request] = {}     # every unfinished request (and group member)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []           # FCFS order (Request.order)
        self.swapped: list[Request] = []           # FCFS order
        self.static_batch: set[str] = set()        # members of the current static batch
        self.seats: dict[str, int] = {}            # request id -> seat, for occupancy timelines
        self._free_seats = list(range(config.max_num_seqs - 1, -1, -1))
        self._admit_counter = 0
        self.step_counter = 0
        self.metrics = MetricsRecorder(config.max_num_seqs)
        self.num_preemptions = 0
        self._forked: list[Request] = []

    # -- admission ----------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Accept a request or refuse it at once; a request that could never run is refused
        here rather than left waiting forever."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in use by an unfinished request")
        check_request(req, self.config, self.kv, self.num_blocks)
        req.status = RequestStatus.WAITING
        req.order = (req.arrival_time, self._admit_counter, req.sample_index)
        self._admit_counter += 1
        self.requests[req.request_id] = req
        self.waiting.append(req)

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        cfg = self.config
        now = self.clock()
        out = SchedulerOutput(step=self.step_counter)
        self.step_counter += 1
        budget = cfg.max_num_batched_tokens
        preempted_any = False
        forked = self._forked = []  # children forked this step join `running` at its end

        # 1. running requests, oldest first
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(len(req.all_token_ids) - req.num_computed_tokens, budget)
            if num_new <= 0 or req.length_reached:  # (a request whose pending token ends it is done)
                i += 1
                continue
            while True:
                if self._allocate(req, num_new):
                    scheduled = True
                    break
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted_any = True
                if victim is req:
                    scheduled = False
                    break
            if not scheduled:
                break
            budget -= num_new
            self._schedule_row(req, num_new, out, forked, now)
            i += 1

        # 2. swapped requests come back first, when blocks and seats allow
        if not preempted_any:
            while self.swapped and self._seats_free() >= self.swapped[0].num_seats:
                req = self.swapped[0]
                mapping = self.kv.swap_in([req.request_id])
                if mapping is None:
                    break
                self.swapped.pop(0)
                out.swap_in.extend(mapping)
                req.status = RequestStatus.RUNNING
                self._insert_running(req)
                num_new = min(req.num_tokens - req.num_computed_tokens, budget)
                if num_new > 0 and self._allocate(req, num_new):
                    budget -= num_new
                    self._schedule_row(req, num_new, out, forked, now)

        # 3. waiting requests, FCFS; the first that does not fit stops admission
        if not preempted_any and not self.swapped:
            if cfg.scheduling == "static" and not self.running and not self._static_members_waiting():
                self._form_static_batch()
            while self.waiting and budget > 0:
                req = self.waiting[0]
                if cfg.scheduling == "static" and req.request_id not in self.static_batch:
                    break
                if self._seats_free() < req.num_seats:
                    break
                hits, num_hit = self.kv.get_computed_blocks(req)
                num_new = req.num_tokens - req.num_computed_tokens - num_hit
                if num_new > budget and not cfg.enable_chunked_prefill:
                    break
                num_new = min(num_new, budget)
                if not self._allocate(req, num_new, hits):
                    break
                self.waiting.popleft()
                first_time = req.num_cached_tokens < 0
                if first_time:
                    # replays after preemption hit their own blocks: not counted as cache hits
                    req.num_cached_tokens = num_hit
                    out.prefix_query_tokens += req.num_prompt_tokens
                    out.prefix_hit_tokens += num_hit
                    req.times.first_scheduled = now
                req.num_computed_tokens += num_hit
                req.status = RequestStatus.RUNNING
                self._insert_running(req)
                budget -= num_new
                self._schedule_row(req, num_new, out, forked, now)

        for child in forked:
            self._insert_running(child)
        self._forked = []
        # paged copies are copy-on-write (the step then writes into the copy): before the forward.
        # contiguous copies are forks, whose source the step is still writing: after it
        if self.kv.contiguous:
            out.block_copies_after = self.kv.pop_block_copies()
        else:
            out.block_copies = self.kv.pop_block_copies()
        self.metrics.record_step(step_stats(self, out, now))
        return out

    def _allocate(self, req: Request, num_new: int, hits: list[int] | None = None) -> bool:
        if not self.kv.contiguous:
            return self.kv.allocate_slots(req, num_new, hits) is not None
        if (req.needs_fork
                and req.num_computed_tokens + len(hits or ()) * self.config.block_size + num_new >= req.num_prompt_tokens):
            # contiguous siblings each reserve (and copy into) a slab of their own at the fork
            reserve = self.kv.reservation(req)
            own = reserve - len(self.kv.req_to_blocks.get(req.request_id, ()))
            if not self.kv.can_reserve([own] + [reserve] * (req.sampling_params.n - 1)):
                return False
        return self.kv.allocate_slots(req, num_new, hits) is not None

    def _schedule_row(self, req: Request, num_new: int, out: SchedulerOutput, forked: list, now: float) -> None:
        row = len(out.scheduled)
        out.add_row(req, num_new)
        if req.sampling_params.n > 1 and req.needs_fork and req.num_computed_tokens + num_new >= req.num_prompt_tokens:
            # the prompt completes this step: its n - 1 siblings share every block from here
            # and sample their first token from this row's logits with their own seeds
            req.forked = True
            for k in range(1, req.sampling_params.n):
                child = self._fork(req, k, req.num_computed_tokens + num_new, now)
                forked.append(child)
                out.add_row(child, 0, sample_from=row)

    def _fork(self, parent: Request, k: int, num_computed: int, now: float) -> Request:
        child = self._spawn(parent, f"{parent.request_id}#{k}", sample_index=k, seed=derive_seed(parent.seed, k),
                            group_id=parent.request_id, num_computed=num_computed)
        child.num_cached_tokens = parent.num_cached_tokens
        child.times.first_scheduled = now
        parent.children.append(child.request_id)
        if parent.request_id in self.static_batch:
            # the samples belong to their parent's static batch: one preempted must be readmitted
            # with it, or it heads the waiting queue as a non-member and nothing runs again
            self.static_batch.add(child.request_id)
        return child

    def _spawn(self, parent: Request, request_id: str, *, sample_index: int = 0, seed: int | None = None,
               group_id: str | None = None, num_computed: int | None = None) -> Request:
        """A running request holding `parent`'s tokens and sharing every block of it copy-on-write."""
        child = Request(request_id, parent.prompt_token_ids, parent.sampling_params, arrival_time=parent.arrival_time,
                        eos_token_id=parent.eos_token_id, seed=parent.seed if seed is None else seed,
                        group_id=group_id, sample_index=sample_index, extra_key=parent.extra_key)
        child.all_token_ids = list(parent.all_token_ids)
        child.block_hashes = list(parent.block_hashes)
        child.max_tokens = parent.max_tokens
        child.num_computed_tokens = parent.num_computed_tokens if num_computed is None else num_computed
        child.status = RequestStatus.RUNNING
        child.order = parent.order[:2] + (sample_index,)
        self.kv.fork(parent.request_id, request_id)
        self.requests[request_id] = child
        return child

    def fork_request(self, parent_id: str, request_id: str) -> Request:
        """Fork a running request into a new one, `request_id`, that shares every block
        copy-on-write, holds the same tokens and takes a seat (a new beam of a beam search)."""
        parent = self.requests.get(parent_id)
        if parent is None or parent.status != RequestStatus.RUNNING:
            raise ValueError(f"fork_request: request_id {parent_id!r} is not a running request")
        if request_id in self.requests:
            raise ValueError(f"fork_request: request_id {request_id!r} is already in use")
        if self._seats_free() < 1:
            raise ValueError(f"fork_request: no free seat (max_num_seqs={self.config.max_num_seqs})")
        child = self._spawn(parent, request_id)
        child.output_token_ids = list(parent.output_token_ids)
        child.output_logprobs = list(parent.output_logprobs)
        child.times = dataclasses.replace(parent.times, token_times=list(parent.times.token_times))
        self._insert_running(child)
        return child

    def replace_last_token(self, request_id: str, token: int) -> None:
        """Make another token a running request's last sampled one (a beam search choosing among
        the candidates): allowed only while that token's K/V is not yet computed."""
        req = self.requests.get(request_id)
        if req is None or req.status != RequestStatus.RUNNING or not req.output_token_ids:
            raise ValueError(f"replace_last_token: request_id {request_id!r} is not a running request "
                             f"with a sampled token")
        if req.num_computed_tokens >= req.num_tokens:
            raise ValueError(f"replace_last_token: the last token of {request_id!r} is already computed")
        req.all_token_ids[-1] = req.output_token_ids[-1] = int(token)

    def rollback_step(self, out: SchedulerOutput) -> None:
        """The step `out` did not run on the device (it raised): undo what scheduling it did, so
        the same work is scheduled again. Nothing was appended (num_computed_tokens advances only
        in update_from_output); the blocks registered for the step are forgotten (never filled);
        samples forked in this step, whose KV was never written, go back to be recomputed from
        their prompt."""
        self.kv.rollback_step(out.scheduled)
        for req, n in zip(out.scheduled, out.num_new_tokens):
            if n == 0 and req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self._release_seat(req)
                self.kv.free(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(req)

    # -- preemption -----------------------------------------------------------------------------
    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        self._release_seat(req)
        self.num_preemptions += 1
        req.num_preemptions += 1
        out.preempted.append(req.request_id)
        if self.config.preemption_mode == "swap":
            mapping = self.kv.swap_out([req.request_id])
            if mapping is not None:
                out.swap_out.extend(mapping)
                req.status = RequestStatus.SWAPPED
                bisect.insort(self.swapped, req, key=lambda r: r.order)
                return
            logger.warning("host swap space full: preempting %s by recompute instead", req.request_id)
        self._requeue(req)

    def _requeue(self, req: Request) -> None:
        # free before resetting num_computed_tokens: the manager forgets hashes of blocks the
        # request registered but never computed
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        # back in its FCFS place: ahead of newer arrivals, but behind an older request preempted
        # earlier (a swapped request can resume, run and be preempted again before it)
        i = 0
        while i < len(self.waiting) and self.waiting[i].order < req.order:
            i += 1
        self.waiting.insert(i, req)

    # -- results ----------------------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput, sampled: Sequence[int],
                           logprobs: Sequence | None = None, errors: Sequence[bool] | None = None,
                           now: float | None = None) -> list[Request]:
        """Take one step's sampled tokens (one per row): `advance` then `resolve`."""
        self.advance(out)
        return self.resolve(out, sampled, logprobs, errors, now)

    def advance(self, out: SchedulerOutput) -> None:
        """The step `out` is on the device: its tokens count as computed, and each row that samples
        holds a placeholder for its token, so the next step can be scheduled before the sampled
        tokens are back (async scheduling; see `resolve`)."""
        self.kv.commit()
        for row, req in enumerate(out.scheduled):
            if req.status is RequestStatus.RUNNING:  # not aborted since the step was scheduled
                req.num_computed_tokens += out.num_new_tokens[row]
                if out.needs_sample[row]:
                    req.add_placeholder(row)

    def resolve(self, out: SchedulerOutput, sampled: Sequence[int], logprobs: Sequence | None = None,
                errors: Sequence[bool] | None = None, now: float | None = None) -> list[Request]:
        """Put the sampled tokens of an advanced step in place of its placeholders (every
        request still unfinished, even one preempted since), finishing those that stop; returns
        the requests that got a new token or finished, in row order."""
        now = self.clock() if now is None else now
        changed = []
        for row, req in enumerate(out.scheduled):
            if not out.needs_sample[row] or req.status.finished or not req.num_pending:
                continue
            if errors is not None and errors[row]:
                req.error = "non-finite logits"
                self._finish(req, RequestStatus.FINISHED_ERROR, now)
                changed.append(req)
                continue
            token = int(sampled[row])
            req.append_output_token(token, now, None if logprobs is None else logprobs[row])
            status = self._check_stop(req, token)
            if status is not None:
                self._finish(req, status, now)
            changed.append(req)
        return changed

    def recompute_request(self, request_id: str) -> None:
        """Preempt an unfinished request by recompute: its blocks and pending tokens go, it waits
        in its FCFS place and computes its tokens again (a step whose results were lost)."""
        req = self.requests[request_id]
        req.drop_pending()
        if req.status in (RequestStatus.RUNNING, RequestStatus.SWAPPED):
            (self.running if req.status == RequestStatus.RUNNING else self.swapped).remove(req)
            self._release_seat(req)
            self._requeue(req)

    def _check_stop(self, req: Request, token: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens > sp.min_tokens and (  # before min_tokens the device bans them
                (not sp.ignore_eos and token == req.eos_token_id) or token in (sp.stop_token_ids or ())):
            return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_prompt_tokens + req.num_output_tokens >= self.config.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish_request(self, request_id: str, status: RequestStatus, now: float | None = None) -> None:
        """End one request (a stop string found by the engine, an error, an abort)."""
        req = self.requests.get(request_id)
        if req is None:
            raise ValueError(f"request_id {request_id!r} is not an unfinished request")
        self._finish(req, status, self.clock() if now is None else now)

    def abort_request(self, request_id: str) -> list[Request]:
        """Abort a request (or every member of the group it names) from any state; all its
        blocks return at once. Unknown ids are refused with ValueError."""
        members = [r for r in self.requests.values() if r.group_id == request_id]
        if not members:
            if request_id not in self.requests:
                raise ValueError(f"request_id {request_id!r} is not an unfinished request")
            members = [self.requests[request_id]]
        now = self.clock()
        for req in members:
            self._finish(req, RequestStatus.FINISHED_ABORTED, now)
        return members

    def _finish(self, req: Request, status: RequestStatus, now: float) -> None:
        prev = req.status
        if prev.finished:
            return
        req.drop_pending()
        if prev == RequestStatus.RUNNING:
            self.running.remove(req)
            self._release_seat(req)
            self.kv.free(req)
        elif prev == RequestStatus.SWAPPED:
            self.swapped.remove(req)
            self.kv.free(req)
        else:  # waiting or preempted: holds no blocks
            self.waiting.remove(req)
        req.status = status
        req.times.finished = now
        del self.requests[req.request_id]
        self.static_batch.discard(req.request_id)
        req.record = self.metrics.record_finished(req)

    # -- seats, queues, stats ---------------------------------------------------------------------
    def _insert_running(self, req: Request) -> None:
        bisect.insort(self.running, req, key=lambda r: r.order)
        self._take_seat(req)

    def _take_seat(self, req: Request) -> None:
        if req.request_id not in self.seats and self._free_seats:
            self.seats[req.request_id] = self._free_seats.pop()

    def _release_seat(self, req: Request) -> None:
        seat = self.seats.pop(req.request_id, None)
        if seat is not None:
            bisect.insort(self._free_seats, seat, key=lambda s: -s)

    def _seats_free(self) -> int:
        return self.config.max_num_seqs - sum(r.num_seats for r in self.running) - len(self._forked)

    def _static_members_waiting(self) -> bool:
        return any(r.request_id in self.static_batch for r in self.waiting)

    def _form_static_batch(self) -> None:
        self.static_batch.clear()
        seats = self.config.max_num_seqs
        for req in self.waiting:
            if req.num_seats > seats:
                break
            seats -= req.num_seats
            self.static_batch.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)
