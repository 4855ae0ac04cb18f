"""The engine as a rollout worker: weights swapped in place (checked, no compilation, the prefix
cache emptied) and the training-side forward sharing the engine's model."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pagedjax import LLM, SamplingParams
from pagedjax.model.hub import LoadedModel
from pagedjax.testing import TINY_RANDOM, ByteTokenizer
from pagedjax.training import completion_logprobs, pack, token_logprobs

ENGINE = dict(max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32, block_size=8,
              token_buckets=(16, 32), page_buckets=(16,))
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def perturbed(params, scale=0.05, seed=0):
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(treedef, [w + scale * jax.random.normal(k, w.shape, w.dtype) for w, k in zip(leaves, keys)])


@pytest.fixture(scope="module")
def llm():
    llm = LLM("tiny-random", **ENGINE)
    llm.warmup()
    return llm


def test_mismatched_params_are_refused_naming_the_leaf(llm):
    params = llm.params
    held = llm.llm_engine.runner.step_params   # the weights as the step reads them
    bad_shape = jax.tree.map(lambda w: w, params)
    bad_shape["layers"]["q_proj"] = jnp.zeros((1, 2, 3), jnp.float32)
    with pytest.raises(ValueError, match=r"params\['layers'\]\['q_proj'\]: shape \(1, 2, 3\) is not the loaded"):
        llm.update_weights(bad_shape)
    bad_dtype = dict(params, norm=params["norm"].astype(jnp.bfloat16))
    with pytest.raises(ValueError, match=r"params\['norm'\]: dtype bfloat16 is not the loaded model's float32"):
        llm.update_weights(bad_dtype)
    missing = {k: v for k, v in params.items() if k != "norm"}
    with pytest.raises(ValueError, match="the tree differs from the loaded model's"):
        llm.update_weights(missing)
    assert llm.llm_engine.runner.step_params is held   # nothing changed


def test_running_requests_must_be_aborted_or_finished(llm):
    eng = llm.llm_engine
    original = llm.params
    eng.add_request("r", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    eng.step()
    with pytest.raises(RuntimeError, match="1 request\\(s\\) are unfinished; pass abort=True"):
        llm.update_weights(perturbed(original))
    outs = llm.update_weights(original, wait=True)
    assert [o.request_id for o in outs if o.finished] == ["r"] and not eng.has_unfinished_requests()
    eng.add_request("s", {"prompt_token_ids": [5, 6, 7]}, GREEDY)
    eng.step()
    llm.update_weights(original, abort=True)
    assert not eng.has_unfinished_requests() and eng.scheduler.kv.usage().used_blocks == 0


def test_updates_compile_nothing_and_match_a_fresh_engine(llm):
    prompts = [{"prompt_token_ids": list(range(10 + i, 30 + i))} for i in range(4)]
    original = llm.params
    before = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    n = llm.llm_engine.num_compilations
    new = perturbed(original, scale=0.5, seed=1)
    for params in (new, original, new):
        llm.update_weights(params)
        llm.generate(prompts, GREEDY, use_tqdm=False)
    after = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
    assert llm.llm_engine.num_compilations == n   # three updates, four generates: nothing compiled
    assert after != before
    fresh = LLM(LoadedModel(TINY_RANDOM, new, ByteTokenizer()), **ENGINE)
    assert [o.outputs[0].token_ids for o in fresh.generate(prompts, GREEDY, use_tqdm=False)] == after
    llm.update_weights(original)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == before


def test_no_prefix_hit_on_blocks_computed_before_the_update(llm):
    prompt = {"prompt_token_ids": list(range(40, 80))}
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0   # cached before
    llm.collective_rpc("load_weights", args=(perturbed(llm.params, seed=2),))
    first = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert first.num_cached_tokens == 0          # the old blocks are forgotten
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens > 0   # the new ones are hit


def test_training_logprobs_equal_the_engines_and_are_differentiable(llm):
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 384, n).tolist() for n in (5, 17, 30)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=1.0, seed=4, max_tokens=10, logprobs=0, ignore_eos=True),
                        use_tqdm=False)
    completions = [o.outputs[0].token_ids for o in outs]
    logps, mask = completion_logprobs(llm.params, TINY_RANDOM, prompts, completions)
    logps = np.asarray(logps)
    for b, o in enumerate(outs):
        engine = [d[t].logprob for t, d in zip(o.outputs[0].token_ids, o.outputs[0].logprobs)]
        np.testing.assert_allclose(logps[b][mask[b]], engine, atol=2e-4)
    ids, mask = pack(prompts, completions)

    def loss(params):
        return -(token_logprobs(params, TINY_RANDOM, ids) * mask).sum() / mask.sum()

    grads = jax.grad(loss)(llm.params)
    leaves = jax.tree.leaves(grads)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in leaves) and any(float(jnp.abs(g).max()) > 0 for g in leaves)


def test_grpo_toy_learns():
    """scripts/grpo_toy.py end to end (~20 s): the held-out reward at least doubles, the loss is
    finite, the weights moved, and the engine compiled nothing across 250 weight updates."""
    import importlib.util
    import math
    import os
    import sys

    path = os.path.join(os.path.dirname(__file__), "..", "scripts", "grpo_toy.py")
    spec = importlib.util.spec_from_file_location("grpo_toy", path)
    toy = importlib.util.module_from_spec(spec)
    sys.modules["grpo_toy"] = toy
    spec.loader.exec_module(toy)
    r = toy.main(["--out", ""])
    assert r["engine_compilations_after_warmup"] == 0
    assert math.isfinite(r["final_loss"]) and r["max_param_change"] > 1e-3
    assert r["held_out_reward_final"] >= 2 * r["held_out_reward_initial"], r
