"""Tensor parallelism on 8 host devices against one device.

The real checks need 8 CPU devices, and XLA fixes the device count when JAX starts, so they run in
one subprocess (this file run as a script, XLA_FLAGS=--xla_force_host_platform_device_count=8)
that reports JSON; the tests below assert on it. The rest of the suite keeps its single device.

The worker writes a tiny random Llama with 8 kv heads (16 query heads, an MLP of 128 columns) as a
HF directory and, for both attention backends ("reference", and "pallas" in interpret mode), runs
the same greedy workload at tensor_parallel_size 1, 2, 4, 8: six prompts through four seats, so
requests join and leave while the others decode, with two token buckets. Every step's logits are
captured through the runner's logits hook.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from pagedjax.config import EngineConfig
from pagedjax.model.llama import ModelConfig
from pagedjax.model.weights import write_random_llama
from pagedjax.parallel import check_tensor_parallel

SIZES = (1, 2, 4, 8)
BACKENDS = ("reference", "pallas")
# the tiny model: H=16, KVH=8, D=16, hidden 64, MLP 128, 2 layers, vocab 256, untied head
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=16,
            num_key_value_heads=8, head_dim=16, max_position_embeddings=256)
ENGINE = dict(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, block_size=8, token_buckets=(8, 16),
              page_buckets=(8,))
PROMPT_LENGTHS = (3, 9, 17, 30, 5, 12)
MAX_TOKENS = 10


# -- the worker (8 devices) --------------------------------------------------------------------------
def _write_tiny_hf(path: Path, seed: int = 0) -> None:
    """config.json + model.safetensors, weights spread wider than HF's init so greedy tokens are
    not near-ties (norms 1 + 0.2 N(0, 1), matrices 0.15 N(0, 1), as tests/engine_helpers.py does)."""
    write_random_llama(path, TINY, seed=seed, matrix_std=0.15, norm_std=0.2)


_CAPTURED: list = []


def _capture_logits(logits, a):
    """logits_hook: every step's live rows' logits to the host (gathered: the hook sees them replicated)."""
    import jax

    jax.debug.callback(lambda x, n: _CAPTURED.append(np.array(x[: int(n)])), logits, a.attention.num_seqs)
    return logits


def _run_one(model_dir: str, backend: str, tp: int, prompts) -> dict:
    import jax

    from pagedjax import LLM, SamplingParams

    llm = LLM(model_dir, tensor_parallel_size=tp, attention_backend=backend, logits_hook=_capture_logits, **ENGINE)
    eng = llm.llm_engine
    llm.warmup()
    _CAPTURED.clear()
    rows = []
    orig = eng.scheduler.schedule

    def schedule():  # who runs each step: the membership the compile counter must not notice
        out = orig()
        rows.append(sorted(r.request_id for r in out.scheduled))
        return out

    eng.scheduler.schedule = schedule
    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy, use_tqdm=False)
    runner = eng.runner
    k, v = runner.kv_cache
    dev0 = k.addressable_shards[0].device
    q_proj, o_proj = runner.params["layers"]["q_proj"], runner.params["layers"]["o_proj"]
    return dict(
        tokens=[o.outputs[0].token_ids for o in outs],
        logits=[x.tolist() for x in _CAPTURED],
        compilations_after_warmup=eng.num_compilations - eng.compilations_at_warmup,
        memberships=len({tuple(r) for r in rows}),
        num_blocks=eng.config.num_blocks,
        k_shards=[list(s.data.shape) for s in k.addressable_shards],
        v_shards=[list(s.data.shape) for s in v.addressable_shards],
        shard_devices=len({s.device for s in k.addressable_shards}),
        q_proj_shards=[list(s.data.shape) for s in q_proj.addressable_shards],
        o_proj_shards=[list(s.data.shape) for s in o_proj.addressable_shards],
        kv_bytes_per_device=runner.kv_bytes_per_device,
        kv_bytes_on_device0=sum(s.data.nbytes for c in (k, v) for s in c.addressable_shards if s.device == dev0),
        num_devices=len(jax.devices()),
    )


def _block_moves(model_dir: str, tp: int) -> dict:
    """copy_blocks, swap_out, swap_in on a sharded pool filled with random data: the moved blocks
    arrive whole (every kv head) and the pool keeps its sharding."""
    import jax

    from pagedjax.model.weights import load_model
    from pagedjax.runner import ModelRunner

    cfg, params, _ = load_model(model_dir)
    ec = EngineConfig(tensor_parallel_size=tp, attention_backend="reference", **ENGINE)
    runner = ModelRunner(cfg, params, ec, num_blocks=12, num_host_blocks=4)
    sharding = runner.kv_cache[0].sharding
    rng = np.random.default_rng(1)
    full = tuple(rng.standard_normal(c.shape).astype(np.float32) for c in runner.kv_cache)
    runner.kv_cache = tuple(jax.device_put(x, sharding) for x in full)
    runner.copy_blocks([(3, 5), (4, 6)])
    runner.swap_out([(3, 1), (7, 2)])
    runner.swap_in([(2, 9)])
    after = [np.asarray(c) for c in runner.kv_cache]
    ok = all(np.array_equal(a[:, :, 5], f[:, :, 3]) and np.array_equal(a[:, :, 6], f[:, :, 4])
             and np.array_equal(h[:, :, 1], f[:, :, 3]) and np.array_equal(h[:, :, 2], f[:, :, 7])
             and np.array_equal(a[:, :, 9], f[:, :, 7]) and np.array_equal(a[:, :, 8], f[:, :, 8])
             for a, f, h in zip(after, full, runner.host_cache))
    return dict(ok=bool(ok), sharding_kept=all(c.sharding == sharding for c in runner.kv_cache))


def _weights_update(model_dir: str, prompts, tp: int = 2) -> dict:
    """update_weights on a sharded engine: new params computed from the sharded ones (they stay
    sharded), nothing compiles, and greedy tokens equal one device's given the same params (passed
    there as host arrays, placed by the engine)."""
    import jax

    from pagedjax import LLM, SamplingParams

    greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    inputs = [{"prompt_token_ids": p} for p in prompts]
    sharded = LLM(model_dir, tensor_parallel_size=tp, attention_backend="reference", **ENGINE)
    sharded.warmup()
    n = sharded.llm_engine.num_compilations
    before = {k: str(v.sharding) for k, v in sharded.params["layers"].items()}
    new = jax.tree.map(lambda w: w * 1.5, sharded.params)
    sharded.update_weights(new)
    tokens = [o.outputs[0].token_ids for o in sharded.generate(inputs, greedy, use_tqdm=False)]
    one = LLM(model_dir, attention_backend="reference", **ENGINE)
    one.update_weights(jax.tree.map(np.asarray, new))
    return dict(compilations=sharded.llm_engine.num_compilations - n,
                sharding_kept=before == {k: str(v.sharding) for k, v in sharded.params["layers"].items()},
                same_tokens=tokens == [o.outputs[0].token_ids for o in one.generate(inputs, greedy, use_tqdm=False)])


def _errors(model_dir: str) -> dict:
    from pagedjax import LLM

    out = {}
    for name, model, tp in (("too_many", model_dir, 16), ("kv_heads", "tiny-random", 4)):
        try:
            LLM(model, tensor_parallel_size=tp, **ENGINE)
            out[name] = None
        except ValueError as e:
            out[name] = str(e)
    return out


def _worker(out_path: str) -> None:
    import tempfile

    model_dir = tempfile.mkdtemp(prefix="tiny_tp_")
    _write_tiny_hf(Path(model_dir))
    rng = np.random.default_rng(7)
    prompts = [rng.integers(3, TINY["vocab_size"], n).tolist() for n in PROMPT_LENGTHS]
    report = {b: {tp: _run_one(model_dir, b, tp, prompts) for tp in SIZES} for b in BACKENDS}
    report["moves"] = _block_moves(model_dir, 4)
    report["weights"] = _weights_update(model_dir, prompts)
    report["errors"] = _errors(model_dir)
    Path(out_path).write_text(json.dumps(report))


# -- the tests (this process: 1 device) ----------------------------------------------------------------
@pytest.fixture(scope="module")
def tp_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("tp") / "report.json"
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8", JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, __file__, str(out)], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(out.read_text())
    return {k: ({int(tp): r for tp, r in v.items()} if k in BACKENDS else v) for k, v in report.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_and_logits_match_one_device(tp_report, backend):
    """Greedy tokens identical to tensor_parallel_size 1, every step's logits within 1e-5 of it
    (max |difference| / max |logit|, per step; the row-split o_proj and down_proj sum in another
    order, nothing else differs)."""
    runs = tp_report[backend]
    base = runs[1]
    assert runs[1]["num_devices"] == 8
    assert len({tuple(t) for t in base["tokens"]}) == len(PROMPT_LENGTHS)  # not degenerate
    assert all(len(set(t)) > 3 for t in base["tokens"])
    for tp in SIZES[1:]:
        r = runs[tp]
        assert r["tokens"] == base["tokens"], f"tensor_parallel_size={tp}"
        assert len(r["logits"]) == len(base["logits"]) > 0
        for step, (a, b) in enumerate(zip(r["logits"], base["logits"])):
            a, b = np.asarray(a), np.asarray(b)
            assert a.shape == b.shape and np.all(np.isfinite(a))
            rel = np.max(np.abs(a - b)) / np.max(np.abs(b))
            assert rel <= 1e-5, f"tensor_parallel_size={tp}, step {step}: relative difference {rel:.2e}"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_compilation_after_warmup_while_membership_changes(tp_report, backend):
    for tp, r in tp_report[backend].items():
        assert r["memberships"] >= 4, "the workload should change who runs several times"
        assert r["compilations_after_warmup"] == 0, f"tensor_parallel_size={tp} compiled after warmup()"


@pytest.mark.parametrize("backend", BACKENDS)
def test_pool_and_weight_shards_per_device(tp_report, backend):
    L, H, KVH, D, hd = (TINY["num_hidden_layers"], TINY["num_attention_heads"], TINY["num_key_value_heads"],
                        TINY["head_dim"], TINY["hidden_size"])
    for tp, r in tp_report[backend].items():
        nb, bs = r["num_blocks"], ENGINE["block_size"]
        assert r["k_shards"] == r["v_shards"] == [[L, KVH // tp, nb, bs, D]] * tp
        assert r["shard_devices"] == tp
        assert r["q_proj_shards"] == [[L, hd, H * D // tp]] * tp
        assert r["o_proj_shards"] == [[L, H * D // tp, hd]] * tp
        # 1/N of the pool per device: what kv_bytes_per_device reports is what device 0 holds
        assert r["kv_bytes_per_device"] == r["kv_bytes_on_device0"] == 2 * L * KVH * nb * bs * D * 4 // tp


def test_block_moves_on_a_sharded_pool(tp_report):
    assert tp_report["moves"] == {"ok": True, "sharding_kept": True}


def test_weight_update_on_a_sharded_engine(tp_report):
    assert tp_report["weights"] == {"compilations": 0, "sharding_kept": True, "same_tokens": True}


def test_errors_on_eight_devices(tp_report):
    e = tp_report["errors"]
    assert e["too_many"] and "tensor_parallel_size (16) exceeds the 8" in e["too_many"]
    assert e["kv_heads"] and "tensor_parallel_size (4) must divide the model's num_kv_heads (2)" in e["kv_heads"]


# -- errors in this process ----------------------------------------------------------------------------
SMOLLM2 = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                      num_kv_heads=3, head_dim=64)


def test_size_must_divide_kv_heads():
    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) must divide the model's num_kv_heads \(3\)"
                                         r".*sizes that fit this model on 8 device\(s\): \[1, 3\]"):
        check_tensor_parallel(2, SMOLLM2, num_devices=8)
    check_tensor_parallel(3, SMOLLM2, num_devices=8)  # 3 kv heads, 9 heads, 1536 columns: fits


def test_size_must_divide_mlp_columns():
    cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=100, num_layers=1, num_heads=8,
                      num_kv_heads=8, head_dim=4)
    with pytest.raises(ValueError, match=r"must divide the model's intermediate_size \(100\)"):
        check_tensor_parallel(8, cfg, num_devices=8)


def test_size_must_not_exceed_devices():
    """This process has one device: the engine refuses before building anything."""
    from pagedjax import LLM

    with pytest.raises(ValueError, match=r"tensor_parallel_size \(2\) exceeds the 1 cpu device\(s\) present"):
        LLM("tiny-random", tensor_parallel_size=2, **ENGINE)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "2"])
def test_config_validates_size(bad):
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(tensor_parallel_size=bad)


if __name__ == "__main__":
    _worker(sys.argv[1])
