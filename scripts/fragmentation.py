"""Contiguous reservation vs paged blocks: how many requests fit in one KV pool, and how much
of the reserved memory holds real tokens: 200 requests of long-tailed lengths (mean 650, at most
4096 tokens) admitted in order into 32,768 token slots, through pagedjax's real allocators.

    python scripts/fragmentation.py            # table + results/fragmentation.png
    python scripts/fragmentation.py --json     # the figures as JSON on stdout
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from pagedjax.benchmarks.memory_study import admission_study, background_lengths, mean_tail_waste

BLOCK_SIZES = [1, 8, 16, 32, 64, 128]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--capacity", type=int, default=32_768, help="KV pool size in token slots")
    ap.add_argument("--max-len", type=int, default=4096, help="max_model_len: the contiguous reservation")
    ap.add_argument("--num-requests", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--block-size", type=int, default=16, help="block size of the headline comparison")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON instead of tables")
    ap.add_argument("--out", default="results/fragmentation.png", help="where to write the plot ('' for none)")
    args = ap.parse_args()

    lengths = background_lengths(args.num_requests, args.seed, max_len=args.max_len)
    kw = dict(capacity=args.capacity, max_model_len=args.max_len)
    headline = [admission_study(lengths, block_size=args.block_size, allocation=a, **kw)
                for a in ("contiguous", "paged")]
    sweep = [dict(admission_study(lengths, block_size=bs, allocation=a, **kw),
                  mean_tail_waste_all=mean_tail_waste(lengths, bs))
             for bs in BLOCK_SIZES for a in ("contiguous", "paged")]
    figures = {"lengths": {"n": len(lengths), "mean": sum(lengths) / len(lengths), "seed": args.seed},
               "capacity": args.capacity, "max_model_len": args.max_len,
               "headline": headline, "mean_tail_waste": mean_tail_waste(lengths, args.block_size),
               "block_size_sweep": sweep}

    if args.out:
        plot(sweep, args.out)
        figures["plot"] = args.out
    if args.json:
        json.dump(figures, sys.stdout, indent=2)
        print()
        return 0

    print(f"KV pool: {args.capacity:,} token slots, max length {args.max_len:,}, "
          f"{len(lengths)} requests (mean length {figures['lengths']['mean']:.0f}), block size {args.block_size}")
    for r in headline:
        name = ("contiguous, reserve max" if r["allocation"] == "contiguous"
                else f"paged, {r['block_size']}-token blocks")
        print(f"  {name:<26} {r['admitted']:>4} requests at once, "
              f"{r['utilization']:6.1%} of reserved slots hold real tokens")
    print(f"\npaged waste is only the unfilled tail of each last block: "
          f"{figures['mean_tail_waste']:.1f} slots per request on average\n")
    print(f"{'block size':>10} | {'contiguous admitted':>19} {'real %':>7} | {'paged admitted':>14} {'real %':>7} "
          f"{'tail waste/req':>14}")
    for i in range(0, len(sweep), 2):
        c, p = sweep[i], sweep[i + 1]
        print(f"{p['block_size']:>10} | {c['admitted']:>19} {c['utilization']:>7.1%} | {p['admitted']:>14} "
              f"{p['utilization']:>7.1%} {p['mean_tail_waste_all']:>14.1f}")
    if args.out:
        print(f"\nplot: {args.out}")
    return 0


def plot(sweep: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(10, 4))
    for alloc, style in (("contiguous", "s--"), ("paged", "o-")):
        rows = [r for r in sweep if r["allocation"] == alloc]
        xs = [r["block_size"] for r in rows]
        ax1.plot(xs, [r["admitted"] for r in rows], style, label=alloc)
        ax2.plot(xs, [100 * (1 - r["utilization"]) for r in rows], style, label=alloc)
    for ax in (ax1, ax2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.grid(alpha=0.3)
        ax.legend()
    ax1.set_ylabel("requests admitted at once")
    ax2.set_ylabel("reserved slots without a real token (%)")
    ax1.set_title("Admitted into 32k token slots")
    ax2.set_title("KV waste")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    raise SystemExit(main())
