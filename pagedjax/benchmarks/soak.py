"""The soak: thousands of requests through the scheduler and the sim executor, under a pool small
enough to force preemption, with a share of them aborted at random moments (no JAX); then
hundreds through the real engine with the tiny random model (`soak_engine`, which imports JAX
when called).

It checks the promises that matter under pressure:
- nothing is lost: every sequence (each of a request's n samples) ends finished, aborted or errored;
- no block leaks: device and host pools are all free at the end, and the block invariants hold;
- preemption changes nothing: every sequence that finished on its own (stop or length) has the
  tokens and finish reason of the same requests run with ample memory (no preemption at all).

`block_problems(kv, executor)` states the block invariants as a list of violations; the
scheduler state-machine test checks them after every rule.
"""

from __future__ import annotations

import heapq
import logging
import random
import time
from collections import Counter
from dataclasses import dataclass

import numpy as np

from pagedjax.config import EngineConfig
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.kv_cache_manager import KVCacheManager, cdiv
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request, RequestStatus
from pagedjax.scheduler.sim import SimExecutor, VirtualClock, simulate

VOCAB = 500


def block_problems(kv: KVCacheManager, executor: SimExecutor | None = None) -> list[str]:
    """Every violated block invariant, in words (empty: all hold). With the sim executor, every
    cached hash must also name a block whose shadow content is the hash's tokens."""
    pool, bs = kv.pool, kv.block_size
    problems = []
    holders = [0] * pool.num_blocks
    for rid, table in kv.req_to_blocks.items():
        if len(set(table)) != len(table):
            problems.append(f"{rid} holds a block twice: {table}")
        for b in table:
            holders[b] += 1
    if holders[0] or pool.ref_cnt[0] or 0 in pool.free_queue:
        problems.append("the null block 0 was handed out")
    owned = 0
    for b in range(1, pool.num_blocks):
        ref, free = pool.ref_cnt[b], b in pool.free_queue
        owned += ref > 0
        if ref != holders[b]:
            problems.append(f"block {b}: refcount {ref} but {holders[b]} tables hold it")
        if free == (ref > 0):
            problems.append(f"block {b}: refcount {ref} and {'in' if free else 'not in'} the free queue")
    if pool.num_free_blocks + owned != pool.num_blocks - 1:
        problems.append(f"free {pool.num_free_blocks} + owned {owned} != {pool.num_blocks - 1} usable blocks")
    for h, b in pool.cached.items():
        if pool.block_hash[b] != h or len(h.token_ids) != bs:
            problems.append(f"block {b}: cached under a hash it does not carry (or not a full block)")
        elif executor is not None:
            content = executor.kv[b * bs:(b + 1) * bs].tolist()
            if content != list(h.token_ids):
                problems.append(f"block {b}: cached as {list(h.token_ids)} but holds {content}")
    for b, h in enumerate(pool.block_hash):
        if h is not None and pool.cached.get(h) != b:
            problems.append(f"block {b} carries a hash the map does not point back from")
    host = kv.host
    host_holders = [0] * host.num_blocks
    for table, _ in kv.swapped.values():
        for h in table:
            host_holders[h] += 1
    if host_holders != host.ref_cnt:
        problems.append("host refcounts differ from the swapped tables")
    if sorted(host.free_ids) != [h for h in range(host.num_blocks) if host.ref_cnt[h] == 0]:
        problems.append("host free list differs from the host blocks with refcount 0")
    if set(kv.req_to_blocks) & set(kv.swapped):
        problems.append("a request holds device blocks while swapped out")
    return problems


def blocks_held(kv: KVCacheManager) -> int:
    """Device plus host blocks some request still holds."""
    return kv.pool.num_used_blocks + kv.host.num_blocks - kv.host.num_free_blocks


# -- workload -----------------------------------------------------------------------------------------
def soak_requests(num_requests: int, seed: int = 0, *, max_model_len: int = 512,
                  mean_gap: float = 0.03) -> list[Request]:
    """Poisson arrivals; prompts share one of a few system prompts (so prefix hits meet
    preemption) plus a tail of their own; n is 1, 2 or 3; some have stop tokens or an eos.
    The same seed gives the same requests (fresh objects)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(VOCAB) for _ in range(n)] for n in (0, 24, 40, 100)]
    reqs, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(1 / mean_gap)
        prompt = rng.choice(systems) + [rng.randrange(VOCAB) for _ in range(1 + min(150, int(rng.expovariate(1 / 40))))]
        max_tokens = min(1 + min(200, int(rng.expovariate(1 / 40))), max_model_len - len(prompt))
        stop = [rng.randrange(VOCAB) for _ in range(rng.randint(1, 3))] if rng.random() < 0.2 else None
        eos = rng.randrange(VOCAB) if rng.random() < 0.3 else None
        params = SamplingParams(n=rng.choices((1, 2, 3), (90, 7, 3))[0], max_tokens=max_tokens,
                                stop_token_ids=stop, ignore_eos=rng.random() < 0.2)
        reqs.append(Request(f"r{i}", prompt, params, arrival_time=t, eos_token_id=eos,
                            seed=rng.randrange(2**63)))
    return reqs


@dataclass
class SoakSetup:
    num_blocks: int = 128          # 127 usable blocks of 8 tokens for up to 32 sequences: preemption
    block_size: int = 8
    max_num_seqs: int = 32
    max_num_batched_tokens: int = 256
    max_model_len: int = 512

    def config(self, preemption_mode: str = "recompute", num_blocks: int | None = None) -> EngineConfig:
        return EngineConfig(block_size=self.block_size, num_blocks=num_blocks or self.num_blocks,
                            max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                            max_model_len=self.max_model_len, preemption_mode=preemption_mode)

    @property
    def ample_num_blocks(self) -> int:
        """Every seat at max_model_len at once: no request is ever preempted."""
        return self.max_num_seqs * cdiv(self.max_model_len, self.block_size) + 1


def _sim(cfg: EngineConfig, check_kv: bool) -> tuple[Scheduler, SimExecutor, VirtualClock]:
    clock = VirtualClock()
    sched = Scheduler(cfg, clock=clock)
    sched.metrics.record_occupancy = False
    host = cfg.num_blocks if cfg.preemption_mode == "swap" else 0
    return sched, SimExecutor(cfg.num_blocks, cfg.block_size, num_host_blocks=host, vocab_size=VOCAB,
                              check_kv=check_kv), clock


def ample_run(num_requests: int, seed: int = 0, setup: SoakSetup | None = None,
              check_kv: bool = False) -> dict:
    """The reference: the same requests, no aborts, a pool no schedule can exhaust.
    Returns {"outputs": {id: (tokens, finish reason)}, "preemptions", "steps", "wall_s"}."""
    setup = setup or SoakSetup()
    sched, executor, clock = _sim(setup.config(num_blocks=setup.ample_num_blocks), check_kv)
    t0 = time.perf_counter()
    res = simulate(sched, executor, soak_requests(num_requests, seed, max_model_len=setup.max_model_len), clock)
    return {"outputs": {k: (tuple(r.output_token_ids), r.finish_reason) for k, r in res.finished.items()},
            "preemptions": res.preemptions, "steps": res.num_steps, "wall_s": time.perf_counter() - t0,
            "unfinished": sched.num_unfinished}


def _state(req: Request) -> str:
    if req.status == RequestStatus.RUNNING:
        return "running (prefill)" if req.num_computed_tokens < req.num_prompt_tokens else "running (decode)"
    return req.status.name.lower()


def run_soak(num_requests: int = 10_000, preemption_mode: str = "recompute", *, seed: int = 0,
             abort_rate: float = 0.05, error_rate: float = 0.0, max_abort_delay: int = 60,
             setup: SoakSetup | None = None, check_kv: bool = False, reference: dict | None = None) -> dict:
    """One soak in one preemption mode. `abort_rate` of the requests (whole groups, by the id
    they were submitted under) are aborted at a random step, in whatever state they are in then;
    each sampled token has an `error_rate` chance of non-finite logits (the sim's logits hook).
    Returns the counts and checks as a dict; `ok` says whether all hold."""
    setup = setup or SoakSetup()
    if reference is None:
        reference = ample_run(num_requests, seed, setup, check_kv)
    cfg = setup.config(preemption_mode)
    sched, executor, clock = _sim(cfg, check_kv)
    reqs = soak_requests(num_requests, seed, max_model_len=setup.max_model_len)

    # half the targets are aborted 0..max_abort_delay steps after they reach the scheduler
    # (mostly while waiting), half that long after they are first scheduled (running, preempted,
    # swapped); both clocks start in FCFS order, so each queue is served from its front
    rng = random.Random(seed + 1)
    targets = sorted(rng.sample(range(num_requests), round(abort_rate * num_requests)))
    delays = {reqs[i].request_id: rng.randint(0, max_abort_delay) for i in targets}
    from_arrival, from_start = [], []
    for i in targets:
        (from_arrival if rng.random() < 0.5 else from_start).append(reqs[i])
    due: list[tuple[int, str]] = []
    aborted: dict[str, Request] = {}
    abort_states: Counter = Counter()

    if error_rate:
        err_rng = np.random.default_rng(seed + 2)
        executor.logits_hook = lambda out: (err_rng.random(out.num_rows) < error_rate) & np.asarray(out.needs_sample)

    def on_step(s: Scheduler, out) -> None:
        for queue, started in ((from_arrival, lambda r: r.request_id in s.requests),
                               (from_start, lambda r: r.times.first_scheduled is not None)):
            while queue and (queue[0].is_finished or started(queue[0])):
                r = queue.pop(0)
                heapq.heappush(due, (s.step_counter + delays[r.request_id], r.request_id))
        while due and due[0][0] <= s.step_counter:
            _, rid = heapq.heappop(due)
            live = [r for r in s.requests.values() if r.group_id == rid]
            if live:
                abort_states.update(_state(r) for r in live)
                for r in s.abort_request(rid):
                    aborted[r.request_id] = r

    t0 = time.perf_counter()
    exception = None
    try:
        res = simulate(sched, executor, reqs, clock, on_step=on_step)
        finished, steps = res.finished, res.num_steps
    except Exception as e:  # a stall or a broken invariant: report it, the checks below fail
        exception, finished, steps = f"{type(e).__name__}: {e}", {}, sched.step_counter
    wall = time.perf_counter() - t0

    # every sequence that ever existed: the submitted parents and every child they forked
    sequences = {r.request_id: r for r in reqs}
    for r in [*reqs, *finished.values(), *aborted.values(), *sched.requests.values()]:
        sequences.setdefault(r.request_id, r)
        for c in r.children:
            sequences.setdefault(c, finished.get(c) or aborted.get(c) or sched.requests.get(c))
    reasons = Counter(r.finish_reason if r is not None and r.is_finished else "lost" for r in sequences.values())
    # a group that ran its prompt to the end on its own must have all n samples
    missing = sum(r.sampling_params.n - 1 - len(r.children) for r in reqs
                  if r.finish_reason in ("stop", "length") and r.sampling_params.n > 1)
    lost = reasons["lost"] + missing

    want = reference["outputs"]
    compared = mismatches = 0
    for rid, r in sequences.items():
        if r is not None and r.finish_reason in ("stop", "length"):
            compared += 1
            mismatches += want.get(rid) != (tuple(r.output_token_ids), r.finish_reason)

    problems = block_problems(sched.kv, executor)
    leaked = blocks_held(sched.kv)
    result = {
        "mode": preemption_mode, "requests": num_requests, "sequences": len(sequences),
        "finished": reasons["stop"] + reasons["length"], "abort_requested": len(targets), "aborted": reasons["abort"],
        "errored": reasons["error"], "lost": lost, "blocks_leaked": leaked,
        "preemptions": sched.num_preemptions, "steps": steps, "wall_s": round(wall, 3),
        "virtual_s": round(clock.now, 3), "abort_states": dict(abort_states),
        "tokens_compared": compared, "token_mismatches": mismatches,
        "tokens_match_ample": mismatches == 0 and compared > 0,
        "ample_preemptions": reference["preemptions"], "block_problems": problems[:10],
        "exception": exception, "pool": {"num_blocks": cfg.num_blocks, "block_size": cfg.block_size,
                                         "max_num_seqs": cfg.max_num_seqs},
    }
    result["ok"] = (exception is None and lost == 0 and leaked == 0 and not problems
                    and result["tokens_match_ample"] and reference["preemptions"] == 0
                    and reference["unfinished"] == 0)
    return result


def quiet_preemption_warnings() -> None:
    """The soak forces preemption on purpose: the scheduler's 'pool too small' warning is expected."""
    logging.getLogger("pagedjax.metrics").setLevel(logging.ERROR)


# -- the real engine ------------------------------------------------------------------------------------
@dataclass
class EngineSoakSetup:
    """The tiny random model under a pool that forces preemption: 23 usable blocks of 8 tokens
    for 8 seats of up to 128 tokens (one max_model_len request needs 16). Small buckets keep the
    warm-up short (9 step shapes per pool size); engines of the same shapes share their compiled
    steps, so the second preemption mode compiles only its swap functions."""

    num_blocks: int = 24
    block_size: int = 8
    max_num_seqs: int = 8
    max_num_batched_tokens: int = 32
    max_model_len: int = 128
    token_buckets: tuple[int, ...] = (8, 16, 32)
    page_buckets: tuple[int, ...] = (4, 8, 16)
    weight_scale: float = 7.5     # N(0, 0.02) -> N(0, 0.15): see `engine_for_soak`

    def kwargs(self, preemption_mode: str = "recompute", num_blocks: int | None = None) -> dict:
        return dict(num_blocks=num_blocks or self.num_blocks, block_size=self.block_size,
                    max_num_seqs=self.max_num_seqs, max_num_batched_tokens=self.max_num_batched_tokens,
                    max_model_len=self.max_model_len, token_buckets=self.token_buckets,
                    page_buckets=self.page_buckets, preemption_mode=preemption_mode)

    @property
    def ample_num_blocks(self) -> int:
        return self.max_num_seqs * cdiv(self.max_model_len, self.block_size) + 1


def engine_for_soak(setup: EngineSoakSetup, preemption_mode: str = "recompute", num_blocks: int | None = None,
                    warmup: bool = True):
    """LLMEngine("tiny-random") with its matrices scaled by `setup.weight_scale`. At HF's init
    (std 0.02) the tiny model's greedy continuation repeats one token whatever the context, so
    a cache that preemption had corrupted would still give the same tokens (swap-ins that do
    nothing pass unnoticed there); at std 0.15 (as tests/engine_helpers.make_tiny_hf) greedy
    tokens depend on the whole context and the same fault changes most swapped requests' tokens."""
    import jax

    from pagedjax.engine import LLMEngine
    from pagedjax.model.hub import load_any_model

    model = load_any_model("tiny-random", "float32", 0)  # the weights LLMEngine("tiny-random") draws (seed 0)
    if setup.weight_scale != 1:
        scale = setup.weight_scale
        model = model._replace(params=jax.tree_util.tree_map_with_path(
            lambda path, p: p if "norm" in jax.tree_util.keystr(path) else p * scale, model.params))
    eng = LLMEngine(model, **setup.kwargs(preemption_mode, num_blocks))
    if warmup:
        eng.warmup()
    return eng


def engine_soak_requests(num_requests: int, seed: int = 0, *, max_model_len: int = 128,
                         vocab_size: int = 384) -> list[tuple[str, list[int], object]]:
    """(request id, prompt token ids, greedy SamplingParams) in random arrival order: prompts of
    1 to ~110 tokens, about a third of them after one of a few shared system prompts (prefix hits meet
    preemption), max_tokens 1 to 64, a fifth with ignore_eos."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab_size) for _ in range(n)] for n in (16, 24, 40)]
    out = []
    for i in range(num_requests):
        prefix = rng.choice(systems) if rng.random() < 0.35 else []
        tail = [rng.randrange(3, vocab_size) for _ in range(1 + min(70, int(rng.expovariate(1 / 25))))]
        prompt = (prefix + tail)[:max_model_len - 8]
        max_tokens = min(rng.randint(1, 64), max_model_len - len(prompt))
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=rng.random() < 0.2)
        out.append((f"e{i}", prompt, params))
    rng.shuffle(out)
    return out


def _drain(eng, outputs: dict, max_steps: int) -> int:
    steps = 0
    while eng.has_unfinished_requests() and steps < max_steps:
        for o in eng.step():
            if o.finished:
                outputs[o.request_id] = (tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason)
        steps += 1
    return steps


def engine_ample_run(num_requests: int, seed: int = 0, setup: EngineSoakSetup | None = None) -> dict:
    """The reference: the same requests on an engine whose pool holds every seat at
    max_model_len (no preemption), all added at once, no aborts."""
    setup = setup or EngineSoakSetup()
    t0 = time.perf_counter()
    eng = engine_for_soak(setup, num_blocks=setup.ample_num_blocks)
    warm = time.perf_counter() - t0
    t0 = time.perf_counter()
    for rid, prompt, params in engine_soak_requests(num_requests, seed, max_model_len=setup.max_model_len):
        eng.add_request(rid, {"prompt_token_ids": prompt}, params)
    outputs: dict = {}
    steps = _drain(eng, outputs, max_steps=200 * num_requests)
    return {"outputs": outputs, "preemptions": eng.scheduler.num_preemptions, "steps": steps,
            "wall_s": time.perf_counter() - t0, "warmup_s": warm,
            "unfinished": eng.get_num_unfinished_requests()}


def soak_engine(num_requests: int = 500, preemption_mode: str = "recompute", *, seed: int = 0,
                abort_rate: float = 0.05, max_abort_delay: int = 40, mean_arrivals_per_step: float = 0.3,
                setup: EngineSoakSetup | None = None, reference: dict | None = None) -> dict:
    """The soak on the real engine (LLMEngine.add_request / step / abort_request, the jitted step
    of the tiny random model), greedy: requests arrive a few at a time in random order into a
    pool that forces preemption; `abort_rate` of them are aborted 0..max_abort_delay steps after
    they arrive or after they are first scheduled, in whatever state they are in then. Returns
    the keys of `run_soak` (with `ok`); every request that finished on its own must have the
    tokens and finish reason it has in `reference` (`engine_ample_run`)."""
    setup = setup or EngineSoakSetup()
    if reference is None:
        reference = engine_ample_run(num_requests, seed, setup)
    t0 = time.perf_counter()
    eng = engine_for_soak(setup, preemption_mode)
    warm = time.perf_counter() - t0
    sched = eng.scheduler
    pending = engine_soak_requests(num_requests, seed, max_model_len=setup.max_model_len)
    pending.reverse()  # pop() from the end: the first in arrival order comes first
    rng = random.Random(seed + 1)
    targets = sorted(rng.sample([rid for rid, _, _ in pending], round(abort_rate * num_requests)))
    # half the targets are aborted 0..max_abort_delay steps after they arrive (mostly while
    # waiting), half that long after they are first scheduled (running, preempted, swapped)
    from_start = {rid for rid in targets if rng.random() < 0.5}
    from_arrival = set(targets) - from_start
    started: list[str] = []  # accepted from_start targets not yet scheduled
    due: list[tuple[int, str]] = []
    accepted: set[str] = set()
    refused: dict[str, str] = {}
    outputs: dict[str, tuple] = {}
    aborted: set[str] = set()
    abort_states: Counter = Counter()
    steps = 0
    max_steps = 200 * num_requests
    exception = None
    t0 = time.perf_counter()
    try:
        while (pending or eng.has_unfinished_requests()) and steps < max_steps:
            # a few arrivals at a time (at least one when the engine would idle)
            k = min(len(pending), int(rng.random() < mean_arrivals_per_step / 2) * rng.randint(1, 3))
            if not k and pending and not eng.has_unfinished_requests():
                k = 1
            for _ in range(k):
                rid, prompt, params = pending.pop()
                try:
                    eng.add_request(rid, {"prompt_token_ids": prompt}, params)
                except ValueError as e:
                    refused[rid] = str(e)
                    continue
                accepted.add(rid)
                if rid in from_start:
                    started.append(rid)
                elif rid in from_arrival:
                    heapq.heappush(due, (steps + rng.randint(0, max_abort_delay), rid))
            for rid in [r for r in started if r in outputs or sched.requests[r].times.first_scheduled is not None]:
                started.remove(rid)
                heapq.heappush(due, (steps + rng.randint(0, max_abort_delay), rid))
            while due and due[0][0] <= steps:
                _, rid = heapq.heappop(due)
                if rid in outputs:
                    continue  # finished before its abort came
                abort_states[_state(sched.requests[rid])] += 1
                eng.abort_request(rid)
                aborted.add(rid)
            for o in eng.step():
                if o.finished:
                    outputs[o.request_id] = (tuple(o.outputs[0].token_ids), o.outputs[0].finish_reason)
            steps += 1
    except Exception as e:  # report it: the checks below fail
        exception = f"{type(e).__name__}: {e}"
    wall = time.perf_counter() - t0

    reasons = Counter(reason for _, reason in outputs.values())
    ended = set(outputs) | aborted
    lost = len(accepted - ended) + len(pending) + len(refused)
    want = reference["outputs"]
    compared = mismatches = 0
    for rid, got in outputs.items():
        if got[1] in ("stop", "length"):
            compared += 1
            mismatches += want.get(rid) != got
    kv = sched.kv
    problems = block_problems(kv)
    leaked = kv.usage().used_blocks + kv.host.num_blocks - kv.host.num_free_blocks
    result = {
        "mode": preemption_mode, "requests": num_requests, "sequences": num_requests,
        "finished": reasons["stop"] + reasons["length"], "abort_requested": len(targets), "aborted": len(aborted),
        "errored": reasons["error"], "lost": lost, "refused": refused, "blocks_leaked": leaked,
        "preemptions": sched.num_preemptions, "steps": steps, "wall_s": round(wall, 3),
        "warmup_s": round(warm, 3), "virtual_s": None, "abort_states": dict(abort_states),
        "tokens_compared": compared, "token_mismatches": mismatches,
        "tokens_match_ample": mismatches == 0 and compared > 0,
        "tokens_generated": sum(len(t) for t, _ in outputs.values()),
        "ample_preemptions": reference["preemptions"], "ample_wall_s": round(reference["wall_s"], 3),
        "block_problems": problems[:10], "exception": exception,
        "unfinished": eng.get_num_unfinished_requests() + len(sched.requests),
        "pool": {"num_blocks": setup.num_blocks, "block_size": setup.block_size,
                 "max_num_seqs": setup.max_num_seqs},
    }
    result["ok"] = (exception is None and lost == 0 and leaked == 0 and not problems and result["unfinished"] == 0
                    and result["tokens_match_ample"] and sched.num_preemptions > 0
                    and reference["preemptions"] == 0 and reference["unfinished"] == 0)
    return result
