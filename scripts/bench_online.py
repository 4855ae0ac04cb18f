"""The online benchmark: a client like `vllm bench serve` against `pagedjax serve`, requests arriving
at a rate, and the sweep of latency against request rate the PagedAttention paper draws.

    pagedjax serve smollm2-135m --port 8000 ... &              # any OpenAI-compatible server
    python scripts/bench_online.py --port 8000 --dataset mixed --num-prompts 64 --request-rate 4
    python scripts/bench_online.py --port 8000 --dataset-path lengths.jsonl --request-rate 2 --burstiness 0.5
    python scripts/bench_online.py --sweep                    # starts its own servers: continuous, static,
                                                              # contiguous; rates 1..12 req/s (~10 min)
    python scripts/bench_online.py --compare-offline          # HTTP at saturation vs in-process LLM.generate

The client (aiohttp; nothing of the engine) sends each request to /v1/completions with
`stream: true`, token-id prompts (or text, from a JSONL file), `max_tokens` = the request's output
length and `ignore_eos`, at arrival times drawn as vLLM draws them: gamma-distributed gaps with
shape `--burstiness` (1 = Poisson) and mean 1 / `--request-rate`; `--max-concurrency` caps the
requests in flight. It reports vLLM's metrics (TTFT, TPOT, ITL, E2EL: mean, median, std, p99; request
and token throughput; goodput under `--goodput ttft:MS tpot:MS e2el:MS`) and saves them as vLLM
does (`--save-result`, JSON with the same keys).

Workloads: pagedjax's generators (`--dataset mixed|similar|random|shared-prefix`, the same lengths as
scripts/bench_serving.py) or a JSONL file, one request a line: {"prompt_len": N, "output_len": M}
(a prompt of N random token ids) or {"prompt": "text", "output_len": M}.

--sweep starts a server per system on the same engine arguments (the same KV pool of 10
max_model_len reservations, so contiguous reservation is memory-bound where paging is not), runs
the same request list at each rate, and plots mean normalized latency (each request's end-to-end
latency / its output tokens, averaged) and p99 TTFT against the rate, as the paper's Figure 12. A
system's sustainable rate is the highest swept rate whose normalized latency stays within 2x its
value at the lowest rate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import subprocess
import time
from dataclasses import dataclass, field

import numpy as np

from pagedjax.serve.launch import start_server, stop_server

SYSTEM_FLAGS = {"continuous": [], "static": ["--scheduling", "static"], "contiguous": ["--allocation", "contiguous"]}


@dataclass
class Req:
    prompt: object            # token ids or text
    prompt_len: int
    output_len: int


@dataclass
class Result:
    prompt_len: int
    output_len: int = 0
    ttft: float | None = None
    itl: list = field(default_factory=list)
    latency: float | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


# -- workloads --------------------------------------------------------------------------------------
def load_requests(args) -> list[Req]:
    rng = random.Random(args.seed)
    if args.dataset_path:
        reqs = []
        with open(args.dataset_path) as f:
            for i, line in enumerate(f):
                if not line.strip():
                    continue
                d = json.loads(line)
                if "output_len" not in d or ("prompt" not in d and "prompt_len" not in d):
                    raise SystemExit(f"{args.dataset_path}:{i + 1}: needs output_len and prompt or prompt_len")
                if "prompt" in d:
                    reqs.append(Req(d["prompt"], len(d["prompt"]), int(d["output_len"])))
                else:
                    n = int(d["prompt_len"])
                    reqs.append(Req([rng.randrange(100, args.vocab_size) for _ in range(n)], n, int(d["output_len"])))
        return reqs[:args.num_prompts] if args.num_prompts else reqs
    from pagedjax.benchmarks.serving import make_workload   # lengths only: no engine

    work = make_workload(args.dataset, args.num_prompts or 64, args.vocab_size, seed=args.seed)
    return [Req(list(r.prompt_token_ids), r.prompt_len, r.max_tokens) for r in work]


def arrival_gaps(n: int, rate: float, burstiness: float, seed: int) -> list[float]:
    """Gaps between arrivals: gamma(shape=burstiness, mean=1/rate), as vLLM's bench serve; 0 for inf."""
    if rate == math.inf:
        return [0.0] * n
    rng = np.random.default_rng(seed)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), n).tolist()


# -- the client -------------------------------------------------------------------------------------
async def one_request(session, url: str, model: str, req: Req) -> Result:
    import aiohttp

    body = {"model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    res = Result(req.prompt_len)
    t0 = last = time.perf_counter()
    try:
        async with session.post(url + "/v1/completions", json=body) as r:
            if r.status != 200:
                res.error = f"{r.status}: {(await r.text())[:200]}"
                return res
            async for raw in r.content:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices"):
                    continue
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
        res.latency = time.perf_counter() - t0
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        res.error = repr(e)
    return res


async def run_client(url: str, model: str, reqs: list[Req], rate: float, burstiness: float = 1.0,
                     max_concurrency: int | None = None, seed: int = 0) -> tuple[list[Result], float]:
    import aiohttp

    gaps = arrival_gaps(len(reqs), rate, burstiness, seed)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        async def limited(req):
            if limit is None:
                return await one_request(session, url, model, req)
            async with limit:
                return await one_request(session, url, model, req)

        t0 = time.perf_counter()
        tasks = []
        for req, gap in zip(reqs, gaps):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


def metrics(results: list[Result], duration: float, goodput: dict | None = None) -> dict:
    """vLLM bench serve's result keys (times in ms)."""
    ok = [r for r in results if r.ok]
    n_out = sum(r.output_len for r in ok)
    n_in = sum(r.prompt_len for r in ok)
    out = {"duration": duration, "completed": len(ok), "failed": len(results) - len(ok),
           "total_input_tokens": n_in, "total_output_tokens": n_out,
           "request_throughput": len(ok) / duration, "output_throughput": n_out / duration,
           "total_token_throughput": (n_in + n_out) / duration}
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    series = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    for name, xs in series.items():
        a = np.asarray(xs, dtype=np.float64) * 1e3
        for stat, f in (("mean", np.mean), ("median", np.median), ("std", np.std)):
            out[f"{stat}_{name}_ms"] = float(f(a)) if a.size else None
        out[f"p99_{name}_ms"] = float(np.percentile(a, 99)) if a.size else None
    out["normalized_latency_s_per_token"] = float(np.mean([r.latency / max(r.output_len, 1) for r in ok])) if ok \
        else None
    if goodput:
        good = 0
        for r in ok:
            tpot = (r.latency - r.ttft) / (r.output_len - 1) if r.output_len > 1 else 0.0
            vals = {"ttft": r.ttft * 1e3, "tpot": tpot * 1e3, "e2el": r.latency * 1e3}
            good += all(vals[k] <= v for k, v in goodput.items())
        out["request_goodput"] = good / duration
    return out


def print_metrics(title: str, m: dict) -> None:
    print(f"============ {title} ============")
    for k in ("completed", "failed", "duration", "request_throughput", "output_throughput", "total_token_throughput",
              "request_goodput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_tpot_ms", "median_tpot_ms",
              "p99_tpot_ms", "mean_itl_ms", "median_itl_ms", "p99_itl_ms", "mean_e2el_ms", "p99_e2el_ms",
              "normalized_latency_s_per_token"):
        if m.get(k) is not None:
            v = m[k]
            print(f"{k:<34} {v:.2f}" if isinstance(v, float) else f"{k:<34} {v}")


# -- servers the sweep starts -----------------------------------------------------------------------
def engine_flags(args) -> list[str]:
    from pagedjax.benchmarks.serving import engine_kwargs, max_request_len

    max_model_len = max(256, -(-max_request_len(args.dataset) // 128) * 128)
    kw = engine_kwargs(max_num_seqs=args.max_num_seqs, max_model_len=max_model_len)
    flags = []
    for k, v in kw.items():
        flags += [f"--{k.replace('_', '-')}", *map(str, v)] if isinstance(v, tuple) else [f"--{k.replace('_', '-')}",
                                                                                         str(v)]
    return flags + ["--dtype", args.dtype]


def start_logged_server(model: str, flags: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    with open(log_path, "w") as log:   # the child keeps its own copy of the file descriptor
        try:
            return start_server(model, flags, stdout=log)
        except RuntimeError as e:
            raise SystemExit(f"{e}; see {log_path}") from None


def scrape(url: str) -> dict:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url + "/metrics") as r:
        text = r.read().decode()
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}


def sustainable_rate(rows: list[dict]) -> float | None:
    """The highest rate whose normalized latency is within 2x that of the lowest rate."""
    rows = sorted(rows, key=lambda r: r["rate"])
    base = rows[0]["normalized_latency_s_per_token"]
    ok = [r["rate"] for r in rows if r["normalized_latency_s_per_token"] is not None
          and r["normalized_latency_s_per_token"] <= 2 * base and r["failed"] == 0]
    return max(ok) if ok else None


def sweep(args) -> dict:
    reqs = load_requests(args)
    flags = engine_flags(args)
    os.makedirs(args.result_dir, exist_ok=True)
    table: dict[str, list[dict]] = {}
    for system in args.systems.split(","):
        proc, url = start_logged_server(args.model, flags + SYSTEM_FLAGS[system],
                                 os.path.join(args.result_dir, f"online_{system}_server.log"))
        try:
            model = args.served_model or args.model
            asyncio.run(run_client(url, model, reqs[:8], math.inf))  # warm the path once
            for rate in args.rates:
                results, duration = asyncio.run(run_client(url, model, reqs, rate, args.burstiness, None, args.seed))
                m = {"system": system, "rate": rate, **metrics(results, duration)}
                table.setdefault(system, []).append(m)
                print(f"{system:>10} rate {rate:5.1f}/s: normalized latency {m['normalized_latency_s_per_token'] * 1e3:8.1f}"
                      f" ms/token, p99 TTFT {m['p99_ttft_ms']:8.0f} ms, {m['output_throughput']:6.1f} tok/s, "
                      f"{m['failed']} failed", flush=True)
        finally:
            stop_server(proc)
    summary = {s: sustainable_rate(rows) for s, rows in table.items()}
    out = {"model": args.model, "dataset": args.dataset, "num_prompts": len(reqs), "burstiness": args.burstiness,
           "engine_flags": flags, "rates": args.rates, "rows": table, "sustainable_rate": summary}
    c = summary.get("continuous")
    for other in ("static", "contiguous"):
        if c and summary.get(other):
            out[f"sustainable_continuous_over_{other}"] = c / summary[other]
    print("sustainable rates:", summary, {k: v for k, v in out.items() if k.startswith("sustainable_continuous")})
    path = os.path.join(args.result_dir, args.result_filename or "online_sweep.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    plot_sweep(table, os.path.join(args.result_dir, "online_sweep.png"), args)
    print(f"wrote {path} and {os.path.join(args.result_dir, 'online_sweep.png')}")
    return out


def plot_sweep(table: dict, path: str, args) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for system, rows in table.items():
        rows = sorted(rows, key=lambda r: r["rate"])
        x = [r["rate"] for r in rows]
        a.plot(x, [r["normalized_latency_s_per_token"] for r in rows], marker="o", label=system)
        b.plot(x, [r["p99_ttft_ms"] / 1e3 for r in rows], marker="o", label=system)
    a.set(xlabel="request rate (req/s)", ylabel="normalized latency (s/token)", title="mean e2e / output tokens")
    b.set(xlabel="request rate (req/s)", ylabel="p99 TTFT (s)", title="p99 time to first token")
    for ax in (a, b):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"{args.model}, {args.dataset}, {args.max_num_seqs} seats, arrivals gamma(burstiness {args.burstiness})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def compare_offline(args) -> dict:
    """All requests at once through HTTP (32 streaming clients and more) and through in-process
    LLM.generate on the same engine arguments, interleaved `--repeats` times; plus the server's
    own split of its engine loop into steps and the work between them."""
    from pagedjax import LLM, SamplingParams

    reqs = load_requests(args)
    flags = engine_flags(args)
    from pagedjax.cli import add_engine_args, engine_kwargs   # the same flags, as LLM keyword arguments

    p = argparse.ArgumentParser()
    add_engine_args(p)
    kw = engine_kwargs(p.parse_args(flags))
    llm = LLM(args.model, **kw)   # compiles every bucket
    proc, url = start_logged_server(args.model, flags, os.path.join(args.result_dir, "online_compare_server.log"))
    rows = []
    try:
        model = args.served_model or args.model
        asyncio.run(run_client(url, model, reqs[:8], math.inf))
        llm.generate([{"prompt_token_ids": r.prompt} for r in reqs[:8]], SamplingParams(max_tokens=4), use_tqdm=False)
        for rep in range(args.repeats):
            before = scrape(url)
            results, duration = asyncio.run(run_client(url, model, reqs, math.inf))
            after = scrape(url)
            http = metrics(results, duration)
            steps = after["pagedjax:engine_steps_total"] - before["pagedjax:engine_steps_total"]
            step_s = after["pagedjax:engine_step_seconds_total"] - before["pagedjax:engine_step_seconds_total"]
            loop_s = after["pagedjax:engine_loop_seconds_total"] - before["pagedjax:engine_loop_seconds_total"]
            params = [SamplingParams(temperature=0, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
            eng = llm.llm_engine
            n0 = len(eng.step_timings)
            t0 = time.perf_counter()
            outs = llm.generate([{"prompt_token_ids": r.prompt} for r in reqs], params, use_tqdm=False)
            offline_s = time.perf_counter() - t0
            offline_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            offline_steps = [t for t in eng.step_timings[n0:] if t.bucket is not None]
            offline_step_ms = 1e3 * sum(t.schedule + t.pack + t.execute + t.update + t.outputs
                                        for t in offline_steps) / max(len(offline_steps), 1)
            row = {"repeat": rep, "http_output_tok_s": http["output_throughput"],
                   "offline_output_tok_s": offline_tokens / offline_s,
                   "http_over_offline": http["output_throughput"] / (offline_tokens / offline_s),
                   "server_steps": steps, "server_step_ms": 1e3 * step_s / steps,
                   "server_between_steps_ms": 1e3 * (loop_s - step_s) / steps,
                   "server_overhead_share": (loop_s - step_s) / step_s,
                   "offline_step_ms": offline_step_ms, "http_failed": http["failed"]}
            rows.append(row)
            print(f"repeat {rep}: HTTP {row['http_output_tok_s']:.1f} tok/s, in-process {row['offline_output_tok_s']:.1f} "
                  f"tok/s ({row['http_over_offline']:.1%}); server step {row['server_step_ms']:.1f} ms (in-process "
                  f"{offline_step_ms:.1f}), between steps {row['server_between_steps_ms']:.2f} ms "
                  f"({row['server_overhead_share']:.1%} of a step)", flush=True)
    finally:
        stop_server(proc)
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0] if k != "repeat"}
    out = {"model": args.model, "dataset": args.dataset, "num_prompts": len(reqs), "engine_flags": flags,
           "rows": rows, "median": med}
    print("median:", {k: round(v, 3) for k, v in med.items()})
    path = os.path.join(args.result_dir, args.result_filename or "online_compare.json")
    with open(path, "w") as f:
        json.dump(out, f, indent=2)
    print(f"wrote {path}")
    return out


def parse_goodput(items) -> dict:
    out = {}
    for item in items or []:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2el") or not ms:
            raise SystemExit(f"--goodput takes ttft:MS tpot:MS e2el:MS, got {item!r}")
        out[name] = float(ms)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="the server (default http://HOST:PORT)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model", default="smollm2-135m", help="the model (served name, and what --sweep serves)")
    p.add_argument("--served-model", default=None, help="the name the server knows the model by (default --model)")
    p.add_argument("--dataset", default="mixed", choices=("mixed", "similar", "random", "shared-prefix"))
    p.add_argument("--dataset-path", default=None, help="JSONL: {prompt_len, output_len} or {prompt, output_len}")
    p.add_argument("--num-prompts", type=int, default=None)
    p.add_argument("--vocab-size", type=int, default=49152, help="token ids of generated prompts are below it")
    p.add_argument("--request-rate", type=float, default=math.inf)
    p.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1: Poisson)")
    p.add_argument("--max-concurrency", type=int, default=None)
    p.add_argument("--goodput", nargs="*", default=None, help="ttft:MS tpot:MS e2el:MS")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-result", action="store_true")
    p.add_argument("--result-dir", default="results")
    p.add_argument("--result-filename", default=None)
    p.add_argument("--sweep", action="store_true", help="start a server per system and sweep the request rate")
    p.add_argument("--systems", default="continuous,static,contiguous")
    p.add_argument("--rates", type=float, nargs="+", default=[1, 2, 4, 6, 8, 12])
    p.add_argument("--compare-offline", action="store_true", help="HTTP vs in-process LLM.generate at saturation")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    args = p.parse_args(argv)
    if args.burstiness <= 0:
        p.error(f"--burstiness must be > 0, got {args.burstiness}")
    if args.sweep:
        sweep(args)
        return 0
    if args.compare_offline:
        os.makedirs(args.result_dir, exist_ok=True)
        compare_offline(args)
        return 0
    url = args.base_url or f"http://{args.host}:{args.port}"
    reqs = load_requests(args)
    results, duration = asyncio.run(run_client(url, args.served_model or args.model, reqs, args.request_rate,
                                               args.burstiness, args.max_concurrency, args.seed))
    m = metrics(results, duration, parse_goodput(args.goodput))
    print_metrics("Serving Benchmark Result", m)
    if args.save_result:
        os.makedirs(args.result_dir, exist_ok=True)
        name = args.result_filename or f"online-{args.dataset}-{args.request_rate}qps.json"
        with open(os.path.join(args.result_dir, name), "w") as f:
            json.dump({"model_id": args.model, "request_rate": args.request_rate, "burstiness": args.burstiness,
                       "max_concurrency": args.max_concurrency, **m}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
