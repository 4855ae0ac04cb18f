"""pagedjax.benchmarks.serving: workloads, the ideal continuous/static ratio, metrics and tables, the capacity
study, and one small end-to-end run of the serving benchmark on the tiny random model (no hf)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from pagedjax.benchmarks import serving
from pagedjax.metrics import RequestRecord, StepStats

VOCAB = 1000


# -- workloads ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", serving.WORKLOADS)
def test_workloads_are_deterministic(name):
    a = serving.make_workload(name, 50, VOCAB, seed=3)
    b = serving.make_workload(name, 50, VOCAB, seed=3)
    c = serving.make_workload(name, 50, VOCAB, seed=4)
    assert a == b
    assert a != c
    assert len({r.request_id for r in a}) == 50
    assert all(3 <= t < VOCAB for r in a for t in r.prompt_token_ids)
    assert all(r.max_tokens >= 1 and r.prompt_len >= 1 and r.arrival == 0.0 for r in a)


def test_mixed_lengths_follow_the_background_formula():
    reqs = serving.make_workload("mixed", 20_000, VOCAB, seed=0, prompt_mean=24, prompt_floor=8, prompt_cap=128,
                               output_mean=32, output_floor=4, output_cap=192)
    p = np.array([r.prompt_len for r in reqs])
    o = np.array([r.max_tokens for r in reqs])
    assert p.min() >= 8 and p.max() <= 128 and o.min() >= 4 and o.max() <= 192
    # floor + int(Exp(mean)): mean ~ floor + mean - 0.5, the cap barely bites at these ratios
    assert abs(p.mean() - (8 + 24 - 0.5)) < 1.0
    assert abs(o.mean() - (4 + 32 - 0.5)) < 1.0
    # exponential: the median sits at mean * ln 2 above the floor
    assert abs(np.median(o) - (4 + 32 * math.log(2))) < 1.5
    assert (o == 192).mean() == pytest.approx(math.exp(-(192 - 4) / 32), abs=0.005)


def test_similar_and_random_ranges():
    sim = serving.make_workload("similar", 2000, VOCAB, prompt_range=(24, 40), output_range=(32, 40))
    assert {r.prompt_len for r in sim} == set(range(24, 41))
    assert {r.max_tokens for r in sim} == set(range(32, 41))
    rnd = serving.make_workload("random", 4000, VOCAB, input_len=64, output_len=100, range_ratio=0.5)
    p = np.array([r.prompt_len for r in rnd])
    o = np.array([r.max_tokens for r in rnd])
    # vLLM's meaning: uniform in [len * (1 - r), len * (1 + r)]
    assert p.min() == 32 and p.max() == 96 and o.min() == 50 and o.max() == 150
    assert abs(p.mean() - 64) < 1.5 and abs(o.mean() - 100) < 2
    fixed = serving.make_workload("random", 10, VOCAB, input_len=16, output_len=8, range_ratio=0.0)
    assert {(r.prompt_len, r.max_tokens) for r in fixed} == {(16, 8)}


def test_shared_prefix_requests_share_exactly_the_prefix():
    reqs = serving.make_workload("shared-prefix", 20, VOCAB, prefix_len=64, suffix_range=(8, 12), output_range=(5, 6))
    prefix = reqs[0].prompt_token_ids[:64]
    assert all(r.prompt_token_ids[:64] == prefix for r in reqs)
    assert all(8 <= r.prompt_len - 64 <= 12 and 5 <= r.max_tokens <= 6 for r in reqs)
    # the suffixes differ: the prefix is the only thing they share
    assert len({r.prompt_token_ids[64:] for r in reqs}) == 20


def test_poisson_arrivals_keep_the_lengths():
    offline = serving.make_workload("mixed", 3000, VOCAB, seed=1)
    online = serving.make_workload("mixed", 3000, VOCAB, seed=1, request_rate=4.0)
    assert [(r.prompt_token_ids, r.max_tokens) for r in offline] == [(r.prompt_token_ids, r.max_tokens) for r in online]
    arr = np.array([r.arrival for r in online])
    assert np.all(np.diff(arr) >= 0)
    gaps = np.diff(np.concatenate([[0.0], arr]))
    assert gaps.mean() == pytest.approx(0.25, rel=0.06)
    assert gaps.std() == pytest.approx(0.25, rel=0.1)   # exponential: std = mean


def test_bad_workload_arguments():
    with pytest.raises(ValueError, match="workload"):
        serving.make_workload("nope", 4, VOCAB)
    with pytest.raises(ValueError, match="knobs"):
        serving.make_workload("mixed", 4, VOCAB, prefix_len=3)
    with pytest.raises(ValueError, match="num_requests"):
        serving.make_workload("mixed", 0, VOCAB)
    with pytest.raises(ValueError, match="request_rate"):
        serving.make_workload("mixed", 4, VOCAB, request_rate=0)
    with pytest.raises(ValueError, match="range_ratio"):
        serving.make_workload("random", 4, VOCAB, range_ratio=1.0)


def test_max_request_len_bounds_every_request():
    for name in serving.WORKLOADS:
        reqs = serving.make_workload(name, 500, VOCAB)
        assert max(r.prompt_len + r.max_tokens for r in reqs) <= serving.max_request_len(name)


# -- the ideal ratio ------------------------------------------------------------------------------------
def test_ideal_ratio_hand_example():
    # 2 seats, outputs 1, 10, 1, 10. Static: batches [1, 10] and [1, 10] run 10 steps each = 20 steps.
    # Continuous, FCFS with no overhead: seat A runs 1 (steps 0-1), then 1 (1-2), then 10 (2-12);
    # seat B runs 10 (0-10): 12 steps. Perfect packing: 40 static seat-steps / 22 tokens.
    r = serving.ideal_ratio([1, 10, 1, 10], seats=2)
    assert (r["static_steps"], r["continuous_steps"]) == (20, 12)
    assert r["ideal"] == pytest.approx(20 / 12)
    assert (r["static_seat_steps"], r["continuous_seat_steps"], r["output_tokens"]) == (40, 24, 22)
    assert r["static_held_seat_steps"] == 40
    assert r["perfect"] == pytest.approx(40 / 22)
    assert r["static_busy_fraction"] == pytest.approx(22 / 40)


def test_ideal_ratio_edges():
    assert serving.ideal_ratio([7] * 8, seats=4)["ideal"] == 1.0     # equal lengths: nothing to gain
    assert serving.ideal_ratio([7] * 8, seats=4)["perfect"] == 1.0
    assert serving.continuous_steps([3, 9, 2], seats=8) == 9             # fewer requests than seats
    assert serving.static_steps([3, 9, 2, 4, 1], seats=2) == 9 + 4 + 1
    # the last batch is partial: its seat-steps count only its members
    r = serving.ideal_ratio([3, 9, 2], seats=2)
    assert (r["static_seat_steps"], r["static_held_seat_steps"]) == (2 * 11, 2 * 9 + 1 * 2)


# -- metrics and tables ---------------------------------------------------------------------------------
def _record(rid, arrival, times, prompt=10, first_scheduled=None):
    return RequestRecord(request_id=rid, group_id=rid, num_prompt_tokens=prompt, num_output_tokens=len(times),
                         arrival=arrival, first_scheduled=arrival if first_scheduled is None else first_scheduled,
                         first_token=times[0], finished=times[-1], token_times=list(times), finish_reason="length",
                         num_preemptions=0, num_cached_tokens=0)


def test_serving_metrics_hand_example():
    recs = [_record("a", 0.0, [0.5, 1.0, 1.5]), _record("b", 0.0, [1.0, 3.0], prompt=30, first_scheduled=1.0)]
    m = serving.serving_metrics(recs, start=0.0, end=3.0)
    assert m["completed"] == 2 and m["duration_s"] == 3.0
    assert m["total_output_tokens"] == 5 and m["total_input_tokens"] == 40
    assert m["output_throughput"] == pytest.approx(5 / 3)
    assert m["total_token_throughput"] == pytest.approx(45 / 3)
    assert m["request_throughput"] == pytest.approx(2 / 3)
    assert m["ttft_ms"]["mean"] == pytest.approx(750)
    # TPOT = (e2e - TTFT) / (n - 1): a (1.5 - 0.5) / 2 = 0.5 s, b (3 - 1) / 1 = 2 s
    assert m["tpot_ms"]["mean"] == pytest.approx(1250)
    assert m["itl_ms"]["n"] == 3 and m["itl_ms"]["mean"] == pytest.approx((500 + 500 + 2000) / 3)
    assert m["e2e_ms"]["p50"] == pytest.approx(2250)
    # the queue emptied at t=1.0 (b's first schedule): a's tokens at 0.5 and 1.0 and b's at 1.0 by then
    assert m["saturated_s"] == 1.0 and m["saturated_output_throughput"] == pytest.approx(3.0)


def _step(i, *, rows=4, running=4, usage=0.5, util=0.9, preempted=0, q=0, h=0):
    return StepStats(step=i, time=float(i), num_running=running, num_waiting=0, num_swapped=0, num_prefill_tokens=0,
                     num_decode_tokens=rows, num_rows=rows, used_blocks=10, allocated_slots=160, real_tokens=144,
                     kv_utilization=util, kv_usage=usage, num_preempted=preempted, prefix_query_tokens=q,
                     prefix_hit_tokens=h)


def test_kv_metrics():
    steps = [_step(0, usage=0.95, util=0.98, q=100, h=75), _step(1, usage=0.5, util=0.8, running=6, preempted=2),
             _step(2, rows=0, running=0, usage=0.0, util=1.0)]
    k = serving.kv_metrics(steps, full_threshold=0.9)
    assert k["num_steps"] == 2                     # the idle step is not counted
    assert k["peak_kv_usage"] == 0.95 and k["mean_kv_usage"] == pytest.approx(0.725)
    assert k["mean_kv_utilization"] == pytest.approx(0.89)
    assert k["kv_utilization_when_full"] == pytest.approx(0.98) and k["steps_pool_full"] == 1
    assert (k["peak_running"], k["preemptions"], k["prefix_hit_rate"]) == (6, 2, 0.75)


def test_fmt_and_format_table():
    assert serving.fmt(None) == "-" and serving.fmt(float("nan")) == "-"
    assert serving.fmt(0.1234, "%") == "12.3%" and serving.fmt(3.14159, ".2f") == "3.14"
    rows = [{"system": "continuous", "a": {"b": 1.5}, "n": 3}, {"system": "hf", "a": {"b": None}, "n": None}]
    table = serving.format_table(rows, [("system", "system", "s"), ("value", "a.b", ".1f"), ("n", "n", "d")])
    lines = table.splitlines()
    assert lines[0].split() == ["system", "value", "n"]
    assert set(lines[1]) == {"-"}
    assert lines[2].split() == ["continuous", "1.5", "3"] and lines[3].split() == ["hf", "-", "-"]
    assert len({len(line) for line in lines}) == 1    # aligned


def test_report_json_is_strict_json():
    out = serving.report_json({"request_rate": math.inf, "x": [1.0, float("nan")], "_results": object()})
    assert out == {"request_rate": "inf", "x": [1.0, "nan"]}
    json.dumps(out, allow_nan=False)


def test_kernel_timings(tmp_path):
    rows = [dict(batch=b, context=c, block_size=s, paged_shuffled_s=s * 1e-6 * b, contiguous_s=1e-6 * b,
                 shuffled_over_contiguous=float(s)) for b in (8, 64) for c in (512, 2048) for s in (16, 64)]
    path = tmp_path / "k.json"
    path.write_text(json.dumps({"timings_meaningful": False, "rows": rows}))
    assert serving.kernel_timings(str(path)) == {}
    path.write_text(json.dumps({"timings_meaningful": True, "device": "H200", "rows": rows}))
    k = serving.kernel_timings(str(path))
    assert set(k) == {16, 64} and k[64]["batch"] == 64 and k[64]["context"] == 2048
    assert k[64]["paged_ms"] == pytest.approx(64 * 64e-3)
    assert serving.kernel_timings(str(tmp_path / "missing.json")) == {}


def test_context_page_buckets():
    assert serving.context_page_buckets(16, (128, 256, 640)) == (8, 16, 40)
    assert serving.context_page_buckets(128, (128, 256)) == (1, 2)
    assert serving.context_page_buckets(1, (128,)) == (128,)


def test_capacity_study_paged_admits_more():
    rng = np.random.default_rng(0)
    lengths = list(np.minimum(1024, 20 + rng.exponential(150, 60).astype(int)))
    r = serving.capacity_study(lengths, capacity=4096, max_model_len=1024, max_num_seqs=64,
                             max_num_batched_tokens=2048)
    assert r["contiguous"]["peak_running"] == 4          # 4096 slots / 1024 per reservation
    assert r["paged"]["peak_running"] >= 4 * r["contiguous"]["peak_running"]
    assert r["paged"]["finished"] == r["contiguous"]["finished"] == 60
    assert r["paged"]["kv_utilization_when_full"] > 0.9 > r["contiguous"]["kv_utilization_when_full"]


# -- end to end on the tiny random model ------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_report():
    knobs = {"mixed": dict(prompt_mean=6, prompt_floor=2, prompt_cap=24, output_mean=8, output_floor=1, output_cap=40),
             "similar": dict(prompt_range=(4, 8), output_range=(10, 12)),
             "shared-prefix": dict(prefix_len=48, suffix_range=(2, 6), output_range=(3, 5))}
    return serving.run_serving("tiny-random", workloads=("mixed", "similar", "shared-prefix"),
                             systems=("continuous", "static", "contiguous"),
                             num_requests={"mixed": 24, "similar": 16, "shared-prefix": 6}, max_num_seqs=8,
                             knobs=knobs, progress=False, capacity=False, log=lambda s: None,
                             engine_overrides=dict(max_num_batched_tokens=32, page_buckets=(4, 32), reservations=4))


def test_end_to_end_every_system_generates_the_same_tokens(tiny_report):
    for w, entry in tiny_report["workloads"].items():
        want = {r.request_id: r.max_tokens for r in serving.make_workload(
            w, entry["num_requests"], 384, **{k: v for k, v in entry["knobs"].items()})}
        for system, res in entry["systems"].items():
            got = {r["id"]: r["output"] for r in res["requests"]}
            assert got == want, (w, system)
            assert res["summary"]["compilations"] == 0, (w, system)
            assert res["summary"]["completed"] == entry["num_requests"]


def test_cost_model_ideal_predicts_every_engine_system(tiny_report):
    entry = tiny_report["workloads"]["mixed"]
    cm = entry["cost_model"]
    assert set(cm["systems"]) == {"continuous", "static", "contiguous"}
    for v in cm["systems"].values():
        assert v["predicted_duration_s"] > 0 and v["measured_over_predicted"] > 0
        assert v["measured_over_predicted"] == pytest.approx(v["measured_duration_s"] / v["predicted_duration_s"])
    r = entry["ratios"]
    assert r["cost_model_ideal"] == pytest.approx(cm["predicted_continuous_over_static"])
    assert r["measured_over_cost_model_ideal"] == pytest.approx(r["continuous_over_static"] / r["cost_model_ideal"])
    assert tiny_report["regime"] == "padded"
    assert "cost-model ideal (padded regime" in serving.format_report(tiny_report)


def test_the_shrinking_regime_keeps_the_engines_default_token_buckets():
    report = serving.run_serving("tiny-random", workloads=("similar",), systems=("continuous", "static"),
                                 num_requests=8, max_num_seqs=16, progress=False, capacity=False, log=lambda s: None,
                                 knobs={"similar": dict(prompt_range=(4, 8), output_range=(3, 6))}, regime="shrinking",
                                 engine_overrides=dict(page_buckets=(4, 32), reservations=4))
    # on a CPU 1, then from 8: a static batch's decode steps shrink with its live rows
    assert tuple(report["engine_config"]["token_buckets"][:3]) == (1, 8, 16) and report["regime"] == "shrinking"
    with pytest.raises(ValueError, match="regime must be one of"):
        serving.run_serving("tiny-random", workloads=("similar",), regime="fixed", log=lambda s: None)


def test_end_to_end_policies_behave_as_named(tiny_report):
    mixed = {s: e["summary"] for s, e in tiny_report["workloads"]["mixed"]["systems"].items()}
    # 4 reservations of max_model_len: contiguous never runs more than 4; continuous fills 8 seats
    assert mixed["contiguous"]["peak_running"] == 4
    assert mixed["continuous"]["peak_running"] == 8
    assert mixed["static"]["num_steps"] > mixed["continuous"]["num_steps"]
    assert mixed["contiguous"]["mean_kv_utilization"] < mixed["continuous"]["mean_kv_utilization"]
    assert mixed["continuous"]["config"]["num_blocks"] == mixed["contiguous"]["config"]["num_blocks"]
    ideal = tiny_report["workloads"]["mixed"]["ideal"]
    # steps track the no-overhead schedules (prefill chunks add a few)
    assert ideal["continuous_steps"] <= mixed["continuous"]["num_steps"] <= ideal["continuous_steps"] + 12
    assert ideal["static_steps"] <= mixed["static"]["num_steps"] <= ideal["static_steps"] + 12
    sp = tiny_report["workloads"]["shared-prefix"]["systems"]["continuous"]["summary"]
    assert sp["prefix_hit_rate"] > 0.5
    assert tiny_report["workloads"]["shared-prefix"]["systems"]["contiguous"]["summary"]["prefix_hit_rate"] == 0


def test_end_to_end_report_formats_and_serializes(tiny_report):
    text = serving.format_report(tiny_report)
    for needle in ("== mixed", "== similar", "== shared-prefix", "out tok/s", "TTFT mean", "ITL mean",
                   "KV util mean", "where the time goes", "ideal continuous/static", "== headline figures",
                   "compilations after warm-up, worst engine run: 0"):
        assert needle in text, needle
    json.dumps(serving.report_json(tiny_report), allow_nan=False)
    series = tiny_report["_results"]["mixed"][0].step_series()
    assert len(series["time"]) == tiny_report["workloads"]["mixed"]["systems"]["continuous"]["summary"]["num_steps"]


def test_plots_write_pngs(tiny_report, tmp_path):
    from pagedjax.benchmarks import plots

    results = tiny_report["_results"]["mixed"]
    for fn in (plots.occupancy, plots.kv_over_time, plots.latency_cdfs):
        path = fn(results, str(tmp_path / f"{fn.__name__}.png"))
        assert (tmp_path / f"{fn.__name__}.png").stat().st_size > 1000, path
    rows = [{"block_size": 8, "kv_waste": 0.01, "admitted": 60}, {"block_size": 16, "kv_waste": 0.02, "admitted": 59}]
    assert plots.block_size_ablation(rows, str(tmp_path / "ab.png"))


def test_engine_bench_builds_each_system_from_the_same_weights_and_arguments():
    from pagedjax.model.hub import load_any_model

    loaded = load_any_model("tiny-random", "float32", 0)
    args = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, num_blocks=40, token_buckets=(16,),
                page_buckets=(4,))
    b = serving.EngineBench(loaded, args)
    static = b.engine("static")
    assert static.config.scheduling == "static" and static.config.num_blocks == 40
    compiles = static.num_compilations
    contiguous = b.engine("contiguous")   # the system's changes apply to the base arguments alone
    assert (contiguous.config.scheduling, contiguous.config.allocation) == ("continuous", "contiguous")
    import jax

    same = zip(jax.tree.leaves(contiguous.runner.step_params), jax.tree.leaves(static.runner.step_params))
    assert all(a is b for a, b in same)  # the same weight arrays, not copies
    assert contiguous.num_compilations == compiles  # same shapes: its warm-up found every bucket compiled
    with pytest.raises(ValueError, match="engine system"):
        b.engine("hf")
    reqs = serving.make_workload("mixed", 5, 384, seed=0, prompt_cap=16, output_mean=4, output_cap=8)
    res = b.run("continuous", reqs, progress=False)
    t = res.summary["time_breakdown_s"]
    assert res.summary["completed"] == 5 and t["device step"] > 0 and t["schedule"] > 0
    assert sum(v["steps"] for v in res.summary["device_by_bucket"].values()) == res.summary["num_steps"]


def test_ablate_block_size_runs_one_engine_per_block_size_on_weights_loaded_once(monkeypatch):
    import pagedjax.model.hub as hub

    loads = []
    original = hub.load_any_model

    def counting(*a):
        loads.append(a)
        return original(*a)

    monkeypatch.setattr(hub, "load_any_model", counting)
    report = serving.ablate_block_size((8, 16), model="tiny-random", num_requests=6, max_num_seqs=4,
                                     max_model_len=64, reservations=4, progress=False, log=lambda _: None,
                                     workload_knobs=dict(prompt_cap=16, output_mean=4, output_cap=8))
    assert len(loads) == 1
    rows = {r["block_size"]: r for r in report["rows"]}
    assert set(rows) == {8, 16}
    assert all(r["engine_steps"] > 0 and r["compilations_after_warmup"] == 0 for r in rows.values()), rows


def _result(system, tok_s, compilations=0):
    return serving.SystemResult(system, "w", {"output_throughput": tok_s, "compilations": compilations}, [], 0.0)


def test_median_run_and_repeat_summary():
    runs = {"continuous": [_result("continuous", x) for x in (30.0, 10.0, 20.0)],
            "static": [_result("static", x, c) for x, c in ((10.0, 0), (20.0, 2), (5.0, 0))]}
    assert serving.median_run(runs["continuous"]).summary["output_throughput"] == 20.0
    assert serving.median_run(runs["static"][:2]).summary["output_throughput"] == 10.0   # lower middle
    rep = serving.repeat_summary(runs)
    assert rep["n"] == 3
    assert rep["output_throughput"]["static"] == [10.0, 20.0, 5.0]
    assert rep["continuous_over_static"] == [3.0, 0.5, 4.0]      # pairs of one repeat, not medians
    assert rep["compilations"]["static"] == [0, 2, 0]
    # a compilation in any run shows in the headline, not only one in the median run
    report = {"workloads": {"mixed": {"systems": {"static": {"summary": {"compilations": 0}}}, "ratios": {},
                                      "repeats": rep}}}
    t = [x for x in serving.headline(report) if "compilations" in x["figure"]][0]
    assert t["value"] == 2


def test_repeats_interleave_the_systems_and_report_the_median(monkeypatch):
    order = []
    original = serving.EngineBench.run

    def recording(self, system, requests, **kw):
        order.append(system)
        return original(self, system, requests, **kw)

    monkeypatch.setattr(serving.EngineBench, "run", recording)
    report = serving.run_serving("tiny-random", workloads=("similar",), systems=("continuous", "static"),
                               num_requests=10, max_num_seqs=4, repeats=3, progress=False, capacity=False,
                               log=lambda s: None, knobs={"similar": dict(prompt_range=(4, 8), output_range=(3, 6))},
                               engine_overrides=dict(max_num_batched_tokens=16, page_buckets=(4, 32), reservations=4))
    assert order == ["continuous", "static"] * 3
    entry = report["workloads"]["similar"]
    rep = entry["repeats"]
    assert rep["n"] == 3 and len(rep["continuous_over_static"]) == 3
    for system in ("continuous", "static"):
        xs = sorted(rep["output_throughput"][system])
        assert entry["systems"][system]["summary"]["output_throughput"] == xs[1]
        assert rep["compilations"][system] == [0, 0, 0]
    text = serving.format_report(report)
    assert "3 interleaved runs per engine system" in text and "continuous/static per repeat" in text
    with pytest.raises(ValueError, match="repeats"):
        serving.run_serving("tiny-random", workloads=("similar",), repeats=0, log=lambda s: None)


def test_hf_cb_runs_transformers_continuous_batching_to_each_max_tokens():
    from engine_helpers import make_tiny_hf

    hf = make_tiny_hf()
    reqs = [serving.BenchRequest(f"r{i}", tuple(range(5 + i, 12 + 2 * i)), 3 + (i * 5) % 11, arrival=0.02 * i)
            for i in range(10)]
    res = serving.run_hf_cb(hf, reqs, seats=4, block_size=8, num_blocks=64, max_batch_tokens=64, progress=False)
    assert res.system == "hf-cb" and res.summary["completed"] == 10
    got = {r.request_id: r for r in res.records}
    for q in reqs:
        rec = got[q.request_id]
        assert rec.num_output_tokens == q.max_tokens == len(rec.token_times)
        assert rec.token_times == sorted(rec.token_times) and rec.first_token >= rec.arrival
    assert res.summary["output_throughput"] > 0 and res.summary["config"]["max_requests_per_batch"] == 4
