"""A step-cost model: the seconds one engine step takes, as a linear function of what it computed.

    seconds = fixed + sum over terms of coef[term] * shape[term]

The terms are `pagedjax.metrics.step_shape`'s keys, recorded by the engine for every step it runs
(`LLMEngine.step_timings[i].shape`) and computed the same way by the simulator from the same
packed inputs:

    tokens, rows, table   the compiled bucket: padded tokens T, padded rows S, block-table cells S * P
    num_tokens, num_rows  the real tokens and rows
    context, pages        context tokens and KV pages attention reads (real rows only)
    swap_blocks           blocks swapped between device and host around the step
    copy_blocks           blocks copied on the device (copy-on-write, contiguous forks)

Where the numbers come from, `source` says:
  - `StepCostModel.fit(shapes, seconds)`: non-negative least squares over timed steps, e.g.
    `from_timings(engine.step_timings)` after a run on this machine. The time of a step is its
    whole period (schedule, pack, device, update, outputs), so host work is in the model too.
  - `from_step_benchmark(json)`: the decode rows of `scripts/bench_step.py`'s JSON, also what
    `scripts/device_check.py` writes on an accelerator.
  - `from_hardware(...)`: a roofline-style model of a model on an accelerator from published
    peak FLOP/s and memory bandwidth (`OPT_13B_A100`): weights read once per step, compute per
    token at an assumed share of peak, KV bytes per context token read. Derived, not measured.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field

import numpy as np

from pagedjax.metrics import StepTiming, step_shape

TERMS = ("fixed", "tokens", "rows", "table", "num_tokens", "num_rows", "context", "pages", "swap_blocks",
         "copy_blocks")
# what a step costs on a CPU running the compiled bucket: a fixed part (reading the weights, host
# work), the padded tokens (every matmul) and the context attention reads
DEFAULT_TERMS = ("fixed", "tokens", "context")


@dataclass
class StepCostModel:
    coef: dict[str, float]                    # seconds per unit of each term ("fixed": per step)
    source: str = ""
    fit_stats: dict = field(default_factory=dict)

    def __post_init__(self):
        unknown = set(self.coef) - set(TERMS)
        if unknown:
            raise ValueError(f"coef has unknown terms {sorted(unknown)} (known: {TERMS})")
        bad = {k: v for k, v in self.coef.items() if not (math.isfinite(v) and v >= 0)}
        if bad:
            raise ValueError(f"coef must be finite and >= 0, got {bad}")

    # -- prediction ------------------------------------------------------------------------------
    def predict(self, shape: dict) -> float:
        return sum(c * (1.0 if k == "fixed" else shape[k]) for k, c in self.coef.items())

    def step_time(self, out, step, block_size: int) -> float:
        """The simulator's clock: seconds for the step packed from `out`."""
        return self.predict(step_shape(out, step, block_size))

    # -- fitting ---------------------------------------------------------------------------------
    @classmethod
    def fit(cls, shapes: Sequence[dict], seconds: Sequence[float], terms: Sequence[str] = DEFAULT_TERMS,
            source: str = "fitted") -> StepCostModel:
        """Non-negative least squares of `seconds` on the terms of `shapes`, in seconds (not
        relative errors): a run's duration is a sum of step times, and an absolute fit keeps that
        sum unbiased (a fit of relative errors under-predicted the total by ~5 % here)."""
        from scipy.optimize import nnls

        unknown = set(terms) - set(TERMS)
        if unknown:
            raise ValueError(f"terms has unknown names {sorted(unknown)} (known: {TERMS})")
        if len(shapes) != len(seconds) or len(shapes) < len(terms):
            raise ValueError(f"need as many seconds as shapes and at least {len(terms)} of each, "
                             f"got {len(shapes)} shapes and {len(seconds)} seconds")
        X = np.array([[1.0 if k == "fixed" else float(s[k]) for k in terms] for s in shapes])
        y = np.asarray(seconds, np.float64)
        scale = np.maximum(X.max(axis=0), 1e-12)   # columns of similar size for the solver
        sol, _ = nnls(X / scale, y)
        model = cls({k: float(c) for k, c in zip(terms, sol / scale)}, source)
        pred = X @ (sol / scale)
        rel = (pred - y) / y
        model.fit_stats = {"steps": len(y), "total_error": float(pred.sum() / y.sum() - 1),
                           "median_abs_step_error": float(np.median(np.abs(rel))),
                           "p90_abs_step_error": float(np.percentile(np.abs(rel), 90))}
        return model

    @classmethod
    def from_timings(cls, timings: Iterable[StepTiming], terms: Sequence[str] = DEFAULT_TERMS,
                     source: str = "fitted to measured engine steps") -> StepCostModel:
        """Fit to an engine's `step_timings` (every step that ran something on the device)."""
        rows = [t for t in timings if t.shape is not None]
        return cls.fit([t.shape for t in rows], [t.total for t in rows], terms, source)

    @classmethod
    def from_step_benchmark(cls, data: dict | str, terms: Sequence[str] = ("fixed", "tokens", "context"),
                            source: str | None = None) -> StepCostModel:
        """Fit to the decode rows of `scripts/bench_step.py`'s JSON (or `scripts/device_check.py`'s
        copy of it on an accelerator): batch B decoding at a mean context, one step's time."""
        if isinstance(data, str):
            with open(data) as f:
                data = json.load(f)
        rows = data.get("rows") or []
        if not rows:
            raise ValueError("step benchmark JSON has no 'rows' (run scripts/bench_step.py --json PATH)")
        shapes = [{"tokens": r["batch"], "rows": r["batch"], "num_tokens": r["batch"], "num_rows": r["batch"],
                   "context": r["batch"] * r["mean_context_after"], "pages": 0, "table": 0, "swap_blocks": 0,
                   "copy_blocks": 0} for r in rows]
        return cls.fit(shapes, [r["step_ms"] / 1e3 for r in rows], terms,
                       source or f"fitted to the step benchmark ({data.get('model', '?')}, {data.get('backend', '?')})")

    @classmethod
    def from_hardware(cls, *, num_params: float, kv_bytes_per_token: float, peak_flops: float, bandwidth: float,
                      weight_bytes: float | None = None, flops_utilization: float = 0.5,
                      swap_bandwidth: float | None = None, block_bytes: float | None = None,
                      overhead: float = 0.0, source: str = "derived from published peak numbers") -> StepCostModel:
        """Weights read once per step (`weight_bytes / bandwidth`, + `overhead`), 2 FLOPs per
        parameter per token at `flops_utilization` of `peak_flops`, the context's KV read at
        `bandwidth`; with `swap_bandwidth` and `block_bytes`, a swapped block costs its copy.
        The terms add: an upper bound where compute and memory traffic overlap."""
        weight_bytes = 2 * num_params if weight_bytes is None else weight_bytes
        coef = {"fixed": weight_bytes / bandwidth + overhead,
                "num_tokens": 2 * num_params / (peak_flops * flops_utilization),
                "context": kv_bytes_per_token / bandwidth}
        if swap_bandwidth and block_bytes:
            coef["swap_blocks"] = block_bytes / swap_bandwidth
        return cls(coef, source)

    # -- persistence -----------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> StepCostModel:
        return cls(dict(d["coef"]), d.get("source", ""), dict(d.get("fit_stats", {})))

    def save(self, path: str) -> None:
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def load(cls, path: str) -> StepCostModel:
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def describe(self) -> str:
        unit = {"fixed": "per step"}
        return ", ".join(f"{k} {v * 1e3:.4g} ms {unit.get(k, 'each')}" for k, v in self.coef.items())


# OPT-13B in fp16 on one A100-40GB, the paper's main setting: 13e9 parameters (26 GB), 40 layers
# of hidden size 5120 (KV: 2 x 40 x 5120 x 2 bytes = 800 KiB per token); the A100's published
# 312 TFLOP/s (fp16 tensor cores) and 1,555 GB/s (HBM2); swaps over PCIe 4.0 x16 at ~25 GB/s.
OPT_13B = dict(num_params=13e9, kv_bytes_per_token=2 * 40 * 5120 * 2)
A100_40GB = dict(peak_flops=312e12, bandwidth=1.555e12, swap_bandwidth=25e9)
# the KV memory the paper's Figure 1 shows for OPT-13B on an A100-40GB: about 12 GB (>30 % of 40 GB)
OPT_13B_A100_KV_BYTES = 12e9


def opt_13b_a100(block_size: int = 16) -> StepCostModel:
    """The paper's OPT-13B on an A100-40GB as a step-cost model derived from published numbers."""
    return StepCostModel.from_hardware(
        **OPT_13B, **A100_40GB, block_bytes=OPT_13B["kv_bytes_per_token"] * block_size,
        source="OPT-13B fp16 on an A100-40GB, derived from published peak FLOP/s and bandwidth "
               "(312 TFLOP/s at 50 %, 1,555 GB/s, PCIe 25 GB/s), not measured")


def opt_13b_a100_blocks(block_size: int = 16) -> int:
    """KV blocks of `block_size` tokens in the ~12 GB an A100-40GB has for OPT-13B's KV (+1: the null block)."""
    return int(OPT_13B_A100_KV_BYTES // (OPT_13B["kv_bytes_per_token"] * block_size)) + 1
