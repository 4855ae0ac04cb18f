"""The PagedAttention paper's evaluation, replayed through the real scheduler and allocators.

Workloads with the paper's length statistics, a serving simulator that runs the real `Scheduler`
and `KVCacheManager` in virtual time under a `StepCostModel`, and the measurements behind the
paper's figures (`scripts/reproduce_paper.py` draws them):

    sharegpt_fitted, alpaca_fitted   lognormal lengths fitted to the published means (ShareGPT:
                                     input 161.31, output 337.99 tokens; Alpaca: 19.31 and 58.45);
                                     fitted distributions, not the datasets (which need a download)
    load_lengths_jsonl               lengths or texts of a real dataset, for whoever has it
    simulate_serving                 one request list through one system in virtual time: vLLM's
                                     serving metrics, and per step the KV memory breakdown
    SYSTEMS                          paged (continuous batching, paged KV) and Orca (Max / Pow2 /
                                     Oracle): continuous batching with contiguous reservations

Memory breakdown (the paper's Figure 2), per step, of the KV pool's slots: real tokens; slots
reserved that the request will still fill ("reserved"); slots it will never fill: the over-
reservation of a contiguous policy and the unfilled tail of the last block ("internal
fragmentation"); free slots that the next waiting request cannot use because no run of free
blocks is long enough for its reservation ("external fragmentation"); and free slots.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pagedjax.benchmarks.serving import BenchRequest, kv_metrics, poisson_arrivals, serving_metrics
from pagedjax.config import EngineConfig
from pagedjax.metrics import shape_of
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.batch import BatchPacker
from pagedjax.scheduler.kv_cache_manager import cdiv
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request
from pagedjax.scheduler.sim import SimExecutor, VirtualClock, simulate

# -- workloads --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LengthDistribution:
    """Lognormal token counts, rounded and clipped to [lo, hi], with `mean` after clipping."""

    mean: float
    sigma: float
    lo: int
    hi: int

    def mu(self) -> float:
        """The lognormal's mu giving `mean` after rounding and clipping (bisection on a fixed sample)."""
        z = np.random.default_rng(0).standard_normal(200_000)
        lo_mu, hi_mu = math.log(max(self.lo, 1)) - 3, math.log(self.hi) + 3
        for _ in range(60):
            mid = (lo_mu + hi_mu) / 2
            if np.clip(np.rint(np.exp(mid + self.sigma * z)), self.lo, self.hi).mean() < self.mean:
                lo_mu = mid
            else:
                hi_mu = mid
        return (lo_mu + hi_mu) / 2

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        x = np.exp(self.mu() + self.sigma * rng.standard_normal(n))
        return np.clip(np.rint(x), self.lo, self.hi).astype(np.int64)


# The paper's Figure 11 gives each dataset's means; the spreads (sigma) are chosen so the shapes
# look like its histograms: ShareGPT long-tailed in both directions, Alpaca's instructions short.
# Requests are kept within OPT's 2,048-token context, as the paper filters them.
FITTED = {
    "sharegpt": (LengthDistribution(161.31, 1.0, 4, 1024), LengthDistribution(337.99, 0.9, 4, 1024)),
    "alpaca": (LengthDistribution(19.31, 0.5, 4, 256), LengthDistribution(58.45, 0.9, 2, 512)),
}
# translation with a shared few-shot prefix (the paper's Figure 16, LLaMA-13B on WMT16 En-De):
# one-shot and five-shot prefixes of 80 and 341 tokens; sentence lengths assumed ~30 tokens
PREFIXES = {"one-shot": 80, "five-shot": 341}
SENTENCE = LengthDistribution(30.0, 0.45, 4, 128)


def fitted_lengths(name: str, n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(input lengths, output lengths) of `n` requests from the fitted `name` distribution."""
    if name not in FITTED:
        raise ValueError(f"fitted workload must be one of {tuple(FITTED)}, got {name!r}")
    rng = np.random.default_rng([seed, 19])
    inp, out = FITTED[name]
    return inp.sample(rng, n), out.sample(rng, n)


def load_lengths_jsonl(path: str, tokenizer=None, limit: int | None = None) -> list[tuple[int, int]]:
    """(input, output) token counts from a JSONL file, one request per line, as any of:
    {"input_len": 161, "output_len": 338} (or prompt_len / output_len);
    {"prompt": "...", "output": "..."} (or "completion" / "response"), counted with `tokenizer`;
    a ShareGPT record {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}
    (its first turn pair); an Alpaca record {"instruction", "input", "output"}."""
    def count(text: str) -> int:
        if tokenizer is None:
            raise ValueError(f"{path}: a line holds text; pass a tokenizer to count its tokens")
        return len(tokenizer.encode(text))

    out = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            rec = json.loads(line)
            if "input_len" in rec or "prompt_len" in rec:
                pair = (int(rec.get("input_len", rec.get("prompt_len"))), int(rec["output_len"]))
            elif "conversations" in rec:
                turns = rec["conversations"]
                if len(turns) < 2:
                    continue
                pair = (count(turns[0]["value"]), count(turns[1]["value"]))
            elif "instruction" in rec:
                pair = (count(rec["instruction"] + ("\n" + rec["input"] if rec.get("input") else "")),
                        count(rec["output"]))
            else:
                text_out = rec.get("output", rec.get("completion", rec.get("response")))
                if "prompt" not in rec or text_out is None:
                    raise ValueError(f"{path}:{lineno}: expected input_len/output_len, prompt/output, "
                                     f"conversations or instruction/output, got keys {sorted(rec)}")
                pair = (count(rec["prompt"]), count(text_out))
            if pair[0] >= 1 and pair[1] >= 1:
                out.append(pair)
            if limit and len(out) >= limit:
                break
    if not out:
        raise ValueError(f"{path}: no request with input and output of at least one token")
    return out


def requests_from_lengths(inputs: Sequence[int], outputs: Sequence[int], *, request_rate: float = math.inf,
                          seed: int = 0, vocab_size: int = 50_000, prefix_len: int = 0,
                          name: str = "req") -> list[BenchRequest]:
    """Requests of these lengths (random token ids; a shared prefix of `prefix_len` tokens before
    each input), arriving as a Poisson process at `request_rate`."""
    rng = np.random.default_rng([seed, 7])
    prefix = rng.integers(100, vocab_size, prefix_len).tolist()
    arrivals = poisson_arrivals(np.random.default_rng([seed, 99]), len(inputs), request_rate)
    return [BenchRequest(f"{name}-{i}", tuple(prefix + rng.integers(100, vocab_size, int(p)).tolist()), int(o),
                         float(a)) for i, (p, o, a) in enumerate(zip(inputs, outputs, arrivals))]


def paper_workload(name: str, n: int, request_rate: float = math.inf, seed: int = 0) -> list[BenchRequest]:
    """'sharegpt' / 'alpaca' (fitted lengths) or 'one-shot' / 'five-shot' (shared prefix + a
    sentence, output a sentence)."""
    if name in PREFIXES:
        rng = np.random.default_rng([seed, 16])
        return requests_from_lengths(SENTENCE.sample(rng, n), SENTENCE.sample(rng, n), request_rate=request_rate,
                                     seed=seed, prefix_len=PREFIXES[name], name=name)
    inputs, outputs = fitted_lengths(name, n, seed)
    return requests_from_lengths(inputs, outputs, request_rate=request_rate, seed=seed, name=name)


# -- systems and the simulator -----------------------------------------------------------------------
SYSTEMS = {
    "paged": {},
    "orca-oracle": {"allocation": "contiguous", "contiguous_reserve": "oracle"},
    "orca-pow2": {"allocation": "contiguous", "contiguous_reserve": "pow2"},
    "orca-max": {"allocation": "contiguous", "contiguous_reserve": "max"},
}
LABELS = {"paged": "pagedjax (paged)", "orca-oracle": "Orca (Oracle)", "orca-pow2": "Orca (Pow2)",
          "orca-max": "Orca (Max)"}
BREAKDOWN = ("real", "reserved", "internal", "external", "free")


def memory_breakdown(sched: Scheduler) -> dict[str, int]:
    """This moment's KV pool, in token slots, split as the module docstring says."""
    kv = sched.kv
    bs = kv.block_size
    u = kv.usage()
    internal = u.allocated_slots - u.real_tokens - u.reserved_for_future
    free = (kv.pool.num_blocks - 1) * bs - u.allocated_slots
    external = 0
    if kv.contiguous and sched.waiting:
        need = kv.reservation(sched.waiting[0])
        if need <= kv.num_free_blocks() and not kv.can_reserve([need]):
            external = free
    return {"real": u.real_tokens, "reserved": u.reserved_for_future, "internal": internal,
            "external": external, "free": free - external}


class CostExecutor:
    """The simulator's executor when only time matters: it prices each step with `cost` from the
    step's plan (bucket, tokens, contexts: what the packer would build) and samples token 0 for
    every row. For requests that run to max_tokens with ignore_eos, as every request here does,
    the token values change nothing the scheduler decides. ~2.5x faster than `SimExecutor`."""

    needs_step_input = False

    def __init__(self, config: EngineConfig, cost):
        self.packer = BatchPacker(config)
        self.block_size = config.block_size
        self.cost = cost

    def execute(self, out, step) -> tuple[np.ndarray, None, float]:
        bucket, num_tokens, ctx = self.packer.plan(out)
        shape = shape_of(out, bucket, num_tokens, ctx, self.block_size)
        return np.zeros(out.num_rows, np.int64), None, self.cost.predict(shape)


@dataclass
class SimRun:
    system: str
    summary: dict
    breakdown: dict          # mean share of the pool per category, over the steps with a queue
    records: list
    wall_s: float


def engine_config(system: str, *, num_blocks: int, block_size: int = 16, max_num_seqs: int = 256,
                  max_model_len: int = 2048, max_num_batched_tokens: int = 2048, **changes) -> EngineConfig:
    """The simulated engine: one `system`'s policy over the same pool, seats and token budget."""
    if system not in SYSTEMS:
        raise ValueError(f"system must be one of {tuple(SYSTEMS)}, got {system!r}")
    return EngineConfig(num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                        max_model_len=max_model_len, max_num_batched_tokens=max_num_batched_tokens,
                        **{**SYSTEMS[system], **changes})


def simulate_serving(requests: Sequence[BenchRequest], config: EngineConfig, cost, *, system: str = "",
                     n: int = 1, on_step: Callable | None = None, breakdown: bool = False) -> SimRun:
    """Serve `requests` (each to its max_tokens, ignore_eos, greedy; `n` samples each) through the
    real scheduler and allocator on a virtual clock advanced by `cost.step_time`. Every request
    arrives at its `arrival` (seconds from 0). The summary has the keys of a real run's
    (`pagedjax.benchmarks.serving.serving_metrics` + `kv_metrics`) plus the mean normalized
    latency (end-to-end latency / output tokens, the paper's metric)."""
    import time

    clock = VirtualClock()
    sched = Scheduler(config, clock=clock)
    sched.metrics.record_occupancy = False
    if hasattr(cost, "predict"):
        ex = CostExecutor(config, cost)
    else:  # a cost with step_time(out, step, block_size) only needs the packed step
        ex = SimExecutor(sched.num_blocks, config.block_size, num_host_blocks=sched.kv.host.num_blocks,
                         vocab_size=1 << 20, cost=cost)
    reqs = [Request(r.request_id, list(r.prompt_token_ids),
                    SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True, n=n),
                    arrival_time=r.arrival, seed=i) for i, r in enumerate(requests)]
    totals = dict.fromkeys(BREAKDOWN, 0.0)
    counted = 0

    def step_hook(s, out):
        nonlocal counted
        if breakdown and s.waiting:   # a queue: the memory is what limits the batch
            for k, v in memory_breakdown(s).items():
                totals[k] += v
            counted += 1
        if on_step is not None:
            on_step(s, out)

    t0 = time.perf_counter()
    quiet = logging.getLogger("pagedjax.metrics")   # overload is what a rate sweep is for: no warnings
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        simulate(sched, ex, reqs, clock, on_step=step_hook)
    finally:
        quiet.setLevel(level)
    wall = time.perf_counter() - t0
    records = list(sched.metrics.finished)
    end = max((r.token_times[-1] for r in records if r.token_times), default=clock.now)
    summary = serving_metrics(records, 0.0, end)
    summary.update(kv_metrics(sched.metrics.steps))
    groups: dict[str, list] = {}
    for r in records:
        groups.setdefault(r.group_id, []).append(r)
    # a group's latency ends with its last sample; its tokens are one sample's (the paper's)
    norm = [max(x.e2e for x in g) / max(x.num_output_tokens for x in g) for g in groups.values()]
    summary["normalized_latency_s"] = float(np.mean(norm))
    summary["simulated_steps"] = len(sched.metrics.steps)
    pool = (sched.num_blocks - 1) * config.block_size
    shares = {k: v / counted / pool for k, v in totals.items()} if counted else {}
    return SimRun(system, summary, {"steps": counted, **shares}, records, wall)


# -- the simulator, checked against the real engine ---------------------------------------------------
VALIDATED = (("duration_s", ("duration_s",)), ("mean_ttft_ms", ("ttft_ms", "mean")), ("mean_tpot_ms", ("tpot_ms", "mean")))


def _pick(summary: dict, path: Sequence[str]):
    for k in path:
        summary = summary[k]
    return summary


def validation_study(bench, fit_sets: dict[str, Sequence[BenchRequest]], test_sets: dict[str, Sequence[BenchRequest]],
                     *, system: str = "continuous", terms: Sequence[str] | None = None, repeats: int = 1) -> dict:
    """Fit a step-cost model to the real engine's steps on `fit_sets`, then run each of
    `test_sets` on the real engine and in the simulator under that model, and report the
    prediction error of duration, mean TTFT and mean TPOT (predicted / measured - 1).

    With `repeats` > 1 the real runs go round in turn (every fit set, then every test set, again)
    and the measured figures are the medians over the repeats: on a shared CPU the same run of the
    same requests moves by up to 25 % from one minute to the next (other tenants), so the fit and
    the test see the same drift and one slow run does not decide. `bench` is a `pagedjax.benchmarks.serving.EngineBench`."""
    from pagedjax.benchmarks.cost_model import DEFAULT_TERMS, StepCostModel
    from pagedjax.benchmarks.serving import ENGINE_SYSTEMS

    timings, measured = [], {name: [] for name in test_sets}
    for _ in range(repeats):
        for name, reqs in fit_sets.items():
            timings += bench.run(system, reqs, workload=name, progress=False).timings
        for name, reqs in test_sets.items():
            measured[name].append(bench.run(system, reqs, workload=name, progress=False).summary)
    model = StepCostModel.from_timings(timings, terms or DEFAULT_TERMS)
    config = EngineConfig(**{**bench.engine_args, **ENGINE_SYSTEMS[system]})
    results = {}
    for name, reqs in test_sets.items():
        sim = simulate_serving(reqs, config, model, system=system)
        row = {}
        for key, path in VALIDATED:
            runs = [_pick(m, path) for m in measured[name]]
            real, predicted = float(np.median(runs)), _pick(sim.summary, path)
            row[key] = {"measured": real, "measured_runs": runs, "predicted": predicted, "error": predicted / real - 1}
        row["steps"] = {"measured": [m["num_steps"] for m in measured[name]], "predicted": sim.summary["num_steps"]}
        results[name] = row
    return {"model": model.to_dict(), "fit_sets": {k: len(v) for k, v in fit_sets.items()}, "repeats": repeats,
            "fit_steps": len([t for t in timings if t.shape is not None]), "system": system, "results": results}


# -- the figures' measurements ------------------------------------------------------------------------
def memory_study(requests: Sequence[BenchRequest], cost, *, num_blocks: int, systems: Sequence[str] = tuple(SYSTEMS),
                 **config_kw) -> dict:
    """The KV pool's breakdown per system (the paper's Figure 2), averaged over the steps with
    requests waiting: under load, what the memory that limits the batch holds."""
    out = {}
    for system in systems:
        run = simulate_serving(requests, engine_config(system, num_blocks=num_blocks, **config_kw), cost,
                               system=system, breakdown=True)
        shares = {k: v for k, v in run.breakdown.items() if k != "steps"}
        used = sum(v for k, v in shares.items() if k != "free")
        out[system] = {"share_of_pool": shares, "steps_measured": run.breakdown.get("steps", 0),
                       # the paper's bars: shares of the memory in use (token states, reservations,
                       # fragmentation), free memory left out
                       "share_of_used": {k: v / used for k, v in shares.items() if k != "free"} if used else {},
                       "mean_running": run.summary["mean_running"], "duration_s": run.summary["duration_s"]}
    return out


def sustainable_rate(points: Sequence[dict], bar: float, key: str = "normalized_latency_s") -> float | None:
    """The request rate at which `key` crosses `bar`, linearly interpolated between the swept
    rates around the first crossing; the highest rate if it never does, None if the lowest
    already exceeds it."""
    pts = sorted(points, key=lambda p: p["rate"])
    if not pts or pts[0][key] > bar:
        return None
    for a, b in zip(pts, pts[1:]):
        if b[key] > bar:
            return a["rate"] + (b["rate"] - a["rate"]) * (bar - a[key]) / (b[key] - a[key])
    return pts[-1]["rate"]


def latency_sweep(workload: str, rates: Sequence[float], cost, *, num_requests: int, num_blocks: int,
                  systems: Sequence[str] = tuple(SYSTEMS), seed: int = 0, bar_factor: float = 2.0,
                  system_changes: dict | None = None, **config_kw) -> dict:
    """Normalized latency (mean over requests of end-to-end latency / output tokens) against the
    request rate, per system (the paper's Figure 12). The sustainable rate of each system is
    where its latency crosses `bar_factor` x the first system's latency at the lowest rate: one
    latency bar for all. `system_changes` adds EngineConfig changes per system name (its own
    names beyond SYSTEMS map to 'paged' plus the changes)."""
    changes = system_changes or {}
    curves: dict[str, list] = {}
    for system in systems:
        base = system if system in SYSTEMS else "paged"
        for rate in rates:
            reqs = paper_workload(workload, num_requests, rate, seed)
            cfg = engine_config(base, num_blocks=num_blocks, **{**config_kw, **changes.get(system, {})})
            run = simulate_serving(reqs, cfg, cost, system=system)
            s = run.summary
            curves.setdefault(system, []).append({
                "rate": rate, "normalized_latency_s": s["normalized_latency_s"],
                "mean_ttft_s": s["ttft_ms"]["mean"] / 1e3, "mean_tpot_s": s["tpot_ms"]["mean"] / 1e3,
                "mean_running": s["mean_running"], "preemptions": s["preemptions"],
                "prefix_hit_rate": s["prefix_hit_rate"], "sim_wall_s": run.wall_s})
    first = curves[systems[0]][0]["normalized_latency_s"]
    bar = bar_factor * first
    rates_ok = {s: sustainable_rate(c, bar) for s, c in curves.items()}
    ref = rates_ok[systems[0]]
    return {"workload": workload, "num_requests": num_requests, "num_blocks": num_blocks, "config": config_kw,
            "latency_bar_s": bar, "curves": curves, "sustainable_rate": rates_ok,
            "ratio_to_first": {s: (ref / r if ref and r else None) for s, r in rates_ok.items()}}


def sharing_study(engine, prompts: Sequence[Sequence[int]], output_lens: Sequence[int], *,
                  n_values: Sequence[int] = (2, 4, 6), beam_widths: Sequence[int] = (2, 4, 6),
                  beam_prompts: int = 16) -> dict:
    """Memory saved by sharing KV blocks (the paper's Figure 15), on the real engine: parallel
    sampling through `n > 1` requests (children fork their parent's blocks) and beam search
    (`pagedjax.beam_search`, which keeps the same two counts per token). After every step, the blocks in use (shared ones once) are set
    against the blocks every sequence's table would take alone; the saving is 1 - used / alone,
    summed over the steps (a time average). The engine should have prefix caching off, so only
    sharing within a request counts."""
    from pagedjax.beam_search import beam_search
    from pagedjax.sampling_params import BeamSearchParams

    kv = engine.scheduler.kv

    def sample() -> tuple[int, int]:
        tables = kv.req_to_blocks
        return kv.usage().used_blocks, sum(len(t) for t in tables.values())

    out: dict = {"parallel": {}, "beam": {}}
    for n in n_values:
        used = alone = 0
        for i, (p, o) in enumerate(zip(prompts, output_lens)):
            engine.add_request(f"n{n}-{i}", {"prompt_token_ids": list(p)},
                               SamplingParams(n=n, temperature=1.0, max_tokens=int(o), ignore_eos=True, seed=i))
        while engine.has_unfinished_requests():
            engine.step()
            u, a = sample()
            used, alone = used + u, alone + a
        out["parallel"][n] = {"saving": 1 - used / alone, "used_block_steps": used, "alone_block_steps": alone}
    for k in beam_widths:
        # one search per prompt, each to its own output length
        searches = [beam_search(engine, [{"prompt_token_ids": list(p)}],
                                BeamSearchParams(beam_width=k, max_tokens=int(o), ignore_eos=True))[0]
                    for p, o in list(zip(prompts, output_lens))[:beam_prompts]]
        used = sum(r.physical_block_steps for r in searches)
        alone = sum(r.cloned_block_steps for r in searches)
        out["beam"][k] = {"saving": 1 - used / alone, "used_block_steps": used, "alone_block_steps": alone,
                          "prompts": len(searches)}
    return out


def swap_costs(model, block_sizes: Sequence[int], *, tokens: int = 1024, repeats: int = 5,
               dtype: str = "float32") -> dict:
    """Measured on this machine with the engine's own block moves: seconds to swap `tokens`
    tokens of KV out to the host and back in, at each block size (one `LLMEngine` each, its
    runner's `swap_out` / `swap_in` over tokens / block_size blocks, median of `repeats` after
    one untimed call), and seconds to recompute them instead (a prefill of `tokens` tokens with
    prefix caching off, the second of two)."""
    import time

    from pagedjax.engine import LLMEngine

    rows = []
    for bs in block_sizes:
        n = cdiv(tokens, bs)
        eng = LLMEngine(model, dtype=dtype, block_size=bs, num_blocks=n + 2, num_host_blocks=n + 1,
                        preemption_mode="swap", max_model_len=n * bs, enable_prefix_caching=False)
        out_pairs = [(1 + i, i) for i in range(n)]
        in_pairs = [(i, 1 + i) for i in range(n)]
        times = {"swap_out": [], "swap_in": []}
        for k in range(repeats + 1):
            for name, fn, pairs in (("swap_out", eng.runner.swap_out, out_pairs), ("swap_in", eng.runner.swap_in, in_pairs)):
                t0 = time.perf_counter()
                fn(pairs)
                dt = time.perf_counter() - t0
                if k:
                    times[name].append(dt)
        kv_bytes = sum(c.nbytes for c in eng.runner.host_cache) // (n + 1)   # one block, K and V
        out_s, in_s = float(np.median(times["swap_out"])), float(np.median(times["swap_in"]))
        rows.append({"block_size": bs, "blocks": n, "swap_out_s": out_s, "swap_in_s": in_s,
                     "per_block_s": (out_s + in_s) / (2 * n), "block_bytes": kv_bytes,
                     "bandwidth_gb_s": 2 * n * kv_bytes / (out_s + in_s) / 1e9})
        del eng
    eng = LLMEngine(model, dtype=dtype, max_model_len=max(2048, tokens + 1), enable_prefix_caching=False)
    prompt = {"prompt_token_ids": [100 + i % 1000 for i in range(tokens)]}
    recompute = []
    for _ in range(2):
        t0 = time.perf_counter()
        eng.add_request("r", prompt, SamplingParams(max_tokens=1, temperature=0))
        while eng.has_unfinished_requests():
            eng.step()
        recompute.append(time.perf_counter() - t0)
    return {"tokens": tokens, "rows": rows, "recompute_s": recompute[-1]}
