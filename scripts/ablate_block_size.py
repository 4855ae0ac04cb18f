"""Block size: what a bigger block costs in memory and what it buys in speed.

For each block size (default 1, 2, 4, 8, 16, 32, 64, 128; the jnp reference path on a CPU takes any
size, the Pallas kernel 8..128):
  - KV waste and requests admitted at a fixed KV memory: the fragmentation experiment through
    KVCacheManager (200 lengths, 32k token slots, max length 4096);
  - end-to-end output tokens/s of continuous batching on this machine: the default model, a small
    mixed workload, the same KV memory and the same context coverage for every block size (one
    engine each, so each pays its own warm-up);
  - the paged decode kernel's time from results/bench_kernel.json, when scripts/bench_kernel.py
    wrote it on a GPU (interpret-mode CPU timings are ignored).
The logic lives in pagedjax/benchmarks/serving.py (`ablate_block_size`).

    python scripts/ablate_block_size.py                       # ~10 min on 2 CPU cores
    python scripts/ablate_block_size.py --block-sizes 8 16 64 --num-requests 32
    python scripts/ablate_block_size.py --no-engine           # memory columns only (seconds)
Writes results/ablate_block_size.json and results/ablate_block_size.png.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pagedjax.benchmarks import plots, serving


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--block-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--num-requests", type=int, default=48)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--no-engine", action="store_true", help="skip the end-to-end runs")
    p.add_argument("--kernel-json", default="results/bench_kernel.json")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", default="results")
    args = p.parse_args(argv)

    t0 = time.perf_counter()
    report = serving.ablate_block_size(args.block_sizes, model=args.model, num_requests=args.num_requests,
                                     max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                                     run_engine=not args.no_engine, kernel_json=args.kernel_json,
                                     progress=not args.no_progress)
    report["wall_s"] = time.perf_counter() - t0
    os.makedirs(args.out, exist_ok=True)
    png = plots.block_size_ablation(report["rows"], os.path.join(args.out, "ablate_block_size.png"),
                                          f"block size ablation ({args.model})")
    path = os.path.join(args.out, "ablate_block_size.json")
    with open(path, "w") as f:
        json.dump(serving.report_json(report), f, indent=1)

    cols = [c for c in serving.ABLATION_COLUMNS if any(r.get(c[1]) is not None for r in report["rows"])]
    print()
    print(serving.format_table(report["rows"], cols))
    print(f"\nKV waste / admitted: {report['admission']['lengths']}, {report['admission']['capacity']:,} token "
          f"slots, max length {report['admission']['max_model_len']}.")
    if not args.no_engine:
        w = report["workload"]
        print(f"engine: {args.num_requests} mixed requests (outputs {w['output_floor']} + Exp({w['output_mean']}), "
              f"cap {w['output_cap']}), {args.max_num_seqs} seats, {report['kv_token_slots']} KV token slots, "
              f"max_model_len {args.max_model_len}, continuous batching.")
    if report["kernel_json"]:
        k = next((r["kernel_point"] for r in report["rows"] if "kernel_point" in r), "")
        print(f"kernel: {report['kernel_json']} ({k})")
    else:
        print(f"kernel: no GPU timings ({args.kernel_json} missing or measured in interpret mode)")
    for r in report["rows"]:
        if "engine_error" in r:
            print(f"block {r['block_size']}: engine refused: {r['engine_error']}")
    print(f"\nwrote {path} and {png} in {report['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
