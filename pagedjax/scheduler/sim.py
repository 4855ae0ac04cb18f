"""A simulated executor: the scheduler's whole loop with no model and no JAX.

`SimExecutor` stands in for the runner. It keeps a shadow KV pool of token ids, applies every
swap and copy the scheduler asks for, writes each scheduled token at its slot, and samples the
next token by a deterministic rule that *reads the context back through the block table*
(the previous token and one further back), as the cache stood before the step plus the row's own
new tokens, as the device sees it. So a wrong block table, a missed copy-on-write, a lost swap
or a prefix hit on a block still being filled changes the tokens a request produces, and
comparing against a run with ample memory (`run_alone`) catches it. With `check_kv=True` every
row's whole context is read back and compared, before the step's writes and after. Like the
device step, it takes a token the host packed as a placeholder (async scheduling) from the
previous step's sampled tokens.

Step time runs on a virtual clock, from a cost: `StepCost` (a + b * tokens + c * context tokens)
or anything with `step_time(out, step, block_size)`, such as a step-cost model fitted to the
engine's measured steps (pagedjax.benchmarks.cost_model). A schedule of 100,000 requests can be
studied in seconds.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from pagedjax.scheduler.batch import BatchPacker, StepInput
from pagedjax.scheduler.output import SchedulerOutput
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import PLACEHOLDER, Request

_M = np.uint64(0x9E3779B97F4A7C15)


class VirtualClock:
    def __init__(self, start: float = 0.0):
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


@dataclass
class StepCost:
    """Virtual step time: fixed + per scheduled token + per context token read."""

    fixed: float = 5e-3
    per_token: float = 1e-4
    per_context_token: float = 1e-6

    def step_time(self, out: SchedulerOutput, step: StepInput, block_size: int) -> float:
        context = float(step.attention.context_lens[:int(step.attention.num_seqs)].sum())
        return self.fixed + self.per_token * step.num_tokens + self.per_context_token * context


def next_token_rule(seed: np.ndarray, pos: np.ndarray, prev: np.ndarray, back: np.ndarray, vocab: int) -> np.ndarray:
    """The sim's "model": a hash of (seed, position, two tokens of the context)."""
    with np.errstate(over="ignore"):
        x = seed.astype(np.uint64) * _M + pos.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= (prev.astype(np.uint64) + np.uint64(1)) * np.uint64(0x94D049BB133111EB)
        x ^= (back.astype(np.uint64) + np.uint64(7)) * _M
        x ^= x >> np.uint64(29)
    return (x % np.uint64(vocab)).astype(np.int64)


def run_alone(req: Request, max_model_len: int, vocab_size: int = 1000) -> tuple[list[int], str]:
    """(output tokens, finish reason) the sim produces for `req` alone with ample memory,
    straight from the next-token rule with no scheduler. The rule reads only the request's own
    seed and tokens, so every schedule (any batch, preempted, swapped, forked) must give this."""
    sp = req.sampling_params
    seed = np.array([req.seed], np.uint64)
    tokens, out = list(req.prompt_token_ids), []
    while True:
        c = len(tokens)
        token = int(next_token_rule(seed, np.array([c]), np.array([tokens[c - 1]]),
                                    np.array([tokens[(c - 1) // 2]]), vocab_size)[0])
        tokens.append(token)
        out.append(token)
        # the scheduler's stop order: eos, stop_token_ids, then length
        if (not sp.ignore_eos and req.eos_token_id is not None and token == req.eos_token_id) \
                or (sp.stop_token_ids and token in sp.stop_token_ids):
            return out, "stop"
        if len(out) >= sp.max_tokens or len(tokens) >= max_model_len:
            return out, "length"


class SimExecutor:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, vocab_size: int = 1000,
                 cost=None, check_kv: bool = False):
        self.bs = block_size
        self.kv = np.full(num_blocks * block_size, -1, np.int64)
        self.host = np.full(max(num_host_blocks, 1) * block_size, -1, np.int64)
        self.vocab = vocab_size
        self.cost = cost or StepCost()
        self.check_kv = check_kv
        self.logits_hook: Callable[[SchedulerOutput], np.ndarray | None] | None = None
        self.last_sampled = np.zeros(1, np.int64)   # the last step's sampled tokens, by row

    def _copy_blocks(self, pairs, src_mem, dst_mem):
        bs = self.bs
        for s, d in pairs:
            dst_mem[d * bs:(d + 1) * bs] = src_mem[s * bs:(s + 1) * bs]

    @staticmethod
    def _check(req: Request, got: np.ndarray, what: str) -> None:
        want = np.asarray(req.all_token_ids[:len(got)])
        known = want != PLACEHOLDER  # a token still in flight (async scheduling) is checked once back
        if not np.array_equal(got[known], want[known]):
            got, want = np.where(known, got, want), want
            bad = int(np.argmax(got != want))
            raise AssertionError(f"KV of {req.request_id} {what} {got[bad]} at position {bad}, not {want[bad]}")

    def execute(self, out: SchedulerOutput, step: StepInput) -> tuple[np.ndarray, np.ndarray | None, float]:
        """Run one step: returns (sampled token per row, per-row error mask or None, step time)."""
        bs = self.bs
        # the runner's order: swap-out, swap-in, copy-on-write copies, the forward pass, then the
        # copies of contiguous forks (whose source the forward pass writes)
        self._copy_blocks(out.swap_out, self.kv, self.host)
        self._copy_blocks(out.swap_in, self.host, self.kv)
        self._copy_blocks(out.block_copies, self.kv, self.kv)

        a = step.attention
        S = int(a.num_seqs)
        # tokens the previous step sampled that the host had not yet (async scheduling)
        source = step.token_source
        token_ids = np.where(source >= 0, self.last_sampled[np.clip(source, 0, len(self.last_sampled) - 1)],
                             step.token_ids) if (source >= 0).any() else step.token_ids
        ctx = a.context_lens[:S].astype(np.int64)
        tables = a.block_tables[:S].astype(np.int64)
        qsl = a.query_start_loc[:S + 1].astype(np.int64)
        start = ctx - (qsl[1:] - qsl[:-1])  # the first position each row computes this step
        rows = np.arange(S)
        src = np.asarray(out.sample_from, np.int64)  # a forked sample samples from its parent's row

        def cached(s, pos):
            return self.kv[tables[s, pos // bs] * bs + pos % bs]

        # the forward pass sees the cache as it was before the step (the runner writes the step's
        # K/V after its layer loop) plus each row's own new tokens: a row reading a block another
        # row fills in this same step reads stale content here, as it would on the device
        def read(pos):
            own = pos >= start
            return np.where(own, token_ids[np.where(own, qsl[:-1] + pos - start, 0)], cached(rows, pos))

        prev, back = read(ctx - 1)[src], read((ctx - 1) // 2)[src]
        if self.check_kv:
            for s, req in enumerate(out.scheduled):
                if src[s] == s:
                    self._check(req, cached(s, np.arange(int(start[s]))), "reads")
        n = step.num_tokens
        slots = a.slot_mapping[:n]
        self.kv[slots[slots >= 0]] = token_ids[:n][slots >= 0]
        self._copy_blocks(out.block_copies_after, self.kv, self.kv)
        if self.check_kv:  # and what later steps will read
            for s, req in enumerate(out.scheduled):
                self._check(req, cached(s, np.arange(int(ctx[s]))), "holds")

        seeds = step.sampling.seeds
        seed = seeds[:S, 0].astype(np.uint64) | (seeds[:S, 1].astype(np.uint64) << np.uint64(32))
        sampled = self.last_sampled = next_token_rule(seed, ctx, prev, back, self.vocab)
        errors = self.logits_hook(out) if self.logits_hook else None
        return sampled, errors, self.cost.step_time(out, step, bs)


@dataclass
class SimResult:
    finished: dict[str, Request]
    num_steps: int
    virtual_time: float
    preemptions: int


def simulate(scheduler: Scheduler, executor: SimExecutor, arrivals: Iterable[Request],
             clock: VirtualClock, *, max_steps: int = 10_000_000,
             on_step: Callable[[Scheduler, SchedulerOutput], None] | None = None) -> SimResult:
    """Drive the scheduler to completion. Requests join when the virtual clock passes their
    arrival_time; `on_step(scheduler, out)` runs after each step (aborts, checks)."""
    packer = BatchPacker(scheduler.config)
    pending = [(r.arrival_time, i, r) for i, r in enumerate(arrivals)]
    heapq.heapify(pending)
    finished: dict[str, Request] = {}
    steps = 0
    while steps < max_steps:
        while pending and pending[0][0] <= clock.now:
            scheduler.add_request(heapq.heappop(pending)[2])
        if not scheduler.has_unfinished_requests():
            if not pending:
                break
            clock.now = max(clock.now, pending[0][0])
            continue
        out = scheduler.schedule()
        if out.is_empty:
            if not pending:
                raise RuntimeError(f"scheduler stalled at step {out.step} with "
                                   f"{scheduler.num_unfinished} unfinished requests")
            clock.now = max(clock.now, pending[0][0])
            continue
        # an executor that only prices steps plans them itself, without packing the arrays
        step = packer.pack(out, scheduler.kv) if getattr(executor, "needs_step_input", True) else None
        sampled, errors, dt = executor.execute(out, step)
        clock.advance(dt)
        for req in scheduler.update_from_output(out, sampled, errors=errors, now=clock.now):
            if req.is_finished:
                finished[req.request_id] = req
        steps += 1
        if on_step is not None:
            on_step(scheduler, out)
    return SimResult(finished, steps, clock.now, scheduler.num_preemptions)
