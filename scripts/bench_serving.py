"""The main job: one request list through continuous batching, static batching, contiguous KV
reservation (all the same pagedjax engine, the same KV memory) and Hugging Face transformers'
`generate`, with vLLM's `bench serve` metrics. The logic lives in pagedjax/benchmarks/serving.py.

    python scripts/bench_serving.py                     # what `make run` runs (~9 min on 2 CPU cores)
    python scripts/bench_serving.py --quick             # a small version of the same, one run each (~3 min)
    python scripts/bench_serving.py --workloads mixed --systems continuous,static --num-requests 128
    python scripts/bench_serving.py --workloads random --random-input-len 128 --random-output-len 64
    python scripts/bench_serving.py --request-rate 4    # Poisson arrivals instead of all at once
    python scripts/bench_serving.py --regime shrinking  # decode buckets shrink with the live rows (default: padded)
    python scripts/bench_serving.py --workloads mixed --num-requests 96 --output-mean 96 --output-cap 384  # long tail

Default workloads and systems: mixed (continuous, static, contiguous, hf, hf-cb), similar (continuous,
static), shared-prefix with a 512-token system prompt (continuous with prefix caching on and off);
then the capacity study at full scale (no model). Each engine system runs 3 times per workload,
interleaved with the others (--repeats); the tables show each system's median run and the report
lists every run, since other tenants' load on a shared machine moves a single run by 5-10 %.
Writes results/<name>.json and PNGs: <name>_<workload>_occupancy.png (static and continuous seat
timelines, first 200 steps), <name>_<workload>_kv.png (KV use, KV utilization and running requests
over time) and <name>_<workload>_latency_cdf.png (TTFT, TPOT, ITL and e2e CDFs per system).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import sys
import time

from pagedjax.benchmarks import plots, serving


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="smollm2-135m, tiny-random, a HF directory or a .gguf")
    p.add_argument("--workloads", default="mixed,similar,shared-prefix",
                   help=f"comma-separated, of {', '.join(serving.WORKLOADS)}")
    p.add_argument("--systems", default=None,
                   help=f"comma-separated, of {', '.join(serving.SYSTEMS)} (default: per workload, see above)")
    p.add_argument("--num-requests", type=int, default=None,
                   help=f"requests per workload (default {serving.DEFAULT_NUM_REQUESTS})")
    p.add_argument("--max-num-seqs", type=int, default=32, help="seats: engine max_num_seqs and the hf batch size")
    p.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals at this many requests/s (default inf: all at once)")
    p.add_argument("--regime", choices=serving.REGIMES, default="padded",
                   help="padded: decode steps padded to the seats (fixed shapes, as on an accelerator); "
                        "shrinking: the engine's default token buckets (powers of two from 8, and 1 on a CPU), so a static batch's steps shrink with its live rows")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="fewer requests, a 128-token shared prefix")
    p.add_argument("--prefix-len", type=int, default=None, help="shared-prefix: system prompt tokens (default 512)")
    p.add_argument("--output-mean", type=int, default=None, help="mixed: mean of the exponential output lengths (32)")
    p.add_argument("--output-cap", type=int, default=None, help="mixed: the longest output (192)")
    p.add_argument("--random-input-len", type=int, default=None)
    p.add_argument("--random-output-len", type=int, default=None)
    p.add_argument("--random-range-ratio", type=float, default=None)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV pool in blocks (default: 10 max_model_len reservations + the null block)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--token-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    p.add_argument("--page-buckets", type=lambda s: tuple(int(x) for x in s.split(",")), default=None)
    p.add_argument("--repeats", type=int, default=None,
                   help="runs of each engine system per workload, interleaved; each system is reported by its "
                        "median run (default 3, 1 with --quick; hf always runs once)")
    p.add_argument("--no-capacity", action="store_true", help="skip the full-scale capacity study (sim)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--name", default="bench_serving", help="results/<name>.json and results/<name>_*.png")
    p.add_argument("--out", default="results")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    systems = [s.strip() for s in args.systems.split(",")] if args.systems else None
    knobs = {"shared-prefix": {}, "random": {}, "mixed": {}}
    for flag, key in (("output_mean", "output_mean"), ("output_cap", "output_cap")):
        if getattr(args, flag) is not None:
            knobs["mixed"][key] = getattr(args, flag)
    if args.prefix_len is not None:
        knobs["shared-prefix"]["prefix_len"] = args.prefix_len
    for flag, key in (("random_input_len", "input_len"), ("random_output_len", "output_len"),
                      ("random_range_ratio", "range_ratio")):
        if getattr(args, flag) is not None:
            knobs["random"][key] = getattr(args, flag)
    overrides = {k: v for k, v in dict(num_blocks=args.num_blocks, block_size=args.block_size,
                                       max_num_batched_tokens=args.max_num_batched_tokens,
                                       token_buckets=args.token_buckets, page_buckets=args.page_buckets).items()
                 if v is not None}
    load = os.getloadavg()
    report = serving.run_serving(args.model, workloads=workloads, systems=systems, num_requests=args.num_requests,
                               max_num_seqs=args.max_num_seqs, request_rate=args.request_rate, seed=args.seed,
                               quick=args.quick, knobs=knobs, engine_overrides=overrides,
                               progress=not args.no_progress, capacity=not args.no_capacity,
                               repeats=(1 if args.quick else 3) if args.repeats is None else args.repeats,
                               regime=args.regime)
    report["command"] = " ".join(["python", "scripts/bench_serving.py", *sys.argv[1:]])
    report["date"] = datetime.datetime.now().isoformat(timespec="seconds")
    report["machine"] = {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                         "loadavg_at_start": load, "loadavg_at_end": os.getloadavg()}

    os.makedirs(args.out, exist_ok=True)
    pngs = []
    for w, results in report["_results"].items():
        base = os.path.join(args.out, f"{args.name}_{w}")
        engine_runs = [r for r in results if r.steps]
        timeline = [r for name in ("static", "continuous") for r in engine_runs if r.system == name] or engine_runs
        if timeline:
            pngs.append(plots.occupancy(timeline, base + "_occupancy.png",
                                              f"{w}: seat occupancy, static (tour bus) vs continuous (city bus)"))
        if engine_runs:
            pngs.append(plots.kv_over_time(engine_runs, base + "_kv.png", f"{w}: KV pool and batch over time"))
        pngs.append(plots.latency_cdfs(results, base + "_latency_cdf.png", f"{w}: latency CDFs"))
    report["plots"] = pngs
    report["total_wall_s"] = time.perf_counter() - t0
    path = os.path.join(args.out, f"{args.name}.json")
    with open(path, "w") as f:
        json.dump(serving.report_json(report), f, indent=1)

    print(serving.format_report(report))
    print(f"\nwrote {path} and {len(pngs)} plots under {args.out}/; total {report['total_wall_s']:.0f} s "
          f"(load {report['load_s']:.0f} s, warm-up {report['warmup_s']:.0f} s), load average "
          f"{load[0]:.1f} at start, {report['machine']['loadavg_at_end'][0]:.1f} at end")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
