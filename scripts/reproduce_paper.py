"""The PagedAttention paper's evaluation, reproduced: one subcommand per figure.

    python scripts/reproduce_paper.py validate     # the simulator against the real engine (CPU, ~3 min)
    python scripts/reproduce_paper.py memory       # Fig. 2: KV memory breakdown per policy
    python scripts/reproduce_paper.py latency      # Fig. 12: normalized latency vs request rate
    python scripts/reproduce_paper.py sharing      # Fig. 15: memory saved by parallel sampling / beam search
    python scripts/reproduce_paper.py prefix       # Fig. 16: shared few-shot prefixes
    python scripts/reproduce_paper.py block-size   # Fig. 18: block size vs normalized latency
    python scripts/reproduce_paper.py swap         # Fig. 19: recompute vs swap
    python scripts/reproduce_paper.py all          # every figure (~15 min on 2 cores)

Each writes results/paper/<figure>.json and .png. `--quick` runs a small version of each (what the
tests run). Serving figures replay the workloads through the real scheduler and block allocator in
virtual time (pagedjax.benchmarks.paper) under a step-cost model (pagedjax.benchmarks.cost_model):
`a100`, OPT-13B on an A100-40GB derived from published peak FLOP/s and bandwidth (the paper's
setting, not measured), and `cpu`, SmolLM2-135M on this machine, fitted to the real engine's
steps by `validate` (results/paper/cost_model_cpu.json; fitted afresh if that file is missing).
The sharing figure runs the real engine (its n > 1 and beam search paths); the swap figure
measures the engine's own block moves.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

from pagedjax.benchmarks import paper
from pagedjax.benchmarks.cost_model import StepCostModel, opt_13b_a100, opt_13b_a100_blocks

FIGURES = ("validate", "memory", "latency", "sharing", "prefix", "block-size", "swap")
# what the paper reports, for the printed comparison (and the README)
PAPER = {
    "memory": "KV memory holding real tokens: 20.4-38.2 % in the existing systems, ~96 % for vLLM",
    "latency": "ShareGPT: 1.7-2.7x the sustainable rate of Orca (Oracle), 2.7-8x Orca (Max)",
    "sharing": "Alpaca: 6.1-9.8 % saved by parallel sampling, 37.6-55.2 % by beam search",
    "prefix": "1.67x (one-shot) and 3.58x (five-shot) the throughput of Orca (Oracle)",
    "block-size": "16-128 best on ShareGPT, 16-32 on Alpaca",
    "swap": "swap costly for small blocks (small PCIe transfers), recompute constant; similar at 16-64",
}
A100 = dict(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048)
CPU = dict(max_num_seqs=32, max_num_batched_tokens=512, max_model_len=2048)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _write(out: str, name: str, data: dict, fig=None) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1, default=float)
    if fig is not None:
        fig.tight_layout()
        fig.savefig(os.path.join(out, f"{name}.png"), dpi=110)
        _plt().close(fig)
    print(f"wrote {out}/{name}.json" + (f" and {name}.png" if fig is not None else ""))


# -- the cost models ----------------------------------------------------------------------------------
def cpu_engine_kwargs(quick: bool) -> dict:
    from pagedjax.benchmarks.serving import engine_kwargs

    return engine_kwargs(max_num_seqs=32, max_model_len=512)


def fit_cpu_model(args, quick: bool) -> tuple[dict, StepCostModel]:
    """Fit on two workloads, predict two others: the simulator's validation (and the CPU model)."""
    from pagedjax.benchmarks.serving import EngineBench, make_workload
    from pagedjax.model.hub import load_any_model

    loaded = load_any_model(args.model, "float32", 0)
    V = loaded.model_config.vocab_size
    bench = EngineBench(loaded, cpu_engine_kwargs(quick))
    n = 16 if quick else 32   # short runs, repeated 5 times in turn: medians over the machine's drift
    # the fit spans short and long contexts (the context term is not identified by short ones)
    fit = {"mixed, offline": make_workload("mixed", n, V, seed=1),
           "random 192 in / 96 out, 1.5 req/s": make_workload("random", n // 2, V, seed=2, request_rate=1.5,
                                                              input_len=192, output_len=96)}
    i, o = paper.fitted_lengths("sharegpt", n, seed=3)
    test = {"ShareGPT-like lengths / 8, 2 req/s": paper.requests_from_lengths(
                np.maximum(i // 8, 4), np.maximum(o // 8, 2), request_rate=2.0, seed=3, vocab_size=V, name="sharegpt8"),
            "similar, 6 req/s": make_workload("similar", n, V, seed=4, request_rate=6.0)}
    if quick:
        test.pop("similar, 6 req/s")
    report = paper.validation_study(bench, fit, test, repeats=1 if quick else 5)
    report["model_name"] = args.model
    report["engine"] = {k: v for k, v in bench.engine_args.items() if not isinstance(v, tuple)}
    return report, StepCostModel.from_dict(report["model"])


def cpu_model(args) -> StepCostModel:
    path = os.path.join(args.out, "cost_model_cpu.json")
    if os.path.exists(path):
        return StepCostModel.load(path)
    print("no CPU step-cost model yet: fitting one (run `validate` to see its errors)")
    _, model = fit_cpu_model(args, args.quick)
    os.makedirs(args.out, exist_ok=True)
    model.save(path)
    return model


# -- figures ------------------------------------------------------------------------------------------
def fig_validate(args) -> dict:
    report, model = fit_cpu_model(args, args.quick)
    model.save(os.path.join(args.out, "cost_model_cpu.json"))
    plt = _plt()
    names = list(report["results"])
    fig, ax = plt.subplots(figsize=(7, 3.2))
    metrics = [k for k, _ in paper.VALIDATED]
    w = 0.8 / len(names)
    for j, name in enumerate(names):
        errs = [100 * report["results"][name][m]["error"] for m in metrics]
        ax.bar(np.arange(len(metrics)) + j * w, errs, w, label=name)
    ax.axhline(15, color="red", ls="--", lw=1)
    ax.axhline(-15, color="red", ls="--", lw=1)
    ax.set_xticks(np.arange(len(metrics)) + w * (len(names) - 1) / 2, ["duration", "mean TTFT", "mean TPOT"])
    ax.set_ylabel("prediction error (%)")
    ax.set_title(f"simulator vs real engine ({report['model_name']}, this CPU); fit on other workloads")
    ax.legend(fontsize=7)
    _write(args.out, "validate", report, fig)
    for name, row in report["results"].items():
        print(f"  {name}: " + ", ".join(f"{k} {row[k]['predicted']:.3g} vs {row[k]['measured']:.3g} "
                                         f"({100 * row[k]['error']:+.1f} %)" for k, _ in paper.VALIDATED))
    print(f"  model: {model.describe()}")
    worst = max(abs(row[k]["error"]) for row in report["results"].values() for k, _ in paper.VALIDATED)
    if worst > 0.15 and not args.quick:
        raise SystemExit(f"validate: a prediction error of {worst:.1%} exceeds 15 % (a busy machine moves "
                         "real runs by up to 25 %: rerun it on a quiet one before doubting the simulator)")
    return report


def fig_memory(args) -> dict:
    n = 150 if args.quick else 1000
    reqs = paper.paper_workload("sharegpt", n, request_rate=2.0, seed=0)
    data = paper.memory_study(reqs, opt_13b_a100(), num_blocks=opt_13b_a100_blocks(), **A100)
    plt = _plt()
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = {"real": "tab:green", "reserved": "tab:orange", "internal": "tab:red", "external": "tab:purple"}
    labels = {"real": "token states", "reserved": "reserved (future tokens)", "internal": "internal fragmentation",
              "external": "external fragmentation"}
    systems = ["orca-max", "orca-pow2", "orca-oracle", "paged"]
    left = np.zeros(len(systems))
    for k in colors:
        vals = np.array([100 * data[s]["share_of_used"].get(k, 0.0) for s in systems])
        ax.barh(range(len(systems)), vals, left=left, color=colors[k], label=labels[k])
        for y, (x0, v) in enumerate(zip(left, vals)):
            if v > 6:
                ax.text(x0 + v / 2, y, f"{v:.1f}", ha="center", va="center", fontsize=8, color="white")
        left += vals
    ax.set_yticks(range(len(systems)), [paper.LABELS[s] for s in systems])
    ax.set_xlabel("share of the KV memory in use (%)")
    ax.set_title("KV memory under load: ShareGPT-like, OPT-13B / A100 model", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.45, -0.22), ncol=4)
    _write(args.out, "memory", {"workload": "sharegpt (fitted)", "rate": 2.0, "num_requests": n, "systems": data}, fig)
    for s in systems:
        print(f"  {paper.LABELS[s]:>18}: " + ", ".join(f"{k} {100 * v:.1f} %" for k, v in data[s]["share_of_used"].items()))
    return data


SWEEPS = {  # (workload, cost model name): request rates
    ("sharegpt", "a100"): (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0),
    ("alpaca", "a100"): (2, 5, 10, 15, 20, 25, 30, 40, 50),
    ("sharegpt", "cpu"): (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0),
    ("alpaca", "cpu"): (1, 2, 3, 4, 6, 8, 10, 12),
}


def _models(args) -> dict:
    return {"a100": (opt_13b_a100(), opt_13b_a100_blocks(), A100), "cpu": (cpu_model(args), opt_13b_a100_blocks(), CPU)}


def _curves(ax, res, title):
    for system, pts in res["curves"].items():
        ax.plot([p["rate"] for p in pts], [p["normalized_latency_s"] for p in pts], "o-", ms=3,
                label=f"{paper.LABELS.get(system, system)} ({_fmt(res['sustainable_rate'][system])} req/s)")
    ax.axhline(res["latency_bar_s"], color="gray", ls=":", lw=1)
    ax.set_ylim(0, 4 * res["latency_bar_s"])
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=6)


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"


def fig_latency(args) -> dict:
    n = {"sharegpt": 120 if args.quick else 500, "alpaca": 300 if args.quick else 2000}
    models = _models(args)
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    data = {}
    for col, workload in enumerate(("sharegpt", "alpaca")):
        for row, mname in enumerate(("a100", "cpu")):
            cost, blocks, cfg = models[mname]
            rates = SWEEPS[(workload, mname)][:: 3 if args.quick else 1]
            res = paper.latency_sweep(workload, rates, cost, num_requests=n[workload], num_blocks=blocks, **cfg)
            res["cost_model"] = cost.to_dict()
            data[f"{workload}/{mname}"] = res
            _curves(axes[row][col], res, f"{workload} (fitted), {'OPT-13B / A100 (derived)' if mname == 'a100' else 'SmolLM2-135M / this CPU (fitted)'}")
            print(f"  {workload} / {mname}: sustainable " + ", ".join(
                f"{paper.LABELS[s]} {_fmt(r)}" for s, r in res["sustainable_rate"].items()) + "; paged / each: " +
                ", ".join(f"{s} {_fmt(x)}x" for s, x in res["ratio_to_first"].items() if s != "paged"))
    _write(args.out, "latency", data, fig)
    return data


def fig_sharing(args) -> dict:
    from pagedjax.engine import LLMEngine
    from pagedjax.model.hub import load_any_model

    loaded = load_any_model("tiny-random", "float32", 0)
    V = loaded.model_config.vocab_size
    eng = LLMEngine(loaded, enable_prefix_caching=False, max_num_seqs=64, max_model_len=1024, num_blocks=8000,
                    max_logprobs=20)
    n = 16 if args.quick else 64
    reqs = paper.paper_workload("alpaca", n, seed=0)
    data = paper.sharing_study(eng, [[x % V for x in r.prompt_token_ids] for r in reqs], [r.max_tokens for r in reqs],
                               beam_prompts=8 if args.quick else 32)
    data["workload"] = f"alpaca (fitted), {n} requests; tiny-random model (the lengths decide the blocks)"
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(8, 3))
    for ax, key, title, band in ((axes[0], "parallel", "parallel sampling (n)", (6.1, 9.8)),
                                 (axes[1], "beam", "beam search (width)", (37.6, 55.2))):
        ks = list(data[key])
        ax.bar([str(k) for k in ks], [100 * data[key][k]["saving"] for k in ks], color="tab:blue")
        ax.axhspan(*band, color="tab:orange", alpha=0.25, label="paper's range")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("memory saving (%)")
        ax.legend(fontsize=7)
    _write(args.out, "sharing", data, fig)
    print("  parallel: " + ", ".join(f"n={k} {100 * v['saving']:.1f} %" for k, v in data["parallel"].items()))
    print("  beam:     " + ", ".join(f"k={k} {100 * v['saving']:.1f} %" for k, v in data["beam"].items()))
    return data


def fig_prefix(args) -> dict:
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
    data = {}
    sweeps = {"one-shot": (4, 8, 16, 24, 32, 40, 48, 56, 64), "five-shot": (2, 4, 6, 8, 12, 16, 24, 32, 40)}
    for ax, workload in zip(axes, paper.PREFIXES):
        res = paper.latency_sweep(workload, sweeps[workload][:: 3 if args.quick else 1], opt_13b_a100(),
                                  num_requests=300 if args.quick else 1500, num_blocks=opt_13b_a100_blocks(),
                                  systems=("paged", "paged-no-prefix-cache", "orca-oracle"),
                                  system_changes={"paged-no-prefix-cache": {"enable_prefix_caching": False}}, **A100)
        data[workload] = res
        _curves(ax, res, f"{workload} prefix ({paper.PREFIXES[workload]} tokens), OPT-13B / A100 (derived)")
        print(f"  {workload}: sustainable " + ", ".join(f"{s} {_fmt(r)}" for s, r in res["sustainable_rate"].items())
              + "; paged / each: " + ", ".join(f"{s} {_fmt(x)}x" for s, x in res["ratio_to_first"].items() if s != "paged"))
    _write(args.out, "prefix", data, fig)
    return data


def fig_block_size(args) -> dict:
    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    if args.quick:
        sizes = (4, 16, 64)
    points = {"sharegpt": 2.5, "alpaca": 40.0}   # near the paged knee: memory decides
    data = {}
    plt = _plt()
    fig, ax = plt.subplots(figsize=(6, 3.4))
    for workload, rate in points.items():
        reqs = paper.paper_workload(workload, 120 if args.quick else (500 if workload == "sharegpt" else 2000), rate)
        rows = []
        for bs in sizes:
            cfg = paper.engine_config("paged", num_blocks=opt_13b_a100_blocks(bs), block_size=bs, **A100)
            run = paper.simulate_serving(reqs, cfg, opt_13b_a100(bs))
            rows.append({"block_size": bs, "normalized_latency_s": run.summary["normalized_latency_s"],
                         "mean_running": run.summary["mean_running"], "preemptions": run.summary["preemptions"],
                         "mean_kv_utilization": run.summary["mean_kv_utilization"]})
        data[workload] = {"rate": rate, "rows": rows}
        ax.plot([r["block_size"] for r in rows], [r["normalized_latency_s"] for r in rows], "o-",
                label=f"{workload} (fitted) at {rate} req/s")
        print(f"  {workload} @ {rate}: " + ", ".join(f"{r['block_size']}: {r['normalized_latency_s']:.3f}" for r in rows))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("normalized latency (s/token)")
    ax.set_title("block size, OPT-13B / A100 (derived; no per-block kernel cost)", fontsize=9)
    ax.legend(fontsize=7)
    _write(args.out, "block-size", data, fig)
    return data


def fig_swap(args) -> dict:
    from pagedjax.model.hub import load_any_model

    sizes = (1, 2, 4, 8, 16, 32, 64, 128, 256) if not args.quick else (4, 16, 64)
    measured = paper.swap_costs(load_any_model(args.model, "float32", 0), sizes, tokens=1024 if not args.quick else 256)
    # end to end: ShareGPT beyond the paged system's capacity, so it preempts; swap priced per block
    # from the PCIe model (a100) and from this machine's measured block moves (cpu)
    n = 120 if args.quick else 500
    reqs = paper.paper_workload("sharegpt", n, request_rate=3.0)
    e2e = []
    for row in measured["rows"]:
        bs = row["block_size"]
        r = {"block_size": bs}
        for mode in ("recompute", "swap"):
            cfg = paper.engine_config("paged", num_blocks=opt_13b_a100_blocks(bs), block_size=bs,
                                      preemption_mode=mode, **A100)
            run = paper.simulate_serving(reqs, cfg, opt_13b_a100(bs))
            r[mode] = {"normalized_latency_s": run.summary["normalized_latency_s"],
                       "preemptions": run.summary["preemptions"], "duration_s": run.summary["duration_s"]}
        e2e.append(r)
    # the same on this CPU's fitted model, a swap priced at the block moves measured above, in a
    # pool of 6,400 tokens (so the 32 seats preempt)
    cpu = cpu_model(args)
    cpu_reqs = paper.paper_workload("sharegpt", n // 2, request_rate=1.0)
    e2e_cpu = []
    for row in measured["rows"]:
        bs = row["block_size"]
        cost = StepCostModel({**cpu.coef, "swap_blocks": row["per_block_s"]}, cpu.source + " + measured swaps")
        r = {"block_size": bs, "swap_s_per_block": row["per_block_s"]}
        for mode in ("recompute", "swap"):
            cfg = paper.engine_config("paged", num_blocks=-(-6400 // bs) + 1, block_size=bs, preemption_mode=mode, **CPU)
            run = paper.simulate_serving(cpu_reqs, cfg, cost)
            r[mode] = {"normalized_latency_s": run.summary["normalized_latency_s"],
                       "preemptions": run.summary["preemptions"], "duration_s": run.summary["duration_s"]}
        e2e_cpu.append(r)
    data = {"measured_on_this_machine": measured, "end_to_end_a100": {"rate": 3.0, "num_requests": n, "rows": e2e},
            "end_to_end_cpu": {"rate": 1.0, "num_requests": n // 2, "pool_tokens": 6400, "rows": e2e_cpu}}
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(14, 3.6))
    bs = [r["block_size"] for r in measured["rows"]]
    axes[0].plot(bs, [1e3 * (r["swap_out_s"] + r["swap_in_s"]) for r in measured["rows"]], "o-", label="swap out + in")
    axes[0].axhline(1e3 * measured["recompute_s"], color="tab:red", label="recompute (prefill)")
    axes[0].set_title(f"{measured['tokens']} tokens of KV, {args.model}, this CPU (measured)", fontsize=9)
    axes[0].set_ylabel("ms")
    for mode in ("recompute", "swap"):
        axes[1].plot([r["block_size"] for r in e2e], [r[mode]["normalized_latency_s"] for r in e2e], "o-", label=mode)
    axes[1].set_title("ShareGPT (fitted) at 3 req/s, OPT-13B / A100 (derived)", fontsize=9)
    axes[1].set_ylabel("normalized latency (s/token)")
    for mode in ("recompute", "swap"):
        axes[2].plot([r["block_size"] for r in e2e_cpu], [r[mode]["normalized_latency_s"] for r in e2e_cpu], "o-",
                     label=mode)
    axes[2].set_title("ShareGPT at 1 req/s, SmolLM2 / this CPU (fitted + measured swaps)", fontsize=9)
    axes[2].set_ylabel("normalized latency (s/token)")
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("block size (tokens)")
        ax.legend(fontsize=7)
    _write(args.out, "swap", data, fig)
    for r in measured["rows"]:
        print(f"  block {r['block_size']:>3}: swap out+in {1e3 * (r['swap_out_s'] + r['swap_in_s']):.1f} ms "
              f"({r['bandwidth_gb_s']:.2f} GB/s)")
    print(f"  recompute {1e3 * measured['recompute_s']:.0f} ms")
    for r in e2e:
        print(f"  A100 block {r['block_size']:>3}: recompute {r['recompute']['normalized_latency_s']:.3f}, "
              f"swap {r['swap']['normalized_latency_s']:.3f} s/token ({r['swap']['preemptions']} preemptions)")
    for r in e2e_cpu:
        print(f"  CPU block {r['block_size']:>3}: recompute {r['recompute']['normalized_latency_s']:.3f}, "
              f"swap {r['swap']['normalized_latency_s']:.3f} s/token ({r['swap']['preemptions']} preemptions)")
    return data


RUN = {"validate": fig_validate, "memory": fig_memory, "latency": fig_latency, "sharing": fig_sharing,
       "prefix": fig_prefix, "block-size": fig_block_size, "swap": fig_swap}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("figure", choices=(*FIGURES, "all"))
    p.add_argument("--out", default="results/paper")
    p.add_argument("--model", default="smollm2-135m", help="the model of the CPU measurements")
    p.add_argument("--quick", action="store_true", help="a small version of each figure (seconds to a minute)")
    args = p.parse_args(argv)
    timings = {}
    for fig in FIGURES if args.figure == "all" else (args.figure,):
        t0 = time.perf_counter()
        print(f"== {fig}" + (f" (paper: {PAPER[fig]})" if fig in PAPER else ""))
        RUN[fig](args)
        timings[fig] = time.perf_counter() - t0
        print(f"   {timings[fig]:.0f} s")
    if args.figure == "all":
        print("total " + f"{sum(timings.values()):.0f} s: " + ", ".join(f"{k} {v:.0f} s" for k, v in timings.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
