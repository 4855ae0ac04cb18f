"""Soak: 10,000 requests through the scheduler under a pool that forces preemption, in both
preemption modes, with 5 % of them aborted at random moments; then 500 greedy requests
through the real engine with the tiny random model, again under a tiny pool in both modes
(--no-engine skips it). For each run it prints requests finished / aborted / errored / lost
(lost must be 0), blocks leaked at the end (0), preemptions, wall time, and whether every
request that finished on its own has the tokens of the same requests run with ample memory (it
must). Exits non-zero if any check fails.

    python scripts/soak.py [--requests 10000] [--engine-requests 500] [--no-engine]
                           [--modes recompute swap] [--json results/soak.json]

The logic lives in pagedjax/benchmarks/soak.py (tests/test_soak.py runs it on a few hundred requests).
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pagedjax.benchmarks.soak import (EngineSoakSetup, SoakSetup, ample_run, engine_ample_run, quiet_preemption_warnings,
                           run_soak, soak_engine)


def print_section(name: str, r: dict) -> None:
    seqs = f" ({r['sequences']:,} sequences with their n samples)" if r["sequences"] != r["requests"] else ""
    print(f"[{name}] {r['requests']:,} requests{seqs}, "
          f"preemption_mode={r['mode']}, pool {r['pool']['num_blocks'] - 1} blocks of {r['pool']['block_size']} "
          f"for {r['pool']['max_num_seqs']} seats")
    print(f"  finished {r['finished']:,}   aborted {r['aborted']:,} (of {r['abort_requested']:,} aborts sent; "
          f"the rest had finished)   errored {r['errored']:,}{' (injected)' if r.get('virtual_s') is not None else ''}"
          f"   lost {r['lost']}")
    clock = (f"virtual {r['virtual_s']:.1f} s" if r.get("virtual_s") is not None
             else f"warm-up {r['warmup_s']:.1f} s   {r['tokens_generated']:,} tokens generated")
    print(f"  blocks leaked {r['blocks_leaked']}   preemptions {r['preemptions']:,}   steps {r['steps']:,}   "
          f"wall {r['wall_s']:.1f} s   {clock}")
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
    ap.add_argument("--engine-requests", type=int, default=500, help="requests of the real-engine section")
    ap.add_argument("--no-engine", action="store_true", help="skip the real-engine section (the tiny random model)")
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

    # -- the real engine (skip with --no-engine) --------------------------------------------------
    # the tiny random model, greedy requests, a tiny pool, both preemption modes, outputs
    # compared with an ample-memory engine run
    eng_ref = None
    if not args.no_engine:
        t1 = time.perf_counter()
        eng_setup = EngineSoakSetup()
        eng_ref = engine_ample_run(args.engine_requests, args.seed, eng_setup)
        print(f"engine ample-memory reference run: {len(eng_ref['outputs']):,} requests, "
              f"{eng_ref['preemptions']} preemptions, {eng_ref['wall_s']:.1f} s "
              f"(+ {eng_ref['warmup_s']:.1f} s building and warming up a {eng_setup.ample_num_blocks}-block engine)")
        for mode in args.modes:
            r = soak_engine(args.engine_requests, mode, seed=args.seed, abort_rate=args.abort_rate,
                            setup=eng_setup, reference=eng_ref)
            sections[f"engine_{mode}"] = r
            print_section(f"engine_{mode}", r)
        print(f"engine section: {time.perf_counter() - t1:.1f} s in all (reference and warm-ups included)")

    ok = all(r["ok"] for r in sections.values())
    print(f"soak: {'all checks hold' if ok else 'FAILED'} ({time.perf_counter() - t0:.1f} s in all)")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "reference": {k: v for k, v in reference.items() if k != "outputs"},
                       "engine_reference": eng_ref and {k: v for k, v in eng_ref.items() if k != "outputs"},
                       "sections": sections, "ok": ok}, f, indent=2)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
