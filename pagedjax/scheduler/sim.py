"""A simulated executor: the scheduler's whole loop with no model and no JAX.

`SimExecutor` stands in for the runner. It keeps a shadow KV pool of token ids, applies every
swap and copy the scheduler asks for, writes each scheduled token at its slot, and samples the
next token by a deterministic rule that *reads the context back through the block table*
(the previous token and one further back). So a wrong block table, a missed copy-on-write or a
lost swap changes the tokens a request produces, and comparing against a run with ample memory
catches it. With `check_kv=True` every row's whole context is read back and compared.

Step time runs on a virtual clock: a + b * tokens + c * context tokens, so a schedule of
100,000 requests can be studied in seconds.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np

from pagedjax.scheduler.batch import BatchPacker, StepInput
from pagedjax.scheduler.scheduler import Scheduler, SchedulerOutput
from pagedjax.scheduler.sequence import Request

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


def next_token_rule(seed: np.ndarray, pos: np.ndarray, prev: np.ndarray, back: np.ndarray, vocab: int) -> np.ndarray:
    """The sim's "model": a hash of (seed, position, two tokens of the context)."""
    with np.errstate(over="ignore"):
        x = seed.astype(np.uint64) * _M + pos.astype(np.uint64) * np.uint64(0xBF58476D1CE4E5B9)
        x ^= (prev.astype(np.uint64) + np.uint64(1)) * np.uint64(0x94D049BB133111EB)
        x ^= (back.astype(np.uint64) + np.uint64(7)) * _M
        x ^= x >> np.uint64(29)
    return (x % np.uint64(vocab)).astype(np.int64)


class SimExecutor:
    def __init__(self, num_blocks: int, block_size: int, num_host_blocks: int = 0, vocab_size: int = 1000,
                 cost: StepCost | None = None, check_kv: bool = False):
        self.bs = block_size
        self.kv = np.full(num_blocks * block_size, -1, np.int64)
        self.host = np.full(max(num_host_blocks, 1) * block_size, -1, np.int64)
        self.vocab = vocab_size
        self.cost = cost or StepCost()
        self.check_kv = check_kv
        self.logits_hook: Callable[[SchedulerOutput], np.ndarray | None] | None = None

    def _copy_blocks(self, pairs, src_mem, dst_mem):
        bs = self.bs
        for s, d in pairs:
            dst_mem[d * bs:(d + 1) * bs] = src_mem[s * bs:(s + 1) * bs]

    def execute(self, out: SchedulerOutput, step: StepInput) -> tuple[np.ndarray, np.ndarray | None, float]:
        """Run one step: returns (sampled token per row, per-row error mask or None, step time)."""
        bs = self.bs
        # the runner's order: swap-out, swap-in, copy-on-write copies, then the forward pass
        self._copy_blocks(out.swap_out, self.kv, self.host)
        self._copy_blocks(out.swap_in, self.host, self.kv)
        self._copy_blocks(out.block_copies, self.kv, self.kv)
        n = int(step.num_tokens)
        slots = step.slot_mapping[:n]
        self.kv[slots[slots >= 0]] = step.token_ids[:n][slots >= 0]

        S = int(step.num_seqs)
        ctx = step.context_lens[:S].astype(np.int64)
        tables = step.block_tables[:S].astype(np.int64)
        rows = np.arange(S)

        def read(pos):
            return self.kv[tables[rows, pos // bs] * bs + pos % bs]

        prev = read(ctx - 1)
        back = read((ctx - 1) // 2)
        seed = step.seeds[:S, 0].astype(np.uint64) | (step.seeds[:S, 1].astype(np.uint64) << np.uint64(32))
        sampled = next_token_rule(seed, ctx, prev, back, self.vocab)
        if self.check_kv:
            for s, req in enumerate(out.scheduled):
                c = int(ctx[s])
                pos = np.arange(c)
                got = self.kv[tables[s, pos // bs] * bs + pos % bs]
                want = np.asarray(req.all_token_ids[:c])
                if not np.array_equal(got, want):
                    bad = int(np.argmax(got != want))
                    raise AssertionError(f"KV of {req.request_id} differs at position {bad}: "
                                         f"{got[bad]} != {want[bad]}")
        errors = self.logits_hook(out) if self.logits_hook else None
        dt = self.cost.fixed + self.cost.per_token * n + self.cost.per_context_token * float(ctx.sum())
        return sampled, errors, dt


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
        step = packer.pack(out, scheduler.kv)
        sampled, errors, dt = executor.execute(out, step)
        clock.advance(dt)
        for req in scheduler.update_from_output(out, sampled, errors=errors, now=clock.now):
            if req.is_finished:
                finished[req.request_id] = req
        steps += 1
        if on_step is not None:
            on_step(scheduler, out)
    return SimResult(finished, steps, clock.now, scheduler.num_preemptions)
