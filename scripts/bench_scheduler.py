"""Host-side cost and robustness of the scheduler, with the sim executor (no model, no JAX).

1. Host time per step (schedule + update_from_output + pack) with 256 running sequences:
   median and p99 over the steps once all 256 are decoding.
2. 100,000 simulated requests through a pool small enough to force preemption, in both
   preemption modes: wall time, preemptions, requests lost (accepted but never finished),
   blocks leaked at the end.

    python scripts/bench_scheduler.py [--requests 100000] [--json results/bench_scheduler.json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

import numpy as np

import logging

from pagedjax.config import EngineConfig
from pagedjax.sampling_params import SamplingParams
from pagedjax.scheduler.batch import BatchPacker
from pagedjax.scheduler.scheduler import Scheduler
from pagedjax.scheduler.sequence import Request
from pagedjax.scheduler.sim import SimExecutor, VirtualClock, simulate


def host_time_per_step(num_seqs: int = 256, steps: int = 300, context: int = 200) -> dict:
    cfg = EngineConfig(block_size=16, num_blocks=num_seqs * 64 + 1, max_num_seqs=num_seqs,
                       max_num_batched_tokens=4096, max_model_len=2048)
    sched = Scheduler(cfg)
    packer = BatchPacker(cfg)
    rng = random.Random(0)
    for i in range(num_seqs):
        sched.add_request(Request(f"r{i}", [rng.randrange(30000) for _ in range(context)],
                                  SamplingParams(max_tokens=1000, ignore_eos=True), seed=i))
    # prefill everyone first, untimed
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        out = sched.schedule()
        packer.pack(out, sched.kv)
        sched.update_from_output(out, np.zeros(out.num_rows, np.int64))
    times = {"schedule": [], "pack": [], "update": [], "total": []}
    rows = []
    for k in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        step = packer.pack(out, sched.kv)
        t2 = time.perf_counter()
        sampled = np.full(out.num_rows, k % 30000, np.int64)
        sched.update_from_output(out, sampled)
        t3 = time.perf_counter()
        rows.append(out.num_rows)
        for key, dt in (("schedule", t1 - t0), ("pack", t2 - t1), ("update", t3 - t2), ("total", t3 - t0)):
            times[key].append(dt * 1e3)
    assert min(rows) == num_seqs, "every sequence should decode in every timed step"
    return {k: {"median_ms": float(np.median(v)), "p99_ms": float(np.percentile(v, 99))} for k, v in times.items()} | {
        "num_seqs": num_seqs, "steps": steps, "bucket": list(step.bucket)}


def soak(num_requests: int, mode: str, seed: int = 0, num_blocks: int = 400) -> dict:
    cfg = EngineConfig(block_size=16, num_blocks=num_blocks, max_num_seqs=64, max_num_batched_tokens=512,
                       max_model_len=1024, preemption_mode=mode)
    clock = VirtualClock()
    sched = Scheduler(cfg, clock=clock)
    sched.metrics.record_occupancy = False
    executor = SimExecutor(num_blocks, 16, num_host_blocks=num_blocks)
    rng = random.Random(seed)
    reqs, t = [], 0.0
    for i in range(num_requests):
        t += rng.expovariate(1 / 0.004)
        prompt = [rng.randrange(30000) for _ in range(min(600, int(rng.expovariate(1 / 60)) + 4))]
        reqs.append(Request(f"r{i}", prompt, SamplingParams(max_tokens=min(300, int(rng.expovariate(1 / 40)) + 1),
                                                            ignore_eos=True), arrival_time=t, seed=i))
    t0 = time.perf_counter()
    res = simulate(sched, executor, reqs, clock)
    wall = time.perf_counter() - t0
    lost = num_requests - len(res.finished)
    usage = sched.kv.usage()
    leaked = usage.used_blocks + (sched.kv.host.num_blocks - sched.kv.host.num_free_blocks)
    return {"mode": mode, "requests": num_requests, "finished": len(res.finished), "lost": lost,
            "blocks_leaked": leaked, "preemptions": res.preemptions, "steps": res.num_steps,
            "wall_s": wall, "virtual_s": res.virtual_time}


def main() -> int:
    logging.getLogger("pagedjax").setLevel(logging.ERROR)  # the soak forces preemption on purpose
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=100_000)
    ap.add_argument("--num-seqs", type=int, default=256)
    ap.add_argument("--json", default="results/bench_scheduler.json")
    args = ap.parse_args()
    ht = host_time_per_step(args.num_seqs)
    print(f"host time per step with {ht['num_seqs']} decoding sequences (bucket T,S,P = {ht['bucket']}):")
    for k in ("schedule", "pack", "update", "total"):
        print(f"  {k:<9} median {ht[k]['median_ms']:6.3f} ms   p99 {ht[k]['p99_ms']:6.3f} ms")
    soaks = []
    for mode in ("recompute", "swap"):
        r = soak(args.requests, mode)
        soaks.append(r)
        print(f"{r['requests']:,} requests, preemption_mode={mode}: {r['wall_s']:.1f} s wall, {r['steps']:,} steps, "
              f"{r['preemptions']:,} preemptions, lost {r['lost']}, blocks leaked {r['blocks_leaked']}")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"host_time": ht, "soak": soaks}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
