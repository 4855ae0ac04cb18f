"""Soak: 10,000 requests through the scheduler under a pool that forces preemption, in both
preemption modes, with 5 % of them aborted at random moments (issue 7). For each mode it prints
requests finished / aborted / errored / lost (lost must be 0), blocks leaked at the end (0),
preemptions, wall time, and whether every request that finished on its own has the tokens of
the same requests run with ample memory (it must). Exits non-zero if any check fails.

    python scripts/soak.py [--requests 10000] [--modes recompute swap] [--json results/soak.json]

The logic lives in pagedjax/soak.py (tests/test_soak.py runs it on a few hundred requests).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pagedjax.soak import SoakSetup, ample_run, quiet_preemption_warnings, run_soak


def print_section(name: str, r: dict) -> None:
    print(f"[{name}] {r['requests']:,} requests ({r['sequences']:,} sequences with their n samples), "
          f"preemption_mode={r['mode']}, pool {r['pool']['num_blocks'] - 1} blocks of {r['pool']['block_size']} "
          f"for {r['pool']['max_num_seqs']} seats")
    print(f"  finished {r['finished']:,}   aborted {r['aborted']:,} (of {r['abort_requested']:,} aborts sent; "
          f"the rest had finished)   errored {r['errored']:,} (injected)   lost {r['lost']}")
    print(f"  blocks leaked {r['blocks_leaked']}   preemptions {r['preemptions']:,}   steps {r['steps']:,}   "
          f"wall {r['wall_s']:.1f} s   virtual {r['virtual_s']:.1f} s")
    print(f"  aborted while: {', '.join(f'{k} {v}' for k, v in sorted(r['abort_states'].items()))}")
    print(f"  tokens equal to the ample-memory run: {r['tokens_match_ample']} "
          f"({r['tokens_compared']:,} compared, {r['token_mismatches']} differ)")
    for p in r["block_problems"]:
        print(f"  block invariant broken: {p}")
    if r["exception"]:
        print(f"  FAILED with {r['exception']}")
    print(f"  -> {'ok' if r['ok'] else 'FAILED'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--modes", nargs="+", default=["recompute", "swap"], choices=["recompute", "swap"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--abort-rate", type=float, default=0.05, help="share of requests sent an abort")
    ap.add_argument("--error-rate", type=float, default=1e-4,
                    help="chance a sampled token gets non-finite logits (the request ends with an error)")
    ap.add_argument("--num-blocks", type=int, default=SoakSetup.num_blocks, help="device pool (forces preemption)")
    ap.add_argument("--no-check-kv", action="store_true", help="skip reading every context back each step (faster)")
    ap.add_argument("--json", default="results/soak.json")
    args = ap.parse_args()
    quiet_preemption_warnings()

    setup = SoakSetup(num_blocks=args.num_blocks)
    check_kv = not args.no_check_kv
    sections: dict[str, dict] = {}

    # -- the scheduler with the sim executor ------------------------------------------------------
    t0 = time.perf_counter()
    reference = ample_run(args.requests, args.seed, setup, check_kv)
    print(f"ample-memory reference run: {len(reference['outputs']):,} sequences, "
          f"{reference['preemptions']} preemptions, {reference['wall_s']:.1f} s")
    for mode in args.modes:
        r = run_soak(args.requests, mode, seed=args.seed, abort_rate=args.abort_rate, error_rate=args.error_rate,
                     setup=setup, check_kv=check_kv, reference=reference)
        sections[f"sim_{mode}"] = r
        print_section(f"sim_{mode}", r)

    # -- the real engine (--engine) ------------------------------------------------------------------
    # Added with the engine: the tiny random model, 500 greedy requests, a tiny pool, both
    # preemption modes, outputs compared with an ample-memory engine run. Each run goes into
    # `sections` as a dict with the keys print_section reads and an "ok" flag, so the printing,
    # the exit status and the JSON below cover it unchanged.

    ok = all(r["ok"] for r in sections.values())
    print(f"soak: {'all checks hold' if ok else 'FAILED'} ({time.perf_counter() - t0:.1f} s in all)")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "reference": {k: v for k, v in reference.items() if k != "outputs"},
                       "sections": sections, "ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
