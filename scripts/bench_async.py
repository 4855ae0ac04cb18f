"""Async scheduling against the synchronous engine: decode steps per second, side by side.

For each model, two engines with the same configuration, one with `async_scheduling=True`, run the
same batch of requests (every seat decoding, half of them greedy and half sampled with seeds), in
interleaved repeats (sync, async, sync, async, ...). Each repeat times a window of decode steps in
which every row decodes and no request finishes, and afterwards checks that both engines produced
identical tokens in that repeat and that nothing compiled after warm-up. (A repeat finds the
previous one's prompt blocks in the prefix cache, and a prompt block computed in another step
shape can differ in the last bits, so later repeats may differ from the first by a greedy flip;
the script reports that too.)

    python scripts/bench_async.py                                  # tiny-random, then SmolLM2-135M
    python scripts/bench_async.py --models tiny-random --repeats 5
Writes results/bench_async.json. On a CPU the "device" is the XLA CPU runtime's threads, which
share the cores with the host's Python thread: the overlap is real but smaller than on an
accelerator.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402

from pagedjax import SamplingParams  # noqa: E402
from pagedjax.engine import LLMEngine  # noqa: E402


def run_batch(eng: LLMEngine, prompts, params, window: int) -> tuple[float, int, dict]:
    """Add the batch, step until every row decodes, time `window` steps, then run to the end.
    Returns (seconds of the window, steps in it, {request id index: token ids})."""
    ids = [eng.add_request(None, {"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
    sched = eng.scheduler
    tokens = {}

    def collect(outs):
        for o in outs:
            if o.finished:
                tokens[ids.index(o.request_id)] = list(o.outputs[0].token_ids)

    # until all prompts are in and every request has produced a couple of tokens
    while min(sched.requests[r].num_output_tokens for r in ids) < 2:
        collect(eng.step())
    t0 = time.perf_counter()
    for _ in range(window):
        collect(eng.step())
    dt = time.perf_counter() - t0
    if len(tokens):
        raise RuntimeError("a request finished inside the timed window: raise --max-tokens")
    while eng.has_unfinished_requests():
        collect(eng.step())
    return dt, window, tokens


def bench_model(model: str, args) -> dict:
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, size=args.prompt_len).tolist() for _ in range(args.batch)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=args.max_tokens, ignore_eos=True)
              for i in range(args.batch)]
    engines = {}
    for mode in ("sync", "async"):
        eng = LLMEngine(model, max_num_seqs=args.batch, max_model_len=args.max_model_len,
                        async_scheduling=mode == "async")
        eng.warmup()
        engines[mode] = eng
    rates = {"sync": [], "async": []}
    host = {"sync": [], "async": []}
    same, repeats_agree = True, True
    first = None
    for _ in range(args.repeats):
        got = {}
        for mode, eng in engines.items():
            n0 = len(eng.step_timings)
            dt, steps, got[mode] = run_batch(eng, prompts, params, args.window)
            rates[mode].append(steps / dt)
            recent = eng.step_timings[n0:]
            host[mode].append(statistics.median(t.schedule + t.pack + t.update + t.outputs for t in recent))
        # both engines have run the same requests before, so their prefix caches hold the same blocks
        same = same and got["sync"] == got["async"]
        first = first or got["sync"]
        repeats_agree = repeats_agree and got["sync"] == first
    compiled = {m: e.num_compilations - e.compilations_at_warmup for m, e in engines.items()}
    ratios = [a / s for s, a in zip(rates["sync"], rates["async"])]
    return dict(model=model, batch=args.batch, prompt_len=args.prompt_len, window=args.window,
                steps_per_s=rates, host_ms_per_step={m: [1e3 * h for h in v] for m, v in host.items()},
                ratio_per_repeat=ratios, ratio_median=statistics.median(ratios),
                identical_tokens=same, repeats_identical=repeats_agree, compilations_after_warmup=compiled)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="tiny-random,smollm2-135m")
    p.add_argument("--batch", type=int, default=32, help="requests = seats, all decoding")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=160)
    p.add_argument("--window", type=int, default=100, help="decode steps timed per repeat")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", default="results/bench_async.json")
    args = p.parse_args(argv)
    results = []
    for model in args.models.split(","):
        r = bench_model(model, args)
        results.append(r)
        med = {m: statistics.median(v) for m, v in r["steps_per_s"].items()}
        hms = {m: statistics.median(v) for m, v in r["host_ms_per_step"].items()}
        print(f"{model}: batch {args.batch} decode, sync {med['sync']:.1f} steps/s, async {med['async']:.1f} steps/s; "
              f"async / sync per repeat {', '.join(f'{x:.2f}' for x in r['ratio_per_repeat'])} "
              f"(median {r['ratio_median']:.2f}); host ms/step sync {hms['sync']:.2f}, async {hms['async']:.2f}; "
              f"identical tokens: {r['identical_tokens']} (repeats identical to the first: {r['repeats_identical']}); "
              f"compilations after warm-up: {r['compilations_after_warmup']}")
    os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
    with open(args.json, "w") as f:
        json.dump(results, f, indent=1)
    ok = all(r["identical_tokens"] and not any(r["compilations_after_warmup"].values()) for r in results)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
