"""PNG figures of the serving benchmark (matplotlib, Agg). One function per figure; each takes
`pagedjax.benchmarks.serving.SystemResult`s (or plain dicts for the ablation) and a path."""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np


def _plt():
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError("the benchmark plots need matplotlib: pip install -e '.[bench]' (make run installs it)") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def occupancy(results: Sequence, path: str, title: str = "", max_steps: int = 200) -> str:
    """Seat x step timelines (one panel per result, e.g. static above continuous): each seat's
    request as a colour, white where the seat sat idle."""
    plt = _plt()
    seats = max((len(r.occupancy[0]) for r in results if r.occupancy), default=1)
    ids = []
    for r in results:
        for row in r.occupancy[:max_steps]:
            ids.extend(x for x in row if x is not None)
    index = {rid: i for i, rid in enumerate(dict.fromkeys(ids))}
    fig, axes = plt.subplots(len(results), 1, figsize=(12, 1.0 + 0.12 * seats * len(results) + 0.6 * len(results)),
                             sharex=True, squeeze=False)
    cmap = plt.get_cmap("tab20")
    for ax, r in zip(axes[:, 0], results):
        occ = r.occupancy[:max_steps]
        grid = np.full((seats, max(len(occ), 1)), np.nan)
        for t, row in enumerate(occ):
            for s, rid in enumerate(row):
                if rid is not None:
                    grid[s, t] = index[rid] % 20
        ax.imshow(np.ma.masked_invalid(grid), aspect="auto", interpolation="nearest", cmap=cmap, vmin=0, vmax=19)
        idle = int(np.isnan(grid).sum())
        ax.set_title(f"{r.system}: first {len(occ)} steps, {idle} idle seat-steps of {grid.size} "
                     f"({idle / max(grid.size, 1):.0%})", fontsize=9)
        ax.set_ylabel("seat")
    longest = max((len(r.occupancy[:max_steps]) for r in results), default=1)
    for ax in axes[:, 0]:   # imshow sets each panel's limits; the shared axis must show the longest
        ax.set_xlim(-0.5, longest - 0.5)
    axes[-1, 0].set_xlabel("step")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def kv_over_time(results: Sequence, path: str, title: str = "") -> str:
    """KV pool use (%), KV utilization (real tokens / allocated slots, %) and running requests
    against wall time, one line per engine system."""
    plt = _plt()
    fig, (ax1, ax2, ax3) = plt.subplots(3, 1, figsize=(10, 8), sharex=True)
    for r in results:
        if not r.steps:
            continue
        s = r.step_series()
        ax1.plot(s["time"], 100 * np.asarray(s["kv_usage"]), label=r.system, lw=1)
        ax2.plot(s["time"], 100 * np.asarray(s["kv_utilization"]), label=r.system, lw=1)
        ax3.step(s["time"], s["running"], where="post", label=r.system, lw=1)
    ax1.set_ylabel("KV blocks in use (%)")
    ax2.set_ylabel("KV utilization (%)\nreal tokens / allocated")
    ax3.set_ylabel("running requests")
    ax3.set_xlabel("time since start (s)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def latency_cdfs(results: Sequence, path: str, title: str = "") -> str:
    """Empirical CDFs of TTFT, TPOT, ITL and e2e latency per system (seconds, log x)."""
    plt = _plt()
    from matplotlib import ticker
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.8))
    metrics = (("TTFT", lambda r: [x.ttft for x in r.records]),
               ("TPOT", lambda r: [x.tpot for x in r.records]),
               ("ITL", lambda r: [g for x in r.records for g in x.itls]),
               ("e2e latency", lambda r: [x.e2e for x in r.records]))
    for ax, (name, values) in zip(axes, metrics):
        for r in results:
            xs = np.sort([v for v in values(r) if v is not None and v > 0])
            if xs.size:
                ax.plot(xs, np.arange(1, xs.size + 1) / xs.size, label=r.system, lw=1.2)
        ax.set_xscale("log")
        # labels at 1, 2, 5 x 10^k: a range inside one decade still gets some, and none overlap
        ax.xaxis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
        ax.xaxis.set_major_formatter(ticker.FuncFormatter(lambda x, _: f"{x:g}"))
        ax.xaxis.set_minor_formatter(ticker.NullFormatter())
        ax.set_xlabel(f"{name} (s)")
        ax.set_ylim(0, 1.01)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("fraction of requests (ITL: of gaps)")
    axes[0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def block_size_ablation(rows: Sequence[dict], path: str, title: str = "") -> str:
    """Per block size: KV waste (%), requests admitted at a fixed KV memory, end-to-end output
    tokens/s on this machine, and the kernel time where a GPU measured it."""
    plt = _plt()
    panels = [("kv_waste", "KV waste (%)", 100.0), ("admitted", "requests admitted\nat a fixed KV memory", 1.0),
              ("output_throughput", "end-to-end output tok/s", 1.0), ("kernel_ms", "paged decode kernel (ms)", 1.0)]
    panels = [p for p in panels if any(r.get(p[0]) is not None for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4 * len(panels), 3.6), squeeze=False)
    sizes = sorted({r["block_size"] for r in rows})
    for ax, (key, label, scale) in zip(axes[0], panels):
        pts = [(r["block_size"], r[key] * scale) for r in rows if r.get(key) is not None]
        if pts:
            ax.plot(*zip(*pts), "o-", label="background lengths (mean 608)" if key == "kv_waste" else None)
        if key == "kv_waste":
            eng = [(r["block_size"], 100 * (1 - r["engine_kv_utilization"])) for r in rows
                   if r.get("engine_kv_utilization") is not None]
            if eng:
                ax.plot(*zip(*eng), "s--", label="engine run (short requests)")
                ax.legend(fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("block size (tokens)")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title, fontsize=10)
    return _save(fig, path)
