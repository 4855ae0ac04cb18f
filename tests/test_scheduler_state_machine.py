"""A hypothesis state machine over the whole host side, driven as the engine drives it.

Scheduler (with its KVCacheManager) + BatchPacker + SimExecutor(check_kv=True): each `step` is
schedule -> pack -> execute -> update_from_output, as `sim.simulate` does; or, with async
scheduling (drawn), schedule -> pack -> execute -> advance, then `resolve` of the step before,
as the engine drives it when the host schedules step N+1 while step N runs. Rules add requests
(prompts sharing prefixes, n in 1..3, seeds, stop tokens, eos), abort requests in every state
(waiting, preempted, mid-prefill, decoding, swapped, a forked sample, a whole group by its id,
even mid-step), finish one early (a stop string), inject a non-finite-logits row, and step. The
pool, block size, budgets, seats, preemption mode, scheduling policy, prefix caching, chunked
prefill and allocation are drawn at the start, small enough that preemption is routine.

Checked after every rule (and after every step inside multi-step rules):
- the block invariants (pagedjax.benchmarks.soak.block_problems): every block null, free or owned, refcount
  == tables holding it, free + owned == num_blocks - 1, every cached hash names a block whose
  shadow content is the hash's tokens; host pool likewise; all free when nothing is unfinished;
- every computed token is where its block table says (device, or host when swapped);
- every request is in exactly one of waiting / running / swapped with a matching status, its
  blocks where that state says; finished ones in none; none lost;
- the step's token budget and seat limit; FCFS: waiting requests are admitted as a prefix of the
  queue, only when nothing was preempted and nothing waits swapped, running requests are served
  before any budget is left over, and a waiting head that was not admitted could not have been
  (no seat, no budget, not in the static batch, or too few free blocks, computed independently);
- every request's tokens so far are a prefix of the tokens it produces run alone with ample
  memory (`sim.run_alone`), and equal to them once it finishes on its own (aborted, errored and
  early-finished ones excluded). The teardown runs every example to completion.

Default: 200 examples of 50 rules each (a rule may run up to 32 steps; the teardown drains).
PAGEDJAX_DEEP=1 runs 10x as many examples (an env var rather than the `slow` marker, since
`make test` runs slow tests too).
"""

import logging
import os

import hypothesis.strategies as st
import numpy as np
import pytest
from hypothesis import HealthCheck, Phase, event, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedjax.config import EngineConfig
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.batch import BatchPacker
from pagedjax.scheduler.kv_cache_manager import cdiv
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import PLACEHOLDER, Request, RequestStatus
from pagedjax.scheduler.sim import SimExecutor, VirtualClock, run_alone
from pagedjax.benchmarks.soak import block_problems

DEEP = os.environ.get("PAGEDJAX_DEEP") == "1"
# pools here are small on purpose: the scheduler's "pool too small" / "swap space full" warnings
# are expected by the thousand
logging.getLogger("pagedjax.metrics").setLevel(logging.ERROR)
VOCAB = 16  # small, so sampled stop tokens and eos fire and generated tokens repeat prompt blocks
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9], [3] * 12, [1, 2, 3], []]
WAITING, RUNNING, PREEMPTED, SWAPPED = (RequestStatus.WAITING, RequestStatus.RUNNING,
                                        RequestStatus.PREEMPTED, RequestStatus.SWAPPED)
MAX_DRAIN_STEPS = 3000
# (prefix, tail, n, max_tokens, seed, stop_token_ids, eos_token_id, ignore_eos)
REQUEST = st.tuples(
    st.sampled_from(PREFIXES), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
    st.sampled_from([1, 2, 1, 3]), st.integers(1, 16).map(lambda x: 17 - x), st.integers(0, 2**63 - 1),
    # stop tokens and eos now and then: with VOCAB tokens they end a request within ~VOCAB steps
    st.one_of(st.none(), st.none(), st.none(), st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=2)),
    st.one_of(st.none(), st.none(), st.integers(0, VOCAB - 1)), st.booleans())
RARE = {"preempted", "swapped", "prefill", "sample", "group"}


def reservation_span(cfg, prompt_len: int, max_tokens: int) -> int:
    """Tokens one contiguous reservation covers, by Orca's policy names."""
    if cfg.contiguous_reserve in ("max", "max_model_len"):
        return cfg.max_model_len
    if cfg.contiguous_reserve == "pow2":
        return max(prompt_len + max_tokens, min(cfg.max_model_len, prompt_len + (1 << (max(max_tokens, 1) - 1).bit_length())))
    return prompt_len + max_tokens


class SchedulerMachine(RuleBasedStateMachine):
    # each sampled_from lists the pressing choices first (small pools, several seats, mid-sized
    # budgets): hypothesis shrinks towards them, so a minimal failing example stays under pressure
    @initialize(block_size=st.sampled_from([2, 1, 3, 4]), max_model_len=st.integers(20, 40),
                pool=st.sampled_from([1.0, 1.5, 1.2, 2.0, 0.8]), max_num_seqs=st.sampled_from([3, 4, 2, 5, 6]),
                budget=st.sampled_from([8, 3, 16, 1, 24]),
                mode=st.sampled_from(["swap", "recompute"]), scheduling=st.sampled_from(["continuous", "static"]),
                caching=st.booleans(), chunked=st.booleans(), host=st.one_of(st.none(), st.integers(0, 30)),
                allocation=st.sampled_from(["paged", "paged", "paged", "contiguous"]),
                reserve=st.sampled_from(["max", "oracle", "pow2", "max_model_len", "request"]),
                asynchronous=st.booleans(), initial=st.lists(REQUEST, min_size=2, max_size=8))
    def setup(self, block_size, max_model_len, pool, max_num_seqs, budget, mode, scheduling, caching,
              chunked, host, allocation, reserve, asynchronous, initial):
        # `pool` x one max_model_len sequence: from too small for the longest requests (refused
        # at the door) to two of them at a time, so preemption is routine
        num_blocks = max(2, round(pool * cdiv(max_model_len, block_size))) + 1
        if allocation == "contiguous":  # it reserves ahead by design: twice the pool, so n > 1 fits
            num_blocks = 2 * num_blocks - 1
        budget = max(budget, max_num_seqs) if chunked else max(budget, max_model_len)
        self.cfg = EngineConfig(
            block_size=block_size, num_blocks=num_blocks, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=budget, preemption_mode=mode, scheduling=scheduling,
            enable_prefix_caching=caching, enable_chunked_prefill=chunked, num_host_blocks=host,
            allocation=allocation, contiguous_reserve=reserve)
        self.clock = VirtualClock()
        self.sched = Scheduler(self.cfg, clock=self.clock)
        self.packer = BatchPacker(self.cfg)
        kv = self.sched.kv
        self.ex = SimExecutor(num_blocks, block_size, num_host_blocks=kv.host.num_blocks, vocab_size=VOCAB,
                              check_kv=True)
        self.known: dict[str, Request] = {}     # every accepted request and forked sample
        # ended by us (abort, error, stop string): id -> (status, output length then); these are
        # held to a prefix of the run alone, and nothing may be appended after the end
        self.ended: dict[str, tuple[RequestStatus, int]] = {}
        self.expected: dict[str, tuple[list[int], str]] = {}
        self.next_id = 0
        self.num_steps = 0
        self.asynchronous = asynchronous
        self.in_flight = None   # async: (out, sampled, errors) of the step whose tokens are not back
        event(f"setup: {'async' if asynchronous else 'sync'} scheduling")
        # every example starts with work (hypothesis' swarm testing may switch `add` off)
        self.add(initial)

    # -- helpers --------------------------------------------------------------------------------------
    def _want(self, req: Request) -> tuple[list[int], str]:
        if req.request_id not in self.expected:
            self.expected[req.request_id] = run_alone(req, self.cfg.max_model_len, VOCAB)
        return self.expected[req.request_id]

    def _refused(self, prompt, max_tokens, n) -> bool:
        cfg = self.cfg
        if not prompt or len(prompt) + max_tokens > cfg.max_model_len or n > cfg.max_num_seqs:
            return True
        if cfg.allocation == "contiguous":
            need = cdiv(reservation_span(cfg, len(prompt), max_tokens), cfg.block_size) * n
        else:
            need = cdiv(len(prompt) + max_tokens, cfg.block_size)
        return need > cfg.num_blocks - 1

    def _one_step(self, fault: str = "none", pick: int = 0) -> None:
        s = self.sched
        had_work = s.has_unfinished_requests()
        pre_waiting, pre_running, pre_swapped = list(s.waiting), list(s.running), list(s.swapped)
        out = s.schedule()
        for r in out.scheduled:
            if r.request_id not in self.known:  # a sample forked this step
                parent = self.known[r.group_id]
                group = [parent, *(self.known[c] for c in parent.children if c in self.known)]
                assert r.seed not in {m.seed for m in group}, f"{r.request_id} reuses a sibling's seed"
                self.known[r.request_id] = r
        self._check_step(out, pre_waiting, pre_running, pre_swapped)
        if had_work and self.in_flight is None:
            # every accepted request can run alone, so a step with work always schedules someone
            assert out.scheduled or out.preempted, "scheduler stalled with unfinished requests"
        if out.is_empty:
            self._resolve()
            return
        for what, happened in (("preempted", out.preempted), ("swapped out", out.swap_out),
                               ("swapped in", out.swap_in), ("copy-on-write", out.block_copies),
                               ("copies after the forward", out.block_copies_after),
                               ("prefix hit", out.prefix_hit_tokens), ("forked", 0 in out.num_new_tokens)):
            if happened:
                event(f"step: {what}{' (contiguous)' if self.cfg.allocation == 'contiguous' else ''}")
        step = self.packer.pack(out, s.kv)
        sampled, errors, _ = self.ex.execute(out, step)
        self.clock.advance(1.0)
        self.num_steps += 1
        if fault != "none":
            event(f"step: {fault} injected")
        if fault == "error":
            rows = [i for i, need in enumerate(out.needs_sample) if need]
            if rows:
                errors = np.zeros(out.num_rows, bool)
                errors[rows[pick % len(rows)]] = True
        elif fault == "abort":
            # an abort that lands while the step runs, in any state (just preempted or swapped
            # out by this step, too): update_from_output must skip a row it ended
            kind, rid = self._pick_abort(pick)
            if rid is not None:
                event(f"abort mid-step: {kind}")
                self._end(s.abort_request(rid))
        if self.asynchronous:
            s.advance(out)
            self._resolve()
            self.in_flight = (out, sampled, errors)
        else:
            self.in_flight = (out, sampled, errors)
            s.advance(out)
            self._resolve()

    def _resolve(self) -> None:
        """Take back the step in flight (async: the one before the step just launched)."""
        if self.in_flight is None:
            return
        out, sampled, errors = self.in_flight
        self.in_flight = None
        self.sched.resolve(out, sampled, errors=errors, now=self.clock.now)
        for row, req in enumerate(out.scheduled):
            if errors is not None and errors[row] and req.status == RequestStatus.FINISHED_ERROR:
                self._end([req], RequestStatus.FINISHED_ERROR)

    def _check_step(self, out, pre_waiting, pre_running, pre_swapped) -> None:
        s, cfg = self.sched, self.cfg
        kv = s.kv
        ids = [r.request_id for r in out.scheduled]
        assert len(set(ids)) == len(ids), f"a request scheduled twice in one step: {ids}"
        assert out.total_num_scheduled_tokens == sum(out.num_new_tokens) <= cfg.max_num_batched_tokens
        assert out.num_rows <= cfg.max_num_seqs
        assert sum(r.num_seats for r in s.running) <= cfg.max_num_seqs
        for row, (r, n) in enumerate(zip(out.scheduled, out.num_new_tokens)):
            assert r.status == RUNNING
            assert r.num_computed_tokens + n <= r.num_tokens
            if n == 0:  # only a sample forked this step, reading its parent's row
                assert r.sample_index > 0 and out.sample_from[row] != row
        scheduled, budget_left = set(ids), cfg.max_num_batched_tokens - out.total_num_scheduled_tokens

        # running requests first: one left unserved means the budget ran out
        for r in pre_running:
            if (r.status == RUNNING and r.request_id not in scheduled and r.num_computed_tokens < r.num_tokens
                    and not r.length_reached):  # (its pending token ends it)
                assert budget_left == 0, f"running {r.request_id} skipped with {budget_left} budget left"
        # swapped requests resume in FCFS order, and never in a step that preempts
        resumed = [r for r in pre_swapped if r.status == RUNNING]
        assert resumed == pre_swapped[:len(resumed)]
        assert not (resumed and out.preempted)
        # waiting requests are admitted as a prefix of the queue (no overtaking), only when
        # nothing was preempted and no swapped request waits to come back
        admitted = [r for r in pre_waiting if r.request_id in scheduled]
        assert admitted == pre_waiting[:len(admitted)], "a waiting request overtook an older one"
        if admitted:
            assert not out.preempted and not s.swapped
            if cfg.scheduling == "static":
                assert all(r.request_id in s.static_batch for r in admitted)
        # the head of the queue that was not admitted could not have been
        if not s.waiting or out.preempted or s.swapped or budget_left == 0:
            return
        head = s.waiting[0]
        if cfg.scheduling == "static" and head.request_id not in s.static_batch:
            assert s.running or any(r.request_id in s.static_batch for r in s.waiting), \
                "static: the batch finished but no new batch was formed"
            return
        if cfg.max_num_seqs - sum(r.num_seats for r in s.running) < head.num_seats:
            return
        assert head.num_computed_tokens == 0
        hits, num_hit = kv.get_computed_blocks(head)
        num_new = head.num_tokens - num_hit
        if not cfg.enable_chunked_prefill and num_new > budget_left:
            return
        total = num_hit + min(num_new, budget_left)
        bs = cfg.block_size
        if kv.contiguous:
            reserve = cdiv(reservation_span(cfg, head.num_prompt_tokens, head.max_tokens), bs)
            runs = [reserve] * (head.sampling_params.n if head.needs_fork and total >= head.num_prompt_tokens else 1)
            # each reservation is a run of consecutive free block ids, placed first fit
            free = sorted(b for b in range(1, kv.pool.num_blocks) if kv.pool.ref_cnt[b] == 0)
            holes: list[int] = []
            for i, b in enumerate(free):
                if i and free[i - 1] == b - 1:
                    holes[-1] += 1
                else:
                    holes.append(1)
            for n in runs:
                fit = next((i for i, h in enumerate(holes) if h >= n), None)
                if fit is None:
                    return
                holes[fit] -= n
            raise AssertionError(f"FCFS: waiting head {head.request_id} needed runs of {runs} blocks, free runs "
                                 f"{holes} after placing them, and was not admitted")
        # hits on free cached blocks take them out of the free queue too
        needed = cdiv(total, bs) - len(hits) + sum(kv.pool.ref_cnt[b] == 0 for b in hits)
        assert needed > kv.pool.num_free_blocks, (
            f"FCFS: waiting head {head.request_id} needed {needed} blocks, {kv.pool.num_free_blocks} "
            f"free, {budget_left} budget left, and was not admitted")

    def _check_all(self) -> None:
        s, cfg, kv = self.sched, self.cfg, self.sched.kv
        problems = block_problems(kv, self.ex)
        assert not problems, problems

        # every request in exactly one state, its blocks where that state says
        waiting = [r.request_id for r in s.waiting]
        running = [r.request_id for r in s.running]
        swapped = [r.request_id for r in s.swapped]
        every = waiting + running + swapped
        assert len(every) == len(set(every)) and set(every) == set(s.requests), "a request in two states or none"
        for r in s.waiting:
            assert r.status in (WAITING, PREEMPTED) and r.num_computed_tokens == 0
        assert all(r.status == RUNNING for r in s.running)
        assert all(r.status == SWAPPED for r in s.swapped)
        assert set(kv.req_to_blocks) == set(running) and set(kv.swapped) == set(swapped)
        assert set(s.seats) == set(running) and len(set(s.seats.values())) == len(s.seats)
        assert sum(r.num_seats for r in s.running) <= cfg.max_num_seqs
        # every queue in FCFS order: a preempted request goes back ahead of newer arrivals
        for name, q in (("waiting", s.waiting), ("running", s.running), ("swapped", s.swapped)):
            orders = [r.order for r in q]
            assert orders == sorted(orders), f"{name} is out of FCFS order: {[r.request_id for r in q]}"
        assert not kv._pending, "blocks left pending after the step committed"
        for rid, r in self.known.items():
            if r.is_finished:
                assert rid not in s.requests
            else:
                assert s.requests.get(rid) is r, f"{rid} lost: neither finished nor in the scheduler"

        # every computed token is where the block table says; paged tables hold exactly that
        bs = cfg.block_size
        for r in s.running:
            table = kv.req_to_blocks[r.request_id]
            self._check_content(r, table, self.ex.kv)
            if not kv.contiguous:
                assert kv.num_tokens_held[r.request_id] == r.num_computed_tokens
                assert len(table) == cdiv(r.num_computed_tokens, bs)
        for r in s.swapped:
            self._check_content(r, kv.swapped[r.request_id][0], self.ex.host)

        if not s.requests:
            assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1
            assert kv.host.num_free_blocks == kv.host.num_blocks and kv.usage().real_tokens == 0

        # tokens: a prefix of the run alone while going, equal to it when finished on its own
        for rid, r in self.known.items():
            want, reason = self._want(r)
            got = r.output_token_ids
            if rid in self.ended:
                assert (r.status, len(got)) == self.ended[rid], f"{rid} changed after it was ended"
            if r.is_finished and rid not in self.ended:
                assert (got, r.finish_reason) == (want, reason), \
                    f"{rid}: {got} {r.finish_reason} != alone {want} {reason}"
            else:
                assert got == want[:len(got)], f"{rid}: {got} is not a prefix of alone {want}"

    def _check_content(self, r, table, mem) -> None:
        bs, n = self.cfg.block_size, r.num_computed_tokens
        pos = np.arange(n)
        got = mem[np.asarray(table, np.int64)[pos // bs] * bs + pos % bs] if n else np.zeros(0, np.int64)
        want = r.all_token_ids[:n]
        if r.num_pending:  # a token still in flight is what the step in flight sampled for it
            out, sampled, _ = self.in_flight
            want = [int(sampled[r.pending_row]) if t == PLACEHOLDER else t for t in want]
            assert out.scheduled[r.pending_row] is r
        assert got.tolist() == want, f"{r.request_id}: KV content differs from its tokens"

    def _candidates(self) -> dict[str, list[str]]:
        s = self.sched
        kinds: dict[str, list[str]] = {}
        for r in s.requests.values():
            if r.status == RUNNING:
                kind = "prefill" if r.num_computed_tokens < r.num_prompt_tokens else "decode"
            else:
                kind = r.status.name.lower()
            kinds.setdefault(kind, []).append(r.request_id)
            if r.sample_index > 0:
                kinds.setdefault("sample", []).append(r.request_id)
                kinds.setdefault("group", []).append(r.group_id)  # the whole group, by its id
        if s.running:
            kinds["stop string"] = [r.request_id for r in s.running]
        kinds["gone"] = ["nope"] + [rid for rid, r in self.known.items() if r.is_finished
                                    and not any(m.group_id == rid for m in s.requests.values())]
        return {k: sorted(set(v)) for k, v in kinds.items()}

    def _end(self, reqs, status=RequestStatus.FINISHED_ABORTED) -> None:
        for r in reqs:
            self.ended[r.request_id] = (status, r.num_output_tokens)

    def _pick_abort(self, pick: int) -> tuple[str | None, str | None]:
        """A request to abort, from the rarest states present (preempted, swapped, mid-prefill,
        a sample, a group) when there are any, else from any state."""
        kinds = self._candidates()
        kinds.pop("gone"), kinds.pop("stop string", None)
        names = sorted(RARE & set(kinds)) or sorted(kinds)
        if not names:
            return None, None
        kind = names[pick % len(names)]
        return kind, kinds[kind][pick % len(kinds[kind])]

    # -- rules ----------------------------------------------------------------------------------------
    @rule(reqs=st.lists(REQUEST, min_size=1, max_size=3))
    def add(self, reqs):
        """A burst of 1-3 requests arriving together."""
        for prefix, tail, n, max_tokens, seed, stop, eos, ignore_eos in reqs:
            prompt = prefix + tail
            # mostly within max_model_len; an empty or too long prompt is refused at the door
            max_tokens = max(1, min(max_tokens, self.cfg.max_model_len - len(prompt)))
            rid = f"r{self.next_id}"
            self.next_id += 1
            req = Request(rid, prompt, SamplingParams(n=n, max_tokens=max_tokens, stop_token_ids=stop,
                                                      ignore_eos=ignore_eos),
                          arrival_time=self.clock.now, eos_token_id=eos, seed=seed)
            refused = self._refused(prompt, max_tokens, n)
            try:
                self.sched.add_request(req)
            except ValueError:
                assert refused, f"{rid} refused but fits: {len(prompt)} + {max_tokens} tokens, n={n}"
                event("add: refused")
                continue
            assert not refused, f"{rid} accepted but can never run: {len(prompt)} + {max_tokens} tokens, n={n}"
            self.known[rid] = req

    @rule(fault=st.sampled_from(["none"] * 4 + ["abort", "error"]), pick=st.integers(0, 7))
    def step(self, fault, pick):
        """One step; sometimes a row's logits turn non-finite, or an abort lands while it runs."""
        self._one_step(fault, pick)

    @rule(k=st.integers(1, 32), abort_after=st.one_of(st.none(), st.integers(0, 31)), pick=st.integers(0, 7))
    def steps(self, k, abort_after, pick):
        """k steps; optionally an abort between two of them, of a request in the rarest states
        present (preempted, swapped, mid-prefill, a sample, a group) when there are any."""
        for i in range(k):
            self._one_step()
            self._check_all()
            if i == abort_after:
                kind, rid = self._pick_abort(pick)
                if rid is not None:
                    event(f"abort between steps: {kind}")
                    self._end(self.sched.abort_request(rid))
                    self._check_all()

    # adds and steps outnumber aborts, so pools fill up and preemption is routine
    add_more, step_again, steps_again = add, step, steps

    @rule(data=st.data())
    def abort(self, data, only=None):
        """Abort a request in a state drawn from those present: waiting, preempted, mid-prefill,
        decoding, swapped, a forked sample, a whole group by its id; or end a running one on a
        stop string (finish_request); or abort an unknown or finished id (refused, no change)."""
        kinds = self._candidates()
        kind = data.draw(st.sampled_from(sorted(k for k in kinds if only is None or k in only)), label="kind")
        rid = data.draw(st.sampled_from(kinds[kind]), label="request")
        event(f"abort: {kind}")
        s = self.sched
        if kind == "gone":
            before = (len(s.requests), s.kv.num_free_blocks(), len(s.waiting), len(s.running), len(s.swapped))
            try:
                s.abort_request(rid)
            except ValueError as e:
                assert repr(rid) in str(e)
            else:
                raise AssertionError(f"abort of {rid!r} (not unfinished) was accepted")
            assert (len(s.requests), s.kv.num_free_blocks(), len(s.waiting), len(s.running), len(s.swapped)) == before
        elif kind == "stop string":
            self._end([s.requests[rid]], RequestStatus.FINISHED_STOPPED)
            s.finish_request(rid, RequestStatus.FINISHED_STOPPED, now=self.clock.now)
            assert rid not in s.kv.req_to_blocks
        else:
            members = {r.request_id for r in s.requests.values() if r.group_id == rid} or {rid}
            aborted = s.abort_request(rid)
            assert {r.request_id for r in aborted} == members
            assert all(r.status == RequestStatus.FINISHED_ABORTED for r in aborted)
            self._end(aborted)

    @precondition(lambda self: RARE & set(self._candidates()))
    @rule(data=st.data())
    def abort_rare(self, data):
        """The states a request passes through briefly get a rule of their own."""
        self.abort(data, only=RARE)

    def drain(self):
        """Run to completion: every request ends and every block comes back."""
        for _ in range(MAX_DRAIN_STEPS):
            if not self.sched.has_unfinished_requests():
                break
            self._one_step()
            self._check_all()
        self._resolve()
        self._check_all()
        assert not self.sched.has_unfinished_requests(), f"not drained in {MAX_DRAIN_STEPS} steps"

    @invariant()
    def invariants(self):
        if hasattr(self, "sched"):
            self._check_all()

    def teardown(self):
        if hasattr(self, "sched"):
            self.drain()
            event(f"steps run: {'<50' if self.num_steps < 50 else '<200' if self.num_steps < 200 else '>=200'}")


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(
    max_examples=2000 if DEEP else 200, stateful_step_count=50, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target, Phase.shrink])  # explain: minutes here


# -- the bugs this machine found, pinned ----------------------------------------------------------------
def _run(cfg: EngineConfig, reqs: list[Request], max_steps: int = 500) -> dict[str, Request]:
    """Step to completion with the sim (check_kv on); every request's tokens must be its run alone."""
    clock = VirtualClock()
    s = Scheduler(cfg, clock=clock)
    ex, packer = SimExecutor(cfg.num_blocks, cfg.block_size, vocab_size=VOCAB, check_kv=True), BatchPacker(cfg)
    for r in reqs:
        s.add_request(r)
    done = {}
    for _ in range(max_steps):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert out.scheduled, "scheduler stalled with unfinished requests"
        sampled, errors, _ = ex.execute(out, packer.pack(out, s.kv))
        done.update((r.request_id, r) for r in s.update_from_output(out, sampled, errors=errors) if r.is_finished)
    assert not s.has_unfinished_requests()
    for r in done.values():
        assert (r.output_token_ids, r.finish_reason) == tuple(run_alone(r, cfg.max_model_len, VOCAB))
    return done


def test_contiguous_samples_copy_the_prompt_after_the_step_writes_it():
    """A contiguous fork copies the parent's blocks in the step that computes the prompt's last
    chunk; copied before the forward pass, the samples' slabs missed that chunk."""
    cfg = EngineConfig(block_size=2, num_blocks=31, max_model_len=20, max_num_seqs=3, max_num_batched_tokens=4,
                       allocation="contiguous")
    done = _run(cfg, [Request("a", [1, 2, 3, 4, 5, 6, 7], SamplingParams(n=3, max_tokens=6, ignore_eos=True), seed=5)])
    assert set(done) == {"a", "a#1", "a#2"}


def test_static_batch_readmits_a_preempted_sample():
    """Forked samples were not members of their parent's static batch: one preempted headed the
    waiting queue as a non-member and nothing ever ran again."""
    cfg = EngineConfig(block_size=1, num_blocks=21, max_model_len=20, max_num_seqs=4, max_num_batched_tokens=20,
                       scheduling="static", enable_prefix_caching=False, enable_chunked_prefill=False)
    done = _run(cfg, [Request("A", [0], SamplingParams(n=3, max_tokens=8), seed=0),
                      Request("B", [0], SamplingParams(max_tokens=6), seed=0)])
    assert set(done) == {"A", "A#1", "A#2", "B"}


def test_recompute_victim_goes_back_in_fcfs_order():
    """With the host swap space full, victims fall back to recompute; a newer sample that had been
    swapped out resumes, runs and is preempted again, and must queue behind its older sibling."""
    cfg = EngineConfig(block_size=3, num_blocks=11, max_model_len=20, max_num_seqs=4, max_num_batched_tokens=20,
                       preemption_mode="swap", num_host_blocks=3, enable_prefix_caching=False,
                       enable_chunked_prefill=False)
    clock = VirtualClock()
    s = Scheduler(cfg, clock=clock)
    ex, packer = SimExecutor(11, 3, num_host_blocks=3, vocab_size=VOCAB, check_kv=True), BatchPacker(cfg)
    s.add_request(Request("r0", [1, 2, 3, 4, 5, 6, 9, 9, 9, 9, 9, 0], SamplingParams(max_tokens=8), seed=0))
    s.add_request(Request("r1", [1, 2, 3, 4, 5, 6, 7, 8, 0], SamplingParams(n=3, max_tokens=11), seed=0))
    while s.has_unfinished_requests():
        out = s.schedule()
        orders = [r.order for r in s.waiting]
        assert orders == sorted(orders), [r.request_id for r in s.waiting]
        sampled, _, _ = ex.execute(out, packer.pack(out, s.kv))
        s.update_from_output(out, sampled)
    assert s.num_preemptions > 0


def test_sample_ids_are_reserved():
    """'p#1' names sample 1 of an n > 1 request 'p': a request of that name added by hand shared
    the sample's block table once 'p' forked."""
    s = Scheduler(EngineConfig(num_blocks=64, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                               max_model_len=64))
    s.add_request(Request("p", [1, 2, 3], SamplingParams(n=2, max_tokens=4)))
    with pytest.raises(ValueError, match=r"request_id 'p#1' must not contain '#'"):
        s.add_request(Request("p#1", [4, 5, 6], SamplingParams(max_tokens=4)))
