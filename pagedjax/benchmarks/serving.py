"""Serving benchmarks: one request list, several systems, vLLM's `bench serve` metrics.

    requests = make_workload("mixed", 64, vocab_size=49152, seed=0)
    bench = EngineBench(load_any_model("smollm2-135m", "float32", 0), engine_kwargs(max_num_seqs=32, ...))
    results = [bench.run(system, requests) for system in ("continuous", "static", "contiguous")]
    results.append(run_hf(load_hf_model(path), requests, seats=32))

Workloads (token-id prompts drawn from the vocabulary with a seeded RNG; every request has
`ignore_eos` and its own `max_tokens`, so every system generates exactly the same number of
tokens for it):
  mixed          the PagedAttention paper's kind of length distribution, scaled down: prompt and output lengths
                 `min(cap, floor + int(Exponential(mean)))`
  similar        prompt and output lengths uniform in narrow ranges
  random         vLLM's `--random-input-len/--random-output-len/--random-range-ratio`: lengths
                 uniform in [len * (1 - ratio), len * (1 + ratio)]
  shared-prefix  one system prompt of `prefix_len` tokens before every request's own suffix
Arrivals: all at once (offline throughput) or a Poisson process at `request_rate` requests/s.

Systems. Each engine system is an LLMEngine built from the same loaded weights and the same
engine arguments (same `num_blocks`, so the same KV memory; same buckets, so the same compiled
step functions, shared through the jit cache) with only the host-side policy changed
(`EngineBench.engine`): continuous = the default engine, static = `scheduling="static"`,
contiguous = `allocation="contiguous"` (Orca (Max): each request reserves `max_model_len` at admission; orca-pow2 and orca-oracle reserve less, see pagedjax.scheduler.kv_cache_manager),
continuous-nocache = prefix caching off. The device program does not depend on the policy: one
warm-up compiles for every system, and a compilation during any run shows in its `compilations`.
`hf` is transformers' `generate` on the same weights in PyTorch (see `run_hf`); `hf-cb` is
transformers' own continuous batching over its paged cache (`run_hf_cb`), as close to the engine's
seats, pages and token budget as its config allows.

Metrics (vLLM's definitions, `pagedjax.metrics`): request throughput, output and total tokens/s
over the benchmark duration (first arrival to last token), TTFT, TPOT = (e2e - TTFT) / (n - 1),
ITL (every gap between consecutive tokens of a request), e2e: mean, p50, p90, p99 in ms. From the
scheduler's per-step records: mean and peak KV use, KV utilization (real tokens / allocated
slots), peak concurrent requests, preemptions, prefix-cache hit rate.

The ideal continuous / static ratio (`ideal_ratio`) is computed from the request lengths alone;
see its docstring for what "no overhead" means there.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pagedjax.metrics import RequestRecord, StepTiming, summarize
from pagedjax.model.hub import LoadedModel
from pagedjax.sampling_params import SamplingParams

WORKLOADS = ("mixed", "similar", "random", "shared-prefix")

# the host-side policy of each engine system, as EngineConfig changes from the base config
ENGINE_SYSTEMS = {
    "continuous": {},
    "static": {"scheduling": "static"},
    "contiguous": {"allocation": "contiguous"},   # Orca (Max): every request reserves max_model_len
    "orca-pow2": {"allocation": "contiguous", "contiguous_reserve": "pow2"},
    "orca-oracle": {"allocation": "contiguous", "contiguous_reserve": "oracle"},
    "continuous-nocache": {"enable_prefix_caching": False},
    "continuous-async": {"async_scheduling": True},   # the host schedules step N+1 while step N runs
}
SYSTEMS = (*ENGINE_SYSTEMS, "hf", "hf-cb")
REGIMES = ("padded", "shrinking")   # decode steps padded to the seats, or buckets shrinking with live rows

# per-workload length knobs (overridable through make_workload's keyword arguments)
WORKLOAD_DEFAULTS = {
    # the capacity study's lengths are min(4096, int(expovariate(1/600)) + 50): mean 650, cap ~6x the mean;
    # scaled down about 16x so a 2-core CPU finishes. Prompts stay short: prefill is compute-bound
    # on a CPU and costs every system the same, so long prompts would only dilute the difference
    # the batching policy makes
    "mixed": dict(prompt_mean=24, prompt_floor=8, prompt_cap=128, output_mean=32, output_floor=4, output_cap=192),
    "similar": dict(prompt_range=(24, 40), output_range=(32, 40)),
    "random": dict(input_len=64, output_len=64, range_ratio=0.5),
    "shared-prefix": dict(prefix_len=512, suffix_range=(8, 24), output_range=(16, 32)),
}
# requests per workload when none is given: enough to fill the 32 seats twice over
DEFAULT_NUM_REQUESTS = {"mixed": 64, "similar": 64, "random": 64, "shared-prefix": 16}


# -- workloads --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BenchRequest:
    request_id: str
    prompt_token_ids: tuple[int, ...]
    max_tokens: int
    arrival: float = 0.0          # seconds after the run starts

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def exp_lengths(rng: np.random.Generator, n: int, mean: float, floor: int, cap: int) -> np.ndarray:
    """Long-tailed lengths: min(cap, floor + int(Exponential(mean)))."""
    return np.minimum(cap, floor + rng.exponential(mean, n).astype(np.int64))


def uniform_lengths(rng: np.random.Generator, n: int, lo: int, hi: int) -> np.ndarray:
    """Integers uniform in [lo, hi]."""
    return rng.integers(lo, hi + 1, n)


def random_lengths(rng: np.random.Generator, n: int, length: int, range_ratio: float) -> np.ndarray:
    """vLLM's random dataset: uniform in [int(length * (1 - r)), int(length * (1 + r))], at least 1."""
    if not 0 <= range_ratio < 1:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    lo, hi = int(length * (1 - range_ratio)), int(length * (1 + range_ratio))
    return np.maximum(rng.integers(lo, hi + 1, n), 1)


def poisson_arrivals(rng: np.random.Generator, n: int, request_rate: float) -> np.ndarray:
    """Arrival offsets (s) of a Poisson process at request_rate; all zeros for inf (offline)."""
    if request_rate == math.inf:
        return np.zeros(n)
    if not request_rate > 0:
        raise ValueError(f"request_rate must be > 0 (or inf), got {request_rate}")
    return np.cumsum(rng.exponential(1.0 / request_rate, n))


def make_workload(name: str, num_requests: int, vocab_size: int, *, seed: int = 0,
                  request_rate: float = math.inf, **knobs) -> list[BenchRequest]:
    """`num_requests` requests of workload `name` (see WORKLOAD_DEFAULTS for the knobs).
    Deterministic in (name, num_requests, vocab_size, seed, knobs); the arrival process draws from
    its own stream, so changing the rate never changes the lengths."""
    if name not in WORKLOAD_DEFAULTS:
        raise ValueError(f"workload must be one of {WORKLOADS}, got {name!r}")
    if num_requests < 1:
        raise ValueError(f"num_requests must be >= 1, got {num_requests}")
    unknown = set(knobs) - set(WORKLOAD_DEFAULTS[name])
    if unknown:
        raise ValueError(f"unknown knobs for {name!r}: {sorted(unknown)} (known: {sorted(WORKLOAD_DEFAULTS[name])})")
    k = {**WORKLOAD_DEFAULTS[name], **knobs}
    rng = np.random.default_rng([seed, WORKLOADS.index(name)])
    n = num_requests
    prefix: list[int] = []
    if name == "mixed":
        prompt = exp_lengths(rng, n, k["prompt_mean"], k["prompt_floor"], k["prompt_cap"])
        output = exp_lengths(rng, n, k["output_mean"], k["output_floor"], k["output_cap"])
    elif name == "similar":
        prompt = uniform_lengths(rng, n, *k["prompt_range"])
        output = uniform_lengths(rng, n, *k["output_range"])
    elif name == "random":
        prompt = random_lengths(rng, n, k["input_len"], k["range_ratio"])
        output = random_lengths(rng, n, k["output_len"], k["range_ratio"])
    else:
        prefix = _token_ids(rng, k["prefix_len"], vocab_size)
        prompt = uniform_lengths(rng, n, *k["suffix_range"])
        output = uniform_lengths(rng, n, *k["output_range"])
    arrivals = poisson_arrivals(np.random.default_rng([seed, 99]), n, request_rate)
    return [BenchRequest(f"{name}-{i}", tuple(prefix + _token_ids(rng, int(p), vocab_size)), int(o), float(a))
            for i, (p, o, a) in enumerate(zip(prompt, output, arrivals))]


def _token_ids(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    # stay clear of the low ids, where tokenizers keep their special tokens (bos, eos, pad, roles)
    lo = 100 if vocab_size > 1000 else 3
    return rng.integers(lo, vocab_size, n).tolist()


# -- the ideal continuous / static ratio -------------------------------------------------------------
def static_steps(output_lens: Sequence[int], seats: int) -> int:
    """Steps of static batching: FCFS batches of `seats`, each running to its longest member."""
    return sum(max(output_lens[i:i + seats]) for i in range(0, len(output_lens), seats))


def continuous_steps(output_lens: Sequence[int], seats: int) -> int:
    """Steps of continuous batching with no overhead: FCFS, a freed seat is refilled the very next
    step, and a request holds its seat for exactly its output length (prefill and first token in
    one step). A list schedule: the makespan is set by the last long requests to be admitted."""
    free_at = [0] * min(seats, max(len(output_lens), 1))
    for n in output_lens:
        heapq.heappush(free_at, heapq.heappop(free_at) + n)
    return max(free_at)


def ideal_ratio(output_lens: Sequence[int], seats: int) -> dict:
    """The throughput gain of continuous over static batching that the lengths alone allow, for
    requests that all arrive at once, counting one step as one unit of time (every seat of a
    step costs the same whether it is used or not).

    ideal          static steps / continuous steps with no overhead (`continuous_steps`). This is
                   "static seat-steps / the seat-steps continuous batching needs": both run
                   `seats` seats per step, and the continuous run still ends with a drain, the
                   last admitted requests finishing while seats empty out.
    perfect        seat-steps the static batches' members hold (each keeps its seat until its
                   batch's longest member ends) / sum of output lengths: continuous batching with
                   every seat busy every step and no drain. What a server that never runs out of
                   waiting requests approaches, and the bound for the throughput measured while
                   the queue is non-empty.
    """
    lens = [int(n) for n in output_lens]
    s, c = static_steps(lens, seats), continuous_steps(lens, seats)
    held = sum(len(lens[i:i + seats]) * max(lens[i:i + seats]) for i in range(0, len(lens), seats))
    return {"seats": seats, "static_steps": s, "continuous_steps": c, "static_seat_steps": s * seats,
            "continuous_seat_steps": c * seats, "static_held_seat_steps": held, "output_tokens": sum(lens),
            "ideal": s / c, "perfect": held / sum(lens), "static_busy_fraction": sum(lens) / held}


def cost_model_ideal(results: Sequence[SystemResult], requests: Sequence[BenchRequest], engine_args: dict) -> dict | None:
    """The cost-aware ideal. A step-cost model (pagedjax.benchmarks.cost_model: fixed + per padded
    token + per context token, in seconds) is fitted to every engine run's measured steps here;
    the simulator (the real scheduler and allocator in virtual time, pagedjax.benchmarks.paper)
    then predicts each engine system's duration on the same request list. Reported: measured /
    predicted per system, and the predicted continuous / static throughput ratio, the yardstick
    for the measured one. Unlike `ideal_ratio`, a step costs what its shape costs on this machine:
    a static decode step with few live rows is cheap when its bucket shrinks with them."""
    from pagedjax.benchmarks.cost_model import StepCostModel
    from pagedjax.benchmarks.paper import simulate_serving
    from pagedjax.config import EngineConfig

    runs = [r for r in results if r.timings and r.system in ENGINE_SYSTEMS]
    if not runs:
        return None
    model = StepCostModel.from_timings([t for r in runs for t in r.timings])
    systems = {}
    for r in runs:
        sim = simulate_serving(requests, EngineConfig(**{**engine_args, **ENGINE_SYSTEMS[r.system]}), model)
        measured, predicted = r.summary["duration_s"], sim.summary["duration_s"]
        systems[r.system] = {"measured_duration_s": measured, "predicted_duration_s": predicted,
                             "measured_over_predicted": measured / predicted}
    out = {"model": model.to_dict(), "systems": systems}
    if "continuous" in systems and "static" in systems:
        out["predicted_continuous_over_static"] = (systems["static"]["predicted_duration_s"]
                                                   / systems["continuous"]["predicted_duration_s"])
    return out


# -- results -----------------------------------------------------------------------------------------
@dataclass
class SystemResult:
    system: str
    workload: str
    summary: dict                           # the metrics (flat-ish, JSON-ready)
    records: list[RequestRecord]
    start: float                            # perf_counter at the run's start
    steps: list = field(default_factory=list)          # metrics.StepStats of an engine run
    occupancy: list = field(default_factory=list)      # steps x seats (first steps only)
    timings: list = field(default_factory=list)        # metrics.StepTiming of each engine step

    def step_series(self) -> dict:
        """Per-step time since start (s), running requests, KV use and utilization."""
        st = [s for s in self.steps if s.num_rows]
        return {"time": [s.time - self.start for s in st], "running": [s.num_running for s in st],
                "waiting": [s.num_waiting for s in st], "kv_usage": [s.kv_usage for s in st],
                "kv_utilization": [s.kv_utilization for s in st]}

    def to_dict(self) -> dict:
        return {"system": self.system, "workload": self.workload, "summary": self.summary,
                "series": self.step_series() if self.steps else None,
                "requests": [{"id": r.request_id, "prompt": r.num_prompt_tokens, "output": r.num_output_tokens,
                              "ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e, "preemptions": r.num_preemptions,
                              "cached": r.num_cached_tokens} for r in self.records]}


def _ms(d: dict) -> dict:
    return {k: (v * 1e3 if v is not None and k != "n" else v) for k, v in d.items()}


def serving_metrics(records: Sequence[RequestRecord], start: float, end: float) -> dict:
    """vLLM `bench serve` metrics over finished requests; times in ms, throughputs per second."""
    duration = end - start
    n_in = sum(r.num_prompt_tokens for r in records)
    n_out = sum(r.num_output_tokens for r in records)
    out = {
        "completed": len(records), "duration_s": duration,
        "total_input_tokens": n_in, "total_output_tokens": n_out,
        "request_throughput": len(records) / duration, "output_throughput": n_out / duration,
        "total_token_throughput": (n_in + n_out) / duration,
        "ttft_ms": _ms(summarize(r.ttft for r in records)),
        "tpot_ms": _ms(summarize(r.tpot for r in records)),
        "itl_ms": _ms(summarize(x for r in records for x in r.itls)),
        "e2e_ms": _ms(summarize(r.e2e for r in records)),
    }
    # throughput while requests were still queued: up to the moment the last one was first
    # scheduled (the queue emptied); what follows is the drain, which a busy server never sees
    admitted = [r.first_scheduled for r in records if r.first_scheduled is not None]
    t_sat = max(admitted, default=start)
    toks = sum(1 for r in records for t in r.token_times if t <= t_sat)
    out["saturated_s"] = t_sat - start
    # a queue that emptied almost at once (fewer requests than seats) leaves nothing to measure
    out["saturated_output_throughput"] = toks / (t_sat - start) if toks and t_sat - start >= 0.2 * duration else None
    return out


def kv_metrics(steps: Sequence, full_threshold: float = 0.9) -> dict:
    """KV and batch figures from the scheduler's per-step records (steps that ran something).
    `kv_utilization_when_full`: mean real tokens / allocated slots over the steps whose pool use
    was at least `full_threshold` (None if the pool never filled that far)."""
    busy = [s for s in steps if s.num_rows]
    if not busy:
        return {"num_steps": 0}
    util = [s.kv_utilization for s in busy if s.allocated_slots]
    full = [s.kv_utilization for s in busy if s.kv_usage >= full_threshold and s.allocated_slots]
    queries = sum(s.prefix_query_tokens for s in steps)
    hits = sum(s.prefix_hit_tokens for s in steps)
    return {
        "num_steps": len(busy),
        "mean_kv_usage": float(np.mean([s.kv_usage for s in busy])),
        "peak_kv_usage": float(max(s.kv_usage for s in busy)),
        "mean_kv_utilization": float(np.mean(util)) if util else None,
        "kv_utilization_when_full": float(np.mean(full)) if full else None,
        "steps_pool_full": len(full), "full_threshold": full_threshold,
        "mean_running": float(np.mean([s.num_running for s in busy])),
        "peak_running": max(s.num_running for s in busy),
        "preemptions": sum(s.num_preempted for s in steps),
        "prefill_tokens": sum(s.num_prefill_tokens for s in steps),
        "decode_tokens": sum(s.num_decode_tokens for s in steps),
        "prefix_query_tokens": queries, "prefix_hit_tokens": hits,
        "prefix_hit_rate": hits / queries if queries else 0.0,
    }


# -- engine systems ----------------------------------------------------------------------------------
class EngineBench:
    """Runs request lists through one engine per host-side policy (system), each built from the
    same loaded weights and the same engine arguments but for the system's own changes. Every
    system thus has the same KV memory (num_blocks is explicit), the same buckets and the same
    compiled programs (the jitted step is cached by model and shapes: after the first engine's
    warm-up the others compile nothing). One engine lives at a time."""

    def __init__(self, model: LoadedModel, engine_args: dict, *, dtype: str = "float32", seed: int = 0):
        self.model = model
        self.engine_args = dict(engine_args)
        self.dtype = dtype
        self.seed = seed

    def engine(self, system: str, **changes):
        from pagedjax.engine import LLMEngine

        if system not in ENGINE_SYSTEMS:
            raise ValueError(f"engine system must be one of {tuple(ENGINE_SYSTEMS)}, got {system!r}")
        eng = LLMEngine(self.model, dtype=self.dtype, seed=self.seed,
                        **{**self.engine_args, **ENGINE_SYSTEMS[system], **changes})
        eng.warmup()
        return eng

    def run(self, system: str, requests: Sequence[BenchRequest], *, workload: str = "", progress: bool = True,
            occupancy_steps: int = 200) -> SystemResult:
        eng = self.engine(system)
        pending = deque(sorted(requests, key=lambda r: r.arrival))
        bar = _bar(len(requests), f"{workload} {system}".strip(), progress)
        compiles_before = eng.num_compilations
        cpu0, load0 = time.process_time(), _loadavg()
        start = time.perf_counter()
        while pending or eng.has_unfinished_requests():
            now = time.perf_counter()
            while pending and start + pending[0].arrival <= now:
                r = pending.popleft()
                eng.add_request(r.request_id, {"prompt_token_ids": list(r.prompt_token_ids)},
                                SamplingParams(temperature=0, max_tokens=r.max_tokens, ignore_eos=True),
                                arrival_time=start + r.arrival)
            if not eng.has_unfinished_requests():
                time.sleep(max(0.0, start + pending[0].arrival - time.perf_counter()))
                continue
            done = sum(o.finished for o in eng.step())
            if done and bar is not None:
                bar.update(done)
        end = time.perf_counter()
        if bar is not None:
            bar.close()
        metrics = eng.scheduler.metrics
        records = list(metrics.finished)
        summary = serving_metrics(records, start, _last_token(records, end))
        summary.update(kv_metrics(metrics.steps))
        summary["compilations"] = eng.num_compilations - compiles_before
        summary.update(_contention(cpu0, load0, end - start))
        summary["time_breakdown_s"] = _breakdown(eng.step_timings, end - start)
        summary["device_by_bucket"] = _by_bucket(eng.step_timings)
        summary["config"] = {k: getattr(eng.config, k) for k in (
            "scheduling", "allocation", "enable_prefix_caching", "num_blocks", "block_size", "max_num_seqs",
            "max_num_batched_tokens", "max_model_len")}
        return SystemResult(system, workload, summary, records, start, list(metrics.steps),
                            metrics.occupancy_matrix(occupancy_steps), list(eng.step_timings))


def _loadavg() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _contention(cpu0: float, load0: float | None, wall: float) -> dict:
    """How much of the machine the run had: this process's CPU seconds per wall second (all its
    threads; about the core count when nothing else competes) and the 1-minute load average at
    the start and the end. Timings of runs that shared the cores with other work are not comparable."""
    return {"wall_s": wall, "cpu_per_wall": (time.process_time() - cpu0) / wall if wall > 0 else None,
            "loadavg_start": load0, "loadavg_end": _loadavg()}


def _last_token(records: Sequence[RequestRecord], default: float) -> float:
    ends = [r.token_times[-1] for r in records if r.token_times]
    return max(ends, default=default)


def _breakdown(timings: Sequence[StepTiming], wall: float) -> dict:
    """Seconds in each phase of LLMEngine.step, from the engine's own StepTimings: schedule, pack,
    the device step, update, outputs (detokenizing, stop strings), and the benchmark loop around
    the steps (adding requests, the progress bar)."""
    parts = {"schedule": sum(t.schedule for t in timings), "pack": sum(t.pack for t in timings),
             "device step": sum(t.execute for t in timings), "update": sum(t.update for t in timings),
             "outputs": sum(t.outputs for t in timings)}
    parts["loop"] = max(0.0, wall - sum(parts.values()))
    return parts


def _by_bucket(timings: Sequence[StepTiming]) -> dict:
    """The device step's steps and seconds per compiled bucket, "TxP" (T tokens x P block-table columns)."""
    out: dict[tuple[int, int], list] = {}
    for t in timings:
        if t.bucket is not None:
            b = out.setdefault((t.bucket[0], t.bucket[2]), [0, 0.0])
            b[0] += 1
            b[1] += t.execute
    return {f"{T}x{P}": {"steps": n, "s": s, "ms_per_step": 1e3 * s / n} for (T, P), (n, s) in sorted(out.items())}


def _bar(total: int, desc: str, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=f"{desc:<28}", unit="req", dynamic_ncols=True, leave=True)


# -- Hugging Face transformers -----------------------------------------------------------------------
def load_hf_model(model_path: str):
    """transformers' LlamaForCausalLM in float32 from a .gguf file (dequantized by transformers,
    the same weights pagedjax loads) or a HF directory."""
    from pathlib import Path

    import torch
    from transformers import AutoModelForCausalLM

    p = Path(model_path)
    if p.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(str(p), dtype=torch.float32)
    return model.eval()


def run_hf(model, requests: Sequence[BenchRequest], seats: int, *, pad_token_id: int = 0, workload: str = "",
           progress: bool = True) -> SystemResult:
    """Static batching with transformers' `generate`, as a plain server would do it.

    Batches of up to `seats` requests in arrival order, formed when the previous batch is done
    (from the requests that have arrived by then), prompts left-padded to the batch's longest,
    greedy, each batch run to its longest request's max_tokens (`min_new_tokens` = `max_new_tokens`
    so nobody stops early; the tokens a shorter request did not ask for are discarded and not
    counted). Timing, from a streamer that stamps every generated step of the batch:
      TTFT   the moment the batch's first token appeared, minus the request's arrival
      token times  the batch's first `max_tokens` step times: a request's last token is the
             moment its own last requested token appeared (as if the server streamed), not the
             end of the batch, which is kinder to this baseline than waiting for the batch
    """
    import torch
    from transformers.generation.streamers import BaseStreamer

    class StepClock(BaseStreamer):
        def __init__(self, on_step):
            self.times: list[float] = []
            self.on_step = on_step
            self.seen_prompt = False

        def put(self, value):
            if not self.seen_prompt:   # the first put is the prompt itself
                self.seen_prompt = True
                return
            self.times.append(time.perf_counter())
            self.on_step(len(self.times))

        def end(self):
            pass

    with torch.inference_mode():  # first-call overheads out of the timed run
        warm = torch.tensor([[100, 101], [102, 103]])
        model.generate(input_ids=warm, attention_mask=torch.ones_like(warm), max_new_tokens=2, do_sample=False,
                       pad_token_id=pad_token_id)
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    bar = _bar(len(requests), f"{workload} hf".strip(), progress)
    records: list[RequestRecord] = []
    cpu0, load0 = time.process_time(), _loadavg()
    start = time.perf_counter()
    while pending:
        now = time.perf_counter()
        if start + pending[0].arrival > now:
            time.sleep(start + pending[0].arrival - now)
            now = time.perf_counter()
        batch = []
        while pending and len(batch) < seats and start + pending[0].arrival <= now:
            batch.append(pending.popleft())
        width = max(r.prompt_len for r in batch)
        ids = torch.full((len(batch), width), pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, r in enumerate(batch):
            ids[i, width - r.prompt_len:] = torch.tensor(r.prompt_token_ids)
            mask[i, width - r.prompt_len:] = 1
        longest = max(r.max_tokens for r in batch)
        ends = {}
        for r in batch:
            ends[r.max_tokens] = ends.get(r.max_tokens, 0) + 1

        def on_step(n):
            if bar is not None and n in ends:
                bar.update(ends[n])

        clock = StepClock(on_step)
        t_batch = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad_token_id, streamer=clock)
        for r in batch:
            times = clock.times[:r.max_tokens]
            records.append(RequestRecord(
                request_id=r.request_id, group_id=r.request_id, num_prompt_tokens=r.prompt_len,
                num_output_tokens=len(times), arrival=start + r.arrival, first_scheduled=t_batch,
                first_token=times[0], finished=times[-1], token_times=times, finish_reason="length",
                num_preemptions=0, num_cached_tokens=0))
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    summary = serving_metrics(records, start, _last_token(records, end))
    summary.update({"num_steps": None, "compilations": None, "peak_running": min(seats, len(requests)),
                    "preemptions": 0, **_contention(cpu0, load0, end - start)})
    return SystemResult("hf", workload, summary, records, start)


def run_hf_cb(model, requests: Sequence[BenchRequest], seats: int, *, block_size: int = 16,
              num_blocks: int | None = None, max_batch_tokens: int | None = None, workload: str = "",
              progress: bool = True) -> SystemResult:
    """transformers' own continuous batching over its paged KV cache (`init_continuous_batching`,
    in PyTorch), on the same weights: the peer a user would pick instead of pagedjax. As close to
    the engine's setting as its config allows: `page_size` = block_size, `num_blocks` pages,
    `max_requests_per_batch` = seats, `max_batch_tokens` = the engine's token budget. Requests are
    added at their arrival times with their own `max_new_tokens` and no end-of-sequence token (so
    each generates exactly its max_tokens, as in every system here), greedy; token times are the
    manager's own per-token timestamps (perf_counter)."""
    import torch
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(r.max_tokens for r in requests),
                           eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(page_size=block_size, num_blocks=num_blocks, max_batch_tokens=max_batch_tokens,
                                  max_requests_per_batch=seats, allow_block_sharing=False, use_cuda_graph=False)
    with torch.inference_mode():
        warm = model.generate_batch([[100, 101, 102]], generation_config=GenerationConfig(
            do_sample=False, max_new_tokens=2, eos_token_id=None, pad_token_id=0), continuous_batching_config=cb)
    assert warm, "transformers' continuous batching returned nothing for the warm-up request"
    manager = model.init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    pending = deque(sorted(requests, key=lambda r: r.arrival))
    by_id = {r.request_id: r for r in requests}
    bar = _bar(len(requests), f"{workload} hf-cb".strip(), progress)
    records: list[RequestRecord] = []
    cpu0, load0 = time.process_time(), _loadavg()
    with torch.inference_mode():
        manager.start()
        start = time.perf_counter()
        try:
            while pending or len(records) < len(requests):
                now = time.perf_counter()
                while pending and start + pending[0].arrival <= now:
                    r = pending.popleft()
                    manager.add_request(list(r.prompt_token_ids), request_id=r.request_id, max_new_tokens=r.max_tokens,
                                        record_timestamps=True, eos_token_id=-1)
                wait = 0.05 if not pending else max(0.0, min(0.05, start + pending[0].arrival - time.perf_counter()))
                out = manager.get_result(timeout=wait)
                if out is None or not out.is_finished():
                    if out is None and not manager.is_running():
                        raise RuntimeError("transformers' continuous batching stopped before every request finished")
                    continue
                if out.error:
                    raise RuntimeError(f"transformers' continuous batching failed request {out.request_id}: {out.error}")
                r = by_id[out.request_id]
                times = list(out.timestamps or [])[:r.max_tokens]
                records.append(RequestRecord(
                    request_id=r.request_id, group_id=r.request_id, num_prompt_tokens=r.prompt_len,
                    num_output_tokens=len(out.generated_tokens), arrival=start + r.arrival,
                    first_scheduled=out.lifespan[0] if out.lifespan[0] > 0 else None,
                    first_token=times[0] if times else None, finished=times[-1] if times else None,
                    token_times=times, finish_reason="length", num_preemptions=0, num_cached_tokens=0))
                if bar is not None:
                    bar.update(1)
        finally:
            manager.stop(block=True, timeout=30)
    end = time.perf_counter()
    if bar is not None:
        bar.close()
    summary = serving_metrics(records, start, _last_token(records, end))
    summary.update({"num_steps": None, "compilations": None, "peak_running": None, "preemptions": None,
                    "config": {"page_size": block_size, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens,
                               "max_requests_per_batch": seats},
                    **_contention(cpu0, load0, end - start)})
    return SystemResult("hf-cb", workload, summary, records, start)


# -- capacity at the same KV memory (scheduler + sim executor, no model) ------------------------------
def capacity_study(lengths: Sequence[int], *, capacity: int = 32_768, max_model_len: int = 4096,
                   block_size: int = 16, max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                   prompt_fraction: float = 0.5, full_threshold: float = 0.9) -> dict:
    """Paged vs contiguous allocation at one KV pool, through the real scheduler and the sim
    executor: every request (final length L = prompt + output, prompt = round(L * prompt_fraction))
    arrives at once; report the peak number of requests running at once, the mean while the
    pool is full, preemptions and the paged pool's KV utilization while full."""
    from pagedjax.config import EngineConfig
    from pagedjax.scheduler.scheduler import Scheduler
    from pagedjax.scheduler.sequence import Request
    from pagedjax.scheduler.sim import SimExecutor, StepCost, VirtualClock, simulate

    num_blocks = capacity // block_size + 1  # + the null block
    out = {"capacity_tokens": capacity, "max_model_len": max_model_len, "block_size": block_size,
           "max_num_seqs": max_num_seqs, "num_requests": len(lengths), "mean_length": float(np.mean(lengths)),
           "prompt_fraction": prompt_fraction}
    for allocation in ("contiguous", "paged"):
        cfg = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max_num_seqs,
                           max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                           enable_prefix_caching=False, allocation=allocation,
                           page_buckets=(max_model_len // block_size,))
        clock = VirtualClock()
        sched = Scheduler(cfg, clock=clock)
        sched.metrics.record_occupancy = False
        reqs = []
        for i, L in enumerate(int(x) for x in lengths):
            p = min(max(1, round(L * prompt_fraction)), L - 1) if L > 1 else 1
            reqs.append(Request(f"c{i}", [(7 * i + j) % 997 + 3 for j in range(p)],
                                SamplingParams(max_tokens=max(1, L - p), ignore_eos=True), seed=i))
        res = simulate(sched, SimExecutor(num_blocks, block_size, cost=StepCost()), reqs, clock)
        kv = kv_metrics(sched.metrics.steps, full_threshold)
        full_running = [s.num_running for s in sched.metrics.steps if s.num_rows and s.kv_usage >= full_threshold]
        out[allocation] = {"peak_running": kv["peak_running"], "mean_running": kv["mean_running"],
                           "mean_running_when_full": float(np.mean(full_running)) if full_running else None,
                           "kv_utilization_when_full": kv["kv_utilization_when_full"],
                           "mean_kv_utilization": kv["mean_kv_utilization"], "steps_pool_full": kv["steps_pool_full"],
                           "preemptions": res.preemptions, "num_steps": res.num_steps,
                           "finished": len(res.finished)}
    out["peak_ratio"] = out["paged"]["peak_running"] / out["contiguous"]["peak_running"]
    return out


# -- the whole benchmark ------------------------------------------------------------------------------
DEFAULT_SYSTEMS = {
    "mixed": ("continuous", "static", "contiguous", "hf", "hf-cb"),
    "similar": ("continuous", "static"),
    "random": ("continuous", "static"),
    "shared-prefix": ("continuous", "continuous-nocache"),
}
# --quick: still more requests than seats (or static and continuous would run the same schedule),
# shorter outputs, a 128-token shared prefix
QUICK_NUM_REQUESTS = {"mixed": 48, "similar": 40, "random": 40, "shared-prefix": 8}
QUICK_KNOBS = {"mixed": dict(output_mean=16, output_cap=96), "similar": dict(output_range=(16, 20)),
               "random": dict(input_len=32, output_len=16), "shared-prefix": dict(prefix_len=128)}


def max_request_len(name: str, **knobs) -> int:
    """The longest prompt + output workload `name` can draw with these knobs (sizes max_model_len)."""
    k = {**WORKLOAD_DEFAULTS[name], **knobs}
    if name == "mixed":
        return k["prompt_cap"] + k["output_cap"]
    if name == "similar":
        return k["prompt_range"][1] + k["output_range"][1]
    if name == "random":
        return int(k["input_len"] * (1 + k["range_ratio"])) + int(k["output_len"] * (1 + k["range_ratio"]))
    return k["prefix_len"] + k["suffix_range"][1] + k["output_range"][1]


def engine_kwargs(*, max_num_seqs: int, max_model_len: int, block_size: int = 16, reservations: int = 10,
                  num_blocks: int | None = None, max_num_batched_tokens: int | None = None,
                  token_buckets: Sequence[int] | None = None, page_buckets: Sequence[int] | None = None) -> dict:
    """The benchmark's engine: a KV pool of `reservations` max_model_len reservations (so the
    contiguous baseline is memory-bound while paging fits every seat), a token budget of
    4 tokens per seat (at least 128), one decode shape (T = max_num_seqs: every decode step
    costs the same however many seats are live, the cost model the ideal ratio counts in), and
    block-table widths covering 128, 256, 512 and max_model_len tokens of context.

    Token buckets go up in steps of 16 for 96 tokens above the decode shape, then double (vLLM
    pads to multiples of 8 for its CUDA graphs): a step of 31 decodes and a 40-token prompt is
    padded to 80 tokens, not 128. On the 2-core CPU, where a step's matmuls cost what its
    padded token count costs, that took the mixed workload's continuous/static ratio from 0.77
    and 0.88 of the ideal to 0.85 and 0.90 in runs side by side (warm-up 19 s instead of 9 s)."""
    from pagedjax.config import pow2_buckets

    max_blocks = -(-max_model_len // block_size)
    mnbt = max_num_batched_tokens or max(128, 4 * max_num_seqs)
    lo = min(max_num_seqs, mnbt)
    fine = tuple(range(lo, min(mnbt, lo + 96) + 1, 16))
    default_tokens = tuple(sorted(set(fine + pow2_buckets(fine[-1], mnbt))))
    return dict(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=block_size,
                num_blocks=num_blocks or reservations * max_blocks + 1, max_num_batched_tokens=mnbt,
                token_buckets=tuple(token_buckets or default_tokens),
                page_buckets=tuple(page_buckets or context_page_buckets(
                    block_size, [c for c in (128, 256, 512) if c < max_model_len] + [max_model_len])))


def median_run(runs: Sequence[SystemResult]) -> SystemResult:
    """The run with the median output tokens/s (the lower middle of an even count)."""
    ranked = sorted(runs, key=lambda r: r.summary.get("output_throughput") or 0.0)
    return ranked[(len(ranked) - 1) // 2]


def repeat_summary(runs: dict[str, list[SystemResult]]) -> dict:
    """Every run's output tokens/s and compilations per system, and continuous/static per repeat
    (the two runs of one repeat ran back to back)."""
    out = {"n": max(len(rs) for rs in runs.values()),
           "output_throughput": {s: [r.summary.get("output_throughput") for r in rs] for s, rs in runs.items()},
           "compilations": {s: [r.summary.get("compilations") for r in rs] for s, rs in runs.items()
                            if rs[0].summary.get("compilations") is not None}}
    if "continuous" in runs and "static" in runs:
        out["continuous_over_static"] = [c.summary["output_throughput"] / s.summary["output_throughput"]
                                         for c, s in zip(runs["continuous"], runs["static"])]
    return out


def length_stats(requests: Sequence[BenchRequest]) -> dict:
    p = [r.prompt_len for r in requests]
    o = [r.max_tokens for r in requests]
    return {"prompt": {"mean": float(np.mean(p)), "min": min(p), "max": max(p)},
            "output": {"mean": float(np.mean(o)), "min": min(o), "max": max(o)}}


def workload_ratios(results: Sequence[SystemResult], ideal: dict | None, cost_ideal: dict | None = None) -> dict:
    """The comparisons each workload's systems allow (None where a system did not run)."""
    by = {r.system: r.summary for r in results}
    out = {"continuous_over_static": ratio(results, "continuous", "static"),
           "continuous_over_hf": ratio(results, "continuous", "hf"),
           "continuous_over_hf_cb": ratio(results, "continuous", "hf-cb"),
           "static_over_hf": ratio(results, "static", "hf"),
           "continuous_over_contiguous": ratio(results, "continuous", "contiguous"),
           "cache_on_over_off": ratio(results, "continuous", "continuous-nocache"),
           "saturated_continuous_over_static": ratio(results, "continuous", "static", "saturated_output_throughput")}
    if "continuous" in by and "static" in by and by["continuous"].get("num_steps"):
        out["static_steps_over_continuous_steps"] = by["static"]["num_steps"] / by["continuous"]["num_steps"]
    if ideal and out["continuous_over_static"] is not None:
        out["ideal"] = ideal["ideal"]
        out["perfect"] = ideal["perfect"]
        out["measured_over_ideal"] = out["continuous_over_static"] / ideal["ideal"]
        if out["saturated_continuous_over_static"] is not None:
            out["saturated_over_perfect"] = out["saturated_continuous_over_static"] / ideal["perfect"]
    if cost_ideal and "predicted_continuous_over_static" in cost_ideal and out["continuous_over_static"] is not None:
        out["cost_model_ideal"] = cost_ideal["predicted_continuous_over_static"]
        out["measured_over_cost_model_ideal"] = out["continuous_over_static"] / out["cost_model_ideal"]
    if "continuous" in by and "contiguous" in by:
        out["peak_running_continuous_over_contiguous"] = (by["continuous"]["peak_running"]
                                                          / max(by["contiguous"]["peak_running"], 1))
    return {k: v for k, v in out.items() if v is not None}


def run_serving(model: str = "smollm2-135m", *, workloads: Sequence[str] = ("mixed", "similar", "shared-prefix"),
                systems: Sequence[str] | None = None, num_requests: int | dict | None = None,
                max_num_seqs: int = 32, request_rate: float = math.inf, seed: int = 0, quick: bool = False,
                knobs: dict | None = None, engine_overrides: dict | None = None, dtype: str = "float32",
                progress: bool = True, capacity: bool = True, repeats: int = 1, regime: str = "padded",
                log: Callable[[str], None] = print) -> dict:
    """Build the workloads, one engine, warm it up, run every (workload, system), return the report
    (JSON-ready) with the SystemResults under report["_results"][workload].

    repeats > 1 runs each workload's engine systems that many times, interleaved (continuous,
    static, ..., continuous, static, ...) so a burst of load from other tenants lands on every
    system alike; each system is then reported by its median run (by output tokens/s), and every
    run's throughput is kept under entry["repeats"]. hf runs once: it is the slowest system and
    a per-step cost rather than a scheduling policy.

    regime: "padded" (decode steps padded to the seats: the token buckets start at max_num_seqs, so
    a step costs the same however many seats are live, the fixed-shape regime of an accelerator)
    or "shrinking" (the engine's default token buckets, powers of two from 8 and on a CPU also 1:
    a static batch's decode steps get cheaper as its members finish). Every figure
    names its regime."""
    import jax

    from pagedjax.config import platform_token_buckets
    from pagedjax.engine import LLMEngine
    from pagedjax.model.hub import load_any_model

    t_start = time.perf_counter()
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    for w in workloads:
        if w not in WORKLOADS:
            raise ValueError(f"workload must be one of {WORKLOADS}, got {w!r}")
    for s in systems or ():
        if s not in SYSTEMS:
            raise ValueError(f"system must be one of {SYSTEMS}, got {s!r}")
    knobs = {w: {**(QUICK_KNOBS.get(w, {}) if quick else {}), **(knobs or {}).get(w, {})} for w in workloads}
    counts = {w: (num_requests.get(w) if isinstance(num_requests, dict) else num_requests)
              or (QUICK_NUM_REQUESTS if quick else DEFAULT_NUM_REQUESTS)[w] for w in workloads}

    need = max(max_request_len(w, **knobs[w]) for w in workloads)
    mml = max(512, -(-need // 128) * 128)
    if regime not in REGIMES:
        raise ValueError(f"regime must be one of {REGIMES}, got {regime!r}")
    overrides = dict(engine_overrides or {})
    if regime == "shrinking" and "token_buckets" not in overrides:
        # the engine's own default: decode steps shrink with the live rows
        mnbt = overrides.get("max_num_batched_tokens") or max(128, 4 * max_num_seqs)
        overrides["token_buckets"] = platform_token_buckets(mnbt, jax.default_backend())
    ekw = engine_kwargs(max_num_seqs=max_num_seqs, max_model_len=mml, **overrides)
    t0 = time.perf_counter()
    loaded = load_any_model(model, dtype, seed)
    engine = LLMEngine(loaded, dtype=dtype, seed=seed, **ekw)
    load_s = time.perf_counter() - t0
    log(f"engine: {model}, {engine.backend} attention, {_describe(engine.config)}; loaded in {load_s:.1f} s")
    buckets = engine.buckets()
    log(f"warm-up: compiling {len(buckets)} step buckets (T, S, P) = {buckets} ...")
    warm = engine.warmup()
    log(f"warm-up: {warm:.1f} s, {engine.num_compilations} compilations")
    bench = EngineBench(loaded, ekw, dtype=dtype, seed=seed)
    vocab = engine.model_config.vocab_size
    reqs = {w: make_workload(w, counts[w], vocab, seed=seed, request_rate=request_rate, **knobs[w]) for w in workloads}

    hf_model = None
    report = {"model": model, "engine_config": _config_dict(engine.config), "load_s": load_s, "warmup_s": warm,
              "num_buckets": len(buckets), "compilations_at_warmup": engine.num_compilations,
              "max_num_seqs": max_num_seqs, "request_rate": request_rate, "seed": seed, "quick": quick,
              "regime": regime,
              "workloads": {}, "_results": {}}
    for w in workloads:
        ideal = ideal_ratio([r.max_tokens for r in reqs[w]], max_num_seqs) if request_rate == math.inf else None
        entry = {"num_requests": counts[w], "knobs": {**WORKLOAD_DEFAULTS[w], **knobs[w]},
                 "lengths": length_stats(reqs[w]), "ideal": ideal, "systems": {}}
        runs: dict[str, list[SystemResult]] = {}
        for rep in range(repeats):
            for system in (systems or DEFAULT_SYSTEMS[w]):
                if system in ("hf", "hf-cb"):   # the PyTorch peers run once: a per-step cost, not a policy
                    if rep:
                        continue
                    if hf_model is None:
                        t0 = time.perf_counter()
                        hf_model = load_hf_model(_checkpoint_path(model))
                        report["hf_load_s"] = time.perf_counter() - t0
                    cfg = engine.config
                    if system == "hf":
                        pad = getattr(engine.tokenizer, "pad_token_id", None)
                        pad = pad if pad is not None else min(engine.eos_token_ids)
                        res = run_hf(hf_model, reqs[w], max_num_seqs, pad_token_id=pad, workload=w, progress=progress)
                    else:
                        res = run_hf_cb(hf_model, reqs[w], max_num_seqs, block_size=cfg.block_size,
                                        num_blocks=cfg.num_blocks - 1, max_batch_tokens=cfg.max_num_batched_tokens,
                                        workload=w, progress=progress)
                else:
                    res = bench.run(system, reqs[w], workload=w, progress=progress)
                runs.setdefault(system, []).append(res)
        results = [median_run(rs) for rs in runs.values()]
        for res in results:
            entry["systems"][res.system] = res.to_dict()
        if repeats > 1:
            entry["repeats"] = repeat_summary(runs)
        entry["cost_model"] = cost_model_ideal(results, reqs[w], ekw)
        entry["ratios"] = workload_ratios(results, ideal, entry["cost_model"])
        report["workloads"][w] = entry
        report["_results"][w] = results
    if capacity:
        report["capacity"] = capacity_report(report)
    report["headline"] = headline(report)
    report["wall_s"] = time.perf_counter() - t_start
    return report


def _checkpoint_path(model: str) -> str:
    if model in ("smollm2-135m", "smollm2", "default"):
        from pagedjax.model.hub import default_model_path

        return str(default_model_path())
    if model == "tiny-random":
        raise ValueError("the hf system needs a real checkpoint (a HF directory, a .gguf, or smollm2-135m), "
                         "not tiny-random")
    return model


def _config_dict(cfg) -> dict:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k != "extra"}


def _describe(cfg) -> str:
    return (f"{cfg.max_num_seqs} seats, {cfg.num_blocks} blocks of {cfg.block_size} "
            f"({(cfg.num_blocks - 1) * cfg.block_size} token slots = {(cfg.num_blocks - 1) // cfg.max_blocks_per_seq} "
            f"reservations of max_model_len {cfg.max_model_len}), max_num_batched_tokens {cfg.max_num_batched_tokens}, "
            f"token buckets {cfg.token_buckets}, page buckets {cfg.page_buckets}")


def capacity_report(report: dict | None = None, **study_kw) -> dict:
    """Peak admitted requests, paged vs contiguous at the same KV memory: at full scale through the
    scheduler and the sim executor (200 requests of long-tailed lengths, mean 650, 32k token slots,
    max length 4096), the static admission count (in order, by final length) beside it, and the real
    engine's mixed run when the report has one."""
    import logging

    from pagedjax.benchmarks.memory_study import admission_study, background_lengths

    lengths = background_lengths()
    sched_log = logging.getLogger("pagedjax.metrics")
    level = sched_log.level
    sched_log.setLevel(logging.ERROR)  # the sim preempts on purpose; its warnings are expected
    try:
        sim = capacity_study(lengths, **study_kw)
    finally:
        sched_log.setLevel(level)
    toy = {a: admission_study(lengths, allocation=a)["admitted"] for a in ("contiguous", "paged")}
    out = {"sim": sim, "admission_by_final_length": toy}
    mixed = (report or {}).get("workloads", {}).get("mixed", {}).get("systems", {})
    if "continuous" in mixed and "contiguous" in mixed:
        c, k = mixed["continuous"]["summary"], mixed["contiguous"]["summary"]
        out["engine"] = {
            "continuous_peak_running": c["peak_running"], "contiguous_peak_running": k["peak_running"],
            "peak_ratio": c["peak_running"] / max(k["peak_running"], 1),
            "continuous_mean_kv_utilization": c.get("mean_kv_utilization"),
            "contiguous_mean_kv_utilization": k.get("mean_kv_utilization"),
            "continuous_peak_kv_usage": c.get("peak_kv_usage"), "contiguous_peak_kv_usage": k.get("peak_kv_usage"),
            "max_num_seqs": c["config"]["max_num_seqs"], "num_blocks": c["config"]["num_blocks"]}
    return out


def _figure(name: str, value, detail: str = "", unit: str = "x") -> dict:
    return {"figure": name, "value": value, "unit": unit, "detail": detail}


def headline(report: dict) -> list[dict]:
    """The report's headline figures, measured: what continuous batching, paging and prefix
    caching gain here, and compilations after warm-up. (What they should reach is stated in the
    README beside the measured runs, not here.)"""
    out = []
    wl = report.get("workloads", {})
    r = wl.get("mixed", {}).get("ratios", {})
    if "measured_over_ideal" in r:
        sysm = wl["mixed"]["systems"]
        per_step = {s: 1e3 * sysm[s]["summary"]["time_breakdown_s"]["device step"] / sysm[s]["summary"]["num_steps"]
                    for s in ("continuous", "static")}
        out.append(_figure("mixed: continuous/static output tok/s, as a share of the ideal", r["measured_over_ideal"],
                           f"measured {r['continuous_over_static']:.2f}x, ideal {r['ideal']:.2f}x (perfect packing "
                           f"{r['perfect']:.2f}x; while queued "
                           f"{fmt(r.get('saturated_continuous_over_static'), '.2f')}x); "
                           f"steps {fmt(r.get('static_steps_over_continuous_steps'), '.2f')}x at device "
                           f"{per_step['continuous']:.0f} vs {per_step['static']:.0f} ms/step", unit=""))
    r = wl.get("similar", {}).get("ratios", {})
    if "ideal" in r:
        out.append(_figure("similar: continuous/static output tok/s", r["continuous_over_static"],
                           f"ideal {r['ideal']:.2f}x: every static batch ends near its members' mean length, "
                           f"so few seat-steps sit idle"))
    r = wl.get("mixed", {}).get("ratios", {})
    if "continuous_over_hf" in r:
        out.append(_figure("mixed: continuous/hf output tok/s", r["continuous_over_hf"],
                           f"= continuous/static {fmt(r.get('continuous_over_static'), '.2f')} x "
                           f"static/hf {fmt(r.get('static_over_hf'), '.2f')} (scheduling x per-step cost)"))
    cap = report.get("capacity")
    if cap:
        sim = cap["sim"]
        out.append(_figure("capacity (sim, 200 long-tailed lengths, 32k slots): peak running paged/contiguous",
                           sim["peak_ratio"],
                           f"{sim['paged']['peak_running']} vs {sim['contiguous']['peak_running']} "
                           f"({sim['paged']['preemptions']} preemptions; mean running while full "
                           f"{fmt(sim['paged']['mean_running_when_full'], '.1f')} vs "
                           f"{fmt(sim['contiguous']['mean_running_when_full'], '.1f')}; admitted by final length "
                           f"{cap['admission_by_final_length']['paged']} vs "
                           f"{cap['admission_by_final_length']['contiguous']})"))
        out.append(_figure("capacity (sim): paged KV utilization while the pool is full",
                           sim["paged"]["kv_utilization_when_full"],
                           f"contiguous {fmt(sim['contiguous']['kv_utilization_when_full'], '%')}", unit="%"))
        if "engine" in cap:
            e = cap["engine"]
            out.append(_figure("capacity (engine, mixed): peak running continuous/contiguous", e["peak_ratio"],
                               f"{e['continuous_peak_running']} vs {e['contiguous_peak_running']}: continuous is "
                               f"capped by max_num_seqs={e['max_num_seqs']}, contiguous by its reservations"))
    sp = wl.get("shared-prefix")
    if sp and "continuous" in sp["systems"]:
        hit = sp["systems"]["continuous"]["summary"].get("prefix_hit_rate")
        plen = sp["knobs"]["prefix_len"]
        out.append(_figure(f"shared-prefix ({plen}-token system prompt): prefill tokens skipped", hit,
                           "prefix-cache hit tokens / prompt tokens", unit="%"))
        r = sp["ratios"].get("cache_on_over_off")
        if r is not None:
            out.append(_figure("shared-prefix: output tok/s caching on/off", r))
    comp = {f"{w}/{s}": e["summary"].get("compilations") for w, v in wl.items() for s, e in v["systems"].items()
            if e["summary"].get("compilations") is not None}
    for w, v in wl.items():     # with repeats, the worst run of each system
        for s, counts in v.get("repeats", {}).get("compilations", {}).items():
            comp[f"{w}/{s}"] = max(counts)
    if comp:
        out.append(_figure("compilations after warm-up, worst engine run", max(comp.values()),
                           ", ".join(f"{k}: {v}" for k, v in comp.items()), unit=""))
    return out


def format_report(report: dict) -> str:
    """The stdout report: per workload the metric tables and ratios, then capacity and the headline figures."""
    lines = []
    rate = report["request_rate"]
    arrivals = "all at once" if rate == math.inf else f"Poisson at {rate:g} requests/s"
    for w, entry in report["workloads"].items():
        ls = entry["lengths"]
        lines.append("")
        lines.append(f"== {w}: {entry['num_requests']} requests, prompt {ls['prompt']['mean']:.0f} tokens "
                     f"[{ls['prompt']['min']}, {ls['prompt']['max']}], output {ls['output']['mean']:.0f} "
                     f"[{ls['output']['min']}, {ls['output']['max']}], arrivals {arrivals}")
        rows = [{"system": s, **e["summary"]} for s, e in entry["systems"].items()]
        lines.append(format_table(rows, THROUGHPUT_COLUMNS[:12]))
        lines.append("")
        lines.append(format_table(rows, [THROUGHPUT_COLUMNS[0]] + THROUGHPUT_COLUMNS[12:]))
        lines.append("")
        lines.append(format_table(rows, ENGINE_COLUMNS))
        results = report.get("_results", {}).get(w)
        if results and any(r.summary.get("time_breakdown_s") for r in results):
            lines.append("")
            lines.append("where the time goes (s; ms/step):")
            lines.append(breakdown_table(results))
            lines.append("device step by shape bucket, T tokens x P block-table columns (steps, ms/step):")
            for res in results:
                b = res.summary.get("device_by_bucket")
                if b:
                    lines.append(f"  {res.system:<19} " + "  ".join(
                        f"{k}: {v['steps']}, {v['ms_per_step']:.0f}" for k, v in b.items()))
        r, ideal = entry["ratios"], entry.get("ideal")
        lines.append("")
        if ideal:
            lines.append(f"ideal continuous/static from the lengths ({ideal['seats']} seats): static "
                         f"{ideal['static_steps']} steps / continuous {ideal['continuous_steps']} steps with no "
                         f"overhead = {ideal['ideal']:.2f}x; perfect packing (no drain) {ideal['perfect']:.2f}x; "
                         f"static seats busy {ideal['static_busy_fraction']:.0%}")
        rep = entry.get("repeats")
        if rep:
            lines.append(f"{rep['n']} interleaved runs per engine system; each system's row above is its median "
                         f"run. output tok/s of every run: " + "; ".join(
                             f"{s} " + ", ".join(f"{x:.1f}" for x in xs)
                             for s, xs in rep["output_throughput"].items() if len(xs) > 1))
            if "continuous_over_static" in rep:
                lines.append("continuous/static per repeat: "
                             + ", ".join(f"{x:.2f}x" for x in rep["continuous_over_static"]))
        if "continuous_over_static" in r:
            lines.append(f"measured continuous/static output tok/s {r['continuous_over_static']:.2f}x"
                         + (f" = {r['measured_over_ideal']:.2f} of ideal" if "measured_over_ideal" in r else "")
                         + (f"; steps {r['static_steps_over_continuous_steps']:.2f}x"
                            if "static_steps_over_continuous_steps" in r else "")
                         + (f"; while requests were queued {r['saturated_continuous_over_static']:.2f}x"
                            if "saturated_continuous_over_static" in r else "")
                         + (f" = {r['saturated_over_perfect']:.2f} of perfect"
                            if "saturated_over_perfect" in r else ""))
        cm = entry.get("cost_model")
        if cm:
            lines.append(f"cost-model ideal ({report.get('regime', 'padded')} regime; step cost fitted here: "
                         f"{', '.join(f'{k} {v * 1e3:.3g} ms' for k, v in cm['model']['coef'].items())}): "
                         + "; ".join(f"{s} measured/predicted duration {v['measured_over_predicted']:.2f}"
                                     for s, v in cm["systems"].items())
                         + (f"; continuous/static predicted {r['cost_model_ideal']:.2f}x, measured = "
                            f"{r['measured_over_cost_model_ideal']:.2f} of it" if "cost_model_ideal" in r else ""))
        for key, label in (("continuous_over_hf", "continuous/hf"), ("continuous_over_hf_cb", "continuous/hf-cb"),
                           ("static_over_hf", "static/hf (per-step cost)"),
                           ("continuous_over_contiguous", "continuous/contiguous"),
                           ("peak_running_continuous_over_contiguous", "peak running continuous/contiguous"),
                           ("cache_on_over_off", "prefix caching on/off")):
            if key in r:
                lines.append(f"{label}: {r[key]:.2f}x")
    cap = report.get("capacity")
    if cap:
        sim = cap["sim"]
        lines.append("")
        lines.append(f"== capacity at the same KV memory (scheduler + sim executor, no model): "
                     f"{sim['num_requests']} requests of long-tailed lengths "
                     f"(mean {sim['mean_length']:.0f}), "
                     f"{sim['capacity_tokens']:,} token slots, max_model_len {sim['max_model_len']}, "
                     f"{sim['max_num_seqs']} seats, prompt = {sim['prompt_fraction']:.0%} of each length")
        rows = [{"allocation": a, **sim[a]} for a in ("contiguous", "paged")]
        lines.append(format_table(rows, [
            ("allocation", "allocation", "s"), ("peak running", "peak_running", "d"),
            ("mean running when full", "mean_running_when_full", ".1f"),
            ("KV util when full", "kv_utilization_when_full", "%"), ("preemptions", "preemptions", "d"),
            ("steps", "num_steps", "d")]))
        a = cap["admission_by_final_length"]
        lines.append(f"admitted in order by final length: paged {a['paged']}, "
                     f"contiguous {a['contiguous']}")
        if "engine" in cap:
            e = cap["engine"]
            lines.append(f"real engine, mixed run, {e['num_blocks']} blocks: peak running continuous "
                         f"{e['continuous_peak_running']} (max_num_seqs {e['max_num_seqs']}) vs contiguous "
                         f"{e['contiguous_peak_running']}; KV utilization continuous "
                         f"{fmt(e['continuous_mean_kv_utilization'], '%')} vs contiguous "
                         f"{fmt(e['contiguous_mean_kv_utilization'], '%')}")
    if report.get("headline"):
        lines.append("")
        lines.append("== headline figures")
        for t in report["headline"]:
            if t["unit"] == "%":
                val = fmt(t["value"], "%")
            else:
                val = (fmt(t["value"], ".2f") if isinstance(t["value"], float) else str(t["value"])) + t["unit"]
            lines.append(f"  {t['figure']}: {val}" + (f"  ({t['detail']})" if t["detail"] else ""))
    return "\n".join(lines)


def report_json(report: dict) -> dict:
    """The report without the in-memory results, non-finite floats as strings ("inf"): what
    results/<name>.json holds (strict JSON)."""
    def clean(x):
        if isinstance(x, float) and not math.isfinite(x):
            return str(x)
        if isinstance(x, dict):
            return {k: clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    return clean({k: v for k, v in report.items() if not k.startswith("_")})


# -- tables ------------------------------------------------------------------------------------------
def fmt(value, spec: str = ".1f", none: str = "-") -> str:
    """format() that prints `none` for None/NaN and percentages for spec '%'."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return none
    if spec == "%":
        return f"{100 * value:.1f}%"
    return format(value, spec)


def get(d: dict, path: str):
    """d['a']['b'] for path 'a.b'; None when any part is missing."""
    for key in path.split("."):
        if not isinstance(d, dict) or key not in d:
            return None
        d = d[key]
    return d


def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]]) -> str:
    """Columns of (header, dotted key into each row, format spec); right-aligned, one header line."""
    cells = [[h for h, _, _ in columns]] + [[fmt(get(r, key), spec) for _, key, spec in columns] for r in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


THROUGHPUT_COLUMNS = [
    ("system", "system", "s"), ("req/s", "request_throughput", ".2f"), ("out tok/s", "output_throughput", ".1f"),
    ("total tok/s", "total_token_throughput", ".1f"), ("TTFT mean", "ttft_ms.mean", ".0f"),
    ("p50", "ttft_ms.p50", ".0f"), ("p90", "ttft_ms.p90", ".0f"), ("p99", "ttft_ms.p99", ".0f"),
    ("TPOT mean", "tpot_ms.mean", ".0f"), ("p50", "tpot_ms.p50", ".0f"), ("p90", "tpot_ms.p90", ".0f"),
    ("p99", "tpot_ms.p99", ".0f"),
    ("ITL mean", "itl_ms.mean", ".0f"), ("p50", "itl_ms.p50", ".0f"), ("p90", "itl_ms.p90", ".0f"),
    ("p99", "itl_ms.p99", ".0f"),
    ("e2e mean", "e2e_ms.mean", ".0f"), ("p50", "e2e_ms.p50", ".0f"), ("p90", "e2e_ms.p90", ".0f"),
    ("p99", "e2e_ms.p99", ".0f"),
]
ENGINE_COLUMNS = [
    ("system", "system", "s"), ("duration s", "duration_s", ".1f"), ("steps", "num_steps", "d"),
    ("KV use mean", "mean_kv_usage", "%"), ("peak", "peak_kv_usage", "%"),
    ("KV util mean", "mean_kv_utilization", "%"), ("peak running", "peak_running", "d"),
    ("mean running", "mean_running", ".1f"), ("preempt", "preemptions", "d"),
    ("prefix hit", "prefix_hit_rate", "%"), ("compiles", "compilations", "d"),
    ("queued tok/s", "saturated_output_throughput", ".1f"), ("CPU/wall", "cpu_per_wall", ".2f"),
    ("load", "loadavg_start", ".1f"), ("->", "loadavg_end", ".1f"),
]
BREAKDOWN_KEYS = ("schedule", "pack", "device step", "update", "outputs", "loop")


def breakdown_table(results: Sequence[SystemResult]) -> str:
    rows = []
    for r in results:
        b = r.summary.get("time_breakdown_s")
        if not b:
            continue
        steps = max(r.summary.get("num_steps") or 1, 1)
        row = {"system": r.system, "steps": steps}
        for k in BREAKDOWN_KEYS:
            row[k] = b[k]
            row[k + " ms/step"] = 1e3 * b[k] / steps
        rows.append(row)
    cols = [("system", "system", "s"), ("steps", "steps", "d")]
    cols += [(f"{k} s", k, ".1f") for k in BREAKDOWN_KEYS]
    cols += [(f"{k} ms/step", f"{k} ms/step", ".1f") for k in ("schedule", "pack", "device step", "update")]
    return format_table(rows, cols)


def ratio(results: Sequence[SystemResult], a: str, b: str, key: str = "output_throughput") -> float | None:
    """results[a].summary[key] / results[b].summary[key], None if either is missing."""
    by = {r.system: r.summary for r in results}
    if a not in by or b not in by or not by[a].get(key) or not by[b].get(key):
        return None
    return by[a][key] / by[b][key]


# -- the block-size ablation --------------------------------------------------------------------------
def kernel_timings(path: str, *, batch: int | None = None, context: int | None = None) -> dict[int, dict]:
    """Per block size, the paged decode kernel's time from scripts/bench_kernel.py's JSON, if that
    file exists and was measured on a GPU/TPU (interpret-mode timings mean nothing). Picks the
    largest batch x context point measured for every block size unless told which."""
    import json
    import os

    if not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    if not data.get("timings_meaningful"):
        return {}
    rows = data.get("rows", [])
    if batch is None or context is None:
        points = [(r["batch"], r["context"]) for r in rows]
        if not points:
            return {}
        batch, context = max(points, key=lambda p: (p[0] * p[1], p))
    return {r["block_size"]: {"batch": batch, "context": context, "paged_ms": r["paged_shuffled_s"] * 1e3,
                              "contiguous_ms": r["contiguous_s"] * 1e3,
                              "paged_over_contiguous": r["shuffled_over_contiguous"], "device": data.get("device")}
            for r in rows if r["batch"] == batch and r["context"] == context}


def ablate_block_size(block_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32, 64, 128), *, model: str = "smollm2-135m",
                      num_requests: int = 48, max_num_seqs: int = 32, max_model_len: int = 256,
                      reservations: int = 10, run_engine: bool = True, kernel_json: str = "results/bench_kernel.json",
                      seed: int = 0, progress: bool = True, log: Callable[[str], None] = print,
                      workload_knobs: dict | None = None) -> dict:
    """Per block size:
      kv_waste, admitted      the fragmentation experiment through KVCacheManager: 200 lengths,
                              32k token slots, max length 4096, admitted in order until one does not
                              fit; waste = allocated slots without a real token
      engine                  continuous batching of a small mixed workload on `model`, one engine
                              per block size with the same KV memory (`reservations` x max_model_len
                              token slots) and block tables covering the same contexts in tokens:
                              output tokens/s, KV utilization, warm-up time, compilations
      kernel                  the paged decode kernel's time from bench_kernel.json (GPU/TPU only)
    Block sizes the engine refuses (the Pallas kernel takes 8..128) are reported with the reason."""
    from pagedjax.benchmarks.memory_study import background_lengths

    lengths = background_lengths()
    kernel = kernel_timings(kernel_json)
    knobs = {**dict(output_mean=16, output_cap=96), **(workload_knobs or {})}
    rows = []
    # one engine per block size, on weights loaded (and dequantized) once
    loaded = None
    if run_engine:
        from pagedjax.model.hub import load_any_model

        loaded = load_any_model(model, np.float32, seed)
    for bs in block_sizes:
        rows.append(_ablation_row(bs, lengths, kernel, knobs, model=loaded, num_requests=num_requests,
                                  max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                                  reservations=reservations, run_engine=run_engine, seed=seed,
                                  progress=progress))
        row = rows[-1]
        log(f"block {bs:>3}: waste {row['kv_waste']:.1%}, admitted {row['admitted']}"
            + (f", {row['output_throughput']:.1f} out tok/s" if "output_throughput" in row else "")
            + (f" ({row['engine_error']})" if "engine_error" in row else ""))
    return {"model": model, "num_requests": num_requests, "max_num_seqs": max_num_seqs,
            "max_model_len": max_model_len, "kv_token_slots": reservations * max_model_len,
            "workload": {"name": "mixed", **WORKLOAD_DEFAULTS["mixed"], **knobs},
            "admission": {"lengths": "background_lengths(): 200, seed 7, mean 600 + 50, cap 4096",
                          "capacity": 32768, "max_model_len": 4096},
            "kernel_json": kernel_json if kernel else None, "rows": rows}


def _ablation_row(bs, lengths, kernel, knobs, *, model, num_requests, max_num_seqs, max_model_len, reservations,
                  run_engine, seed, progress) -> dict:
    from pagedjax.engine import LLMEngine
    from pagedjax.benchmarks.memory_study import admission_study, mean_tail_waste

    study = admission_study(lengths, block_size=bs, allocation="paged")
    row = {"block_size": bs, "kv_waste": 1 - study["utilization"], "admitted": study["admitted"],
           "tail_waste_per_request": mean_tail_waste(lengths, bs)}
    if bs in kernel:
        k = kernel[bs]
        row.update(kernel_ms=k["paged_ms"], kernel_paged_over_contiguous=k["paged_over_contiguous"],
                   kernel_point=f"batch {k['batch']} x context {k['context']} on {k['device']}")
    if not run_engine:
        return row
    t0 = time.perf_counter()
    args = engine_kwargs(max_num_seqs=max_num_seqs, max_model_len=max_model_len, block_size=bs,
                         reservations=reservations)
    try:
        engine = LLMEngine(model, seed=seed, **args)
    except ValueError as e:  # a block size the engine's attention backend cannot take
        row["engine_error"] = str(e)
        return row
    warm = engine.warmup()
    reqs = make_workload("mixed", num_requests, engine.model_config.vocab_size, seed=seed, **knobs)
    del engine  # the bench builds its own engine of these arguments, whose warm-up finds every bucket compiled
    sm = EngineBench(model, args, seed=seed).run("continuous", reqs, workload=f"block {bs}", progress=progress).summary
    t, steps = sm["time_breakdown_s"], max(sm["num_steps"], 1)
    row.update({"output_throughput": sm["output_throughput"], "engine_kv_utilization": sm["mean_kv_utilization"],
                "engine_peak_kv_usage": sm["peak_kv_usage"], "engine_steps": sm["num_steps"],
                "engine_preemptions": sm["preemptions"], "warmup_s": warm,
                "compilations_after_warmup": sm["compilations"], "num_blocks": sm["config"]["num_blocks"],
                "page_buckets": args["page_buckets"],
                "device_ms_per_step": 1e3 * t["device step"] / steps,
                "host_ms_per_step": 1e3 * (t["schedule"] + t["pack"] + t["update"]) / steps,
                "engine_s": time.perf_counter() - t0})
    return row


ABLATION_COLUMNS = [
    ("block", "block_size", "d"), ("KV waste", "kv_waste", "%"), ("admitted @32k", "admitted", "d"),
    ("tail waste/req", "tail_waste_per_request", ".1f"), ("engine KV util", "engine_kv_utilization", "%"),
    ("out tok/s", "output_throughput", ".1f"), ("steps", "engine_steps", "d"),
    ("device ms/step", "device_ms_per_step", ".0f"), ("host ms/step", "host_ms_per_step", ".1f"),
    ("warm-up s", "warmup_s", ".0f"), ("compiles", "compilations_after_warmup", "d"),
    ("kernel ms", "kernel_ms", ".3f"), ("paged/contig", "kernel_paged_over_contiguous", ".2f"),
]


def context_page_buckets(block_size: int, context_buckets: Sequence[int]) -> tuple[int, ...]:
    """Block-table widths covering the same context lengths (in tokens) whatever the block size,
    so every block size reads about the same padded context per step."""
    return tuple(sorted({max(1, -(-c // block_size)) for c in context_buckets}))

