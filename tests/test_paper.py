"""The paper's experiments: workloads, the step-cost model, the simulator (checked against the real
engine), Orca's reservation policies on the real engine, and the figure script's quick runs."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest

from pagedjax.benchmarks import paper
from pagedjax.benchmarks.cost_model import StepCostModel, opt_13b_a100, opt_13b_a100_blocks
from pagedjax.testing import ByteTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# -- workloads ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, mean_in, mean_out", [("sharegpt", 161.31, 337.99), ("alpaca", 19.31, 58.45)])
def test_fitted_workloads_have_the_published_means(name, mean_in, mean_out):
    inputs, outputs = paper.fitted_lengths(name, 40_000, seed=5)
    assert inputs.mean() == pytest.approx(mean_in, rel=0.03)
    assert outputs.mean() == pytest.approx(mean_out, rel=0.03)
    lo_in, hi_in = paper.FITTED[name][0].lo, paper.FITTED[name][0].hi
    assert inputs.min() >= lo_in and inputs.max() <= hi_in
    assert np.percentile(outputs, 90) > 1.8 * np.median(outputs)  # long-tailed, as the histograms


def test_paper_workload_arrivals_and_prefixes():
    reqs = paper.paper_workload("five-shot", 50, request_rate=10.0, seed=1)
    prefix = reqs[0].prompt_token_ids[:paper.PREFIXES["five-shot"]]
    assert all(r.prompt_token_ids[:len(prefix)] == prefix for r in reqs)
    arrivals = [r.arrival for r in reqs]
    assert arrivals == sorted(arrivals) and 2 < arrivals[-1] < 10  # ~5 s for 50 requests at 10/s
    assert [r.max_tokens for r in paper.paper_workload("alpaca", 20, seed=3)] == \
        [r.max_tokens for r in paper.paper_workload("alpaca", 20, request_rate=1.0, seed=3)]
    with pytest.raises(ValueError, match="fitted workload must be one of"):
        paper.fitted_lengths("dolly", 3)


def test_load_lengths_jsonl(tmp_path):
    tok = ByteTokenizer()
    path = tmp_path / "data.jsonl"
    lines = [
        {"input_len": 12, "output_len": 30},
        {"prompt_len": 5, "output_len": 7},
        {"prompt": "hello", "completion": "world!"},
        {"conversations": [{"from": "human", "value": "abc"}, {"from": "gpt", "value": "defg"}]},
        {"conversations": [{"from": "human", "value": "lonely"}]},   # no answer: skipped
        {"instruction": "Add", "input": "1 2", "output": "3"},
    ]
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    pairs = paper.load_lengths_jsonl(str(path), tok)
    assert pairs[:2] == [(12, 30), (5, 7)]
    assert pairs[2] == (len(tok.encode("hello")), len(tok.encode("world!")))
    assert pairs[3] == (len(tok.encode("abc")), len(tok.encode("defg")))
    assert pairs[4] == (len(tok.encode("Add\n1 2")), len(tok.encode("3")))
    assert paper.load_lengths_jsonl(str(path), tok, limit=2) == pairs[:2]
    with pytest.raises(ValueError, match="pass a tokenizer"):
        paper.load_lengths_jsonl(str(path))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "x"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: expected input_len/output_len.*\['text'\]"):
        paper.load_lengths_jsonl(str(bad), tok)


# -- the step-cost model ------------------------------------------------------------------------------
def _shape(tokens, context, rows=8):
    return {"tokens": tokens, "rows": rows, "table": rows * 8, "num_tokens": tokens, "num_rows": rows,
            "context": context, "pages": context // 16, "swap_blocks": 0, "copy_blocks": 0}


def test_cost_model_fit_recovers_known_coefficients_and_round_trips(tmp_path):
    rng = np.random.default_rng(0)
    shapes = [_shape(int(t), int(c)) for t, c in zip(rng.integers(8, 512, 200), rng.integers(0, 20_000, 200))]
    true = {"fixed": 0.02, "tokens": 3e-4, "context": 2e-6}
    seconds = [true["fixed"] + true["tokens"] * s["tokens"] + true["context"] * s["context"] for s in shapes]
    model = StepCostModel.fit(shapes, seconds)
    for k, v in true.items():
        assert model.coef[k] == pytest.approx(v, rel=1e-6)
    assert abs(model.fit_stats["total_error"]) < 1e-9
    model.save(str(tmp_path / "m.json"))
    again = StepCostModel.load(str(tmp_path / "m.json"))
    assert again.predict(shapes[3]) == pytest.approx(seconds[3])
    with pytest.raises(ValueError, match="unknown terms"):
        StepCostModel({"fixed": 1.0, "flops": 1.0})
    with pytest.raises(ValueError, match="finite and >= 0"):
        StepCostModel({"fixed": -1.0})
    with pytest.raises(ValueError, match="at least 3"):
        StepCostModel.fit(shapes[:2], seconds[:2])


def test_cost_model_from_the_step_benchmark_json():
    rows = [{"batch": b, "mean_context_after": c, "step_ms": 20 + 0.5 * b + 0.001 * b * c}
            for b in (1, 8, 32) for c in (100, 500)]
    model = StepCostModel.from_step_benchmark({"model": "m", "backend": "native", "rows": rows})
    assert model.coef["fixed"] == pytest.approx(0.02, rel=1e-6)
    assert model.coef["tokens"] == pytest.approx(5e-4, rel=1e-6)
    assert model.coef["context"] == pytest.approx(1e-6, rel=1e-5)
    with pytest.raises(ValueError, match="no 'rows'"):
        StepCostModel.from_step_benchmark({"rows": []})


def test_a100_model_is_derived_from_the_published_numbers():
    m = opt_13b_a100()
    assert m.coef["fixed"] == pytest.approx(26e9 / 1.555e12)      # the fp16 weights read once per step
    assert m.coef["num_tokens"] == pytest.approx(26e9 / 156e12)   # 2 FLOPs/param at half of 312 TFLOP/s
    assert m.coef["context"] == pytest.approx(819_200 / 1.555e12)  # 800 KiB of K and V per token
    assert m.coef["swap_blocks"] == pytest.approx(16 * 819_200 / 25e9)
    assert opt_13b_a100_blocks(16) == 916 and opt_13b_a100_blocks(32) == 458
    assert "not measured" in m.source


def test_sustainable_rate_interpolates_the_crossing():
    pts = [{"rate": 1, "normalized_latency_s": 0.1}, {"rate": 2, "normalized_latency_s": 0.15},
           {"rate": 3, "normalized_latency_s": 0.35}]
    assert paper.sustainable_rate(pts, 0.25) == pytest.approx(2.5)
    assert paper.sustainable_rate(pts, 1.0) == 3
    assert paper.sustainable_rate(pts, 0.05) is None


# -- the simulator -------------------------------------------------------------------------------------
def test_simulator_memory_breakdown_and_policies_order():
    reqs = paper.paper_workload("sharegpt", 200, request_rate=5.0, seed=0)   # a queue for every system
    data = paper.memory_study(reqs, opt_13b_a100(), num_blocks=opt_13b_a100_blocks(), **paper_a100())
    real = {s: data[s]["share_of_used"]["real"] for s in data}
    assert real["paged"] > 0.9 > real["orca-oracle"] > real["orca-max"]
    assert real["orca-max"] < 0.35
    for s, d in data.items():
        assert sum(d["share_of_pool"].values()) == pytest.approx(1.0)
        assert d["steps_measured"] > 0
    assert data["paged"]["share_of_used"]["reserved"] == 0 and data["paged"]["share_of_used"]["external"] == 0
    assert data["orca-max"]["share_of_used"]["internal"] > 0.4
    # reservations that fit the count of free blocks but no run of them: external fragmentation
    assert data["orca-oracle"]["share_of_used"]["external"] > 0
    running = {s: d["mean_running"] for s, d in data.items()}
    assert running["paged"] > running["orca-oracle"] > running["orca-max"]


def paper_a100():
    return dict(max_num_seqs=256, max_num_batched_tokens=2048, max_model_len=2048)


def test_simulated_serving_summary_matches_the_request_list():
    reqs = paper.paper_workload("alpaca", 60, request_rate=20.0, seed=2)
    cfg = paper.engine_config("paged", num_blocks=200, max_num_seqs=16, max_num_batched_tokens=256,
                              max_model_len=1024)
    run = paper.simulate_serving(reqs, cfg, opt_13b_a100())
    s = run.summary
    assert s["completed"] == 60 and s["total_output_tokens"] == sum(r.max_tokens for r in reqs)
    assert s["duration_s"] >= reqs[-1].arrival
    # normalized latency: at least one step per token
    assert s["normalized_latency_s"] >= opt_13b_a100().coef["fixed"]
    with pytest.raises(ValueError, match="system must be one of"):
        paper.engine_config("vllm", num_blocks=10)


def test_latency_sweep_paged_sustains_more_than_orca():
    res = paper.latency_sweep("sharegpt", (0.5, 1.5, 3.0), opt_13b_a100(), num_requests=150,
                              num_blocks=opt_13b_a100_blocks(), systems=("paged", "orca-max"), **paper_a100())
    assert res["sustainable_rate"]["paged"] > res["sustainable_rate"]["orca-max"]
    assert res["ratio_to_first"]["orca-max"] > 1.5
    assert all(len(c) == 3 for c in res["curves"].values())


# -- Orca's policies on the real engine ------------------------------------------------------------
@pytest.mark.parametrize("reserve", ["max", "pow2", "oracle", "max_model_len", "request"])
def test_orca_policies_on_the_real_engine_give_the_paged_tokens(reserve):
    from pagedjax.engine import LLMEngine
    from pagedjax.model.hub import load_any_model
    from pagedjax.sampling_params import SamplingParams

    loaded = load_any_model("tiny-random", "float32", 0)
    prompts = [[5 + (7 * i + j) % 200 for j in range(3 + 5 * i)] for i in range(6)]
    outs = {}
    for alloc in ("paged", "contiguous"):
        eng = LLMEngine(loaded, num_blocks=40, block_size=4, max_model_len=64, max_num_seqs=4,
                        allocation=alloc, contiguous_reserve=reserve, enable_prefix_caching=False)
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", {"prompt_token_ids": p}, SamplingParams(temperature=0, max_tokens=9 + i,
                                                                              ignore_eos=True))
        got = {}
        while eng.has_unfinished_requests():
            for o in eng.step():
                if o.finished:
                    got[o.request_id] = o.outputs[0].token_ids
        outs[alloc] = got
    assert outs["paged"] == outs["contiguous"]


# -- the sharing figure uses the engine's own n > 1 and beam search ----------------------------------
def test_sharing_study_on_the_real_engine():
    from pagedjax.engine import LLMEngine
    from pagedjax.model.hub import load_any_model

    loaded = load_any_model("tiny-random", "float32", 0)
    V = loaded.model_config.vocab_size
    eng = LLMEngine(loaded, enable_prefix_caching=False, max_num_seqs=32, max_model_len=512, num_blocks=2000,
                    max_logprobs=12)
    reqs = paper.paper_workload("alpaca", 6, seed=0)
    data = paper.sharing_study(eng, [[x % V for x in r.prompt_token_ids] for r in reqs], [r.max_tokens for r in reqs],
                               n_values=(2, 4), beam_widths=(2, 4), beam_prompts=3)
    par, beam = data["parallel"], data["beam"]
    assert 0 < par[2]["saving"] < par[4]["saving"] < 0.5
    assert beam[4]["saving"] > par[4]["saving"] and beam[2]["saving"] > 0.1
    assert not eng.has_unfinished_requests() and eng.scheduler.kv.usage().used_blocks == 0


# -- the figure script -----------------------------------------------------------------------------------
@pytest.mark.parametrize("figure", ["memory", "block-size", "prefix"])
def test_reproduce_paper_quick_figures(tmp_path, figure):
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "reproduce_paper.py"), figure, "--quick",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / f"{figure}.png").stat().st_size > 5000
    data = json.loads((tmp_path / f"{figure}.json").read_text())
    assert data


@pytest.mark.slow
def test_validation_study_fits_on_some_workloads_and_predicts_another():
    """The study behind `scripts/reproduce_paper.py validate` on the real engine (SmolLM2-135M):
    a model fitted to real steps of two workloads predicts a third workload's duration, mean TTFT
    and mean TPOT. How close the prediction is (the 15 % bound) is a timing, checked by the script
    (it exits non-zero past 15 %), not here: this test pins what the study measures and reports."""
    from pagedjax.benchmarks.serving import EngineBench, engine_kwargs, make_workload
    from pagedjax.model.hub import load_any_model

    loaded = load_any_model("smollm2-135m", "float32", 0)
    V = loaded.model_config.vocab_size
    bench = EngineBench(loaded, engine_kwargs(max_num_seqs=32, max_model_len=512))
    fit = {"mixed": make_workload("mixed", 12, V, seed=1),
           "random-long": make_workload("random", 6, V, seed=2, request_rate=1.5, input_len=192, output_len=96)}
    i, o = paper.fitted_lengths("sharegpt", 12, seed=3)
    test = {"sharegpt/8": paper.requests_from_lengths(np.maximum(i // 8, 4), np.maximum(o // 8, 2),
                                                      request_rate=2.0, seed=3, vocab_size=V)}
    report = paper.validation_study(bench, fit, test, repeats=2)
    assert report["fit_steps"] > 20 and report["repeats"] == 2
    assert set(report["model"]["coef"]) == {"fixed", "tokens", "context"}
    row = report["results"]["sharegpt/8"]
    for key, _ in paper.VALIDATED:
        assert len(row[key]["measured_runs"]) == 2 and row[key]["predicted"] > 0
        assert row[key]["error"] == pytest.approx(row[key]["predicted"] / row[key]["measured"] - 1)
        assert math.isfinite(row[key]["error"])
