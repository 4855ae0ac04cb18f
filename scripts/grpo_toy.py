"""GRPO on a toy task, with pagedjax as the rollout engine and optax as the optimizer, in one process.

    python scripts/grpo_toy.py                 # 250 steps, ~20 s on 2 CPU cores; results/grpo_toy.{json,png}

The policy is a small Llama (random init, pagedjax.model.llama) over a 32-token vocabulary. The
task, checked by the script itself: after a prompt of 6 random tokens, write 8 tokens taken from
the prompt; the reward of a completion is the share of its tokens that occur in the prompt (a
random policy scores ~0.17, a perfect one 1).

Every step: `LLM.generate` samples `--group` completions per prompt (n > 1: the samples share the
prompt's KV blocks copy-on-write) with the engine's logprobs; rewards become group-relative
advantages (reward - group mean) / (group std + eps); the loss is GRPO's clipped ratio
min(r A, clip(r, 1 - eps, 1 + eps) A) per token, r = exp(logp_new - logp_rollout), with an optional
KL penalty to the initial policy (k3 estimator); AdamW takes one step; `LLM.update_weights` hands the
new params to the engine (no compilation; the prefix cache is emptied). Log-probabilities on the
training side come from pagedjax.training, the engine's own model with dense causal attention.

Before and after training, the mean reward on held-out prompts (sampled at temperature 1, fixed
seeds) is measured; the report gives the reward curve and the split of time between rollout,
scoring and update.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pagedjax import LLM, SamplingParams
from pagedjax.model.hub import LoadedModel
from pagedjax.model.llama import ModelConfig, init_random_params
from pagedjax.training import pack, token_logprobs

VOCAB, FIRST, PROMPT_LEN, COMPLETION_LEN = 32, 3, 6, 8   # ids below FIRST are never in prompts
CFG = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2,
                  head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=True,
                  max_position_embeddings=64, bos_token_id=1, eos_token_ids=(2,), architecture="LlamaForCausalLM")
ENGINE = dict(max_model_len=32, max_num_seqs=64, max_num_batched_tokens=128, block_size=8, token_buckets=(64, 128),
              page_buckets=(4,))


def reward(prompt: list[int], completion: list[int]) -> float:
    """The share of the completion's tokens that occur in the prompt."""
    seen = set(prompt)
    return sum(t in seen for t in completion) / len(completion)


def prompts_of(rng: np.random.Generator, n: int) -> list[list[int]]:
    return [rng.integers(FIRST, VOCAB, PROMPT_LEN).tolist() for _ in range(n)]


def evaluate(llm: LLM, prompts: list[list[int]], seed: int) -> float:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=COMPLETION_LEN, ignore_eos=True)
                         for i in range(len(prompts))], use_tqdm=False)
    return float(np.mean([reward(p, o.outputs[0].token_ids) for p, o in zip(prompts, outs)]))


def make_update(optimizer, clip: float, kl_coef: float):
    @jax.jit
    def update(params, ref_params, opt_state, ids, mask, old_logps, adv):
        def loss_fn(p):
            logps = token_logprobs(p, CFG, ids)
            ratio = jnp.exp(logps - old_logps)
            per_token = -jnp.minimum(ratio * adv[:, None], jnp.clip(ratio, 1 - clip, 1 + clip) * adv[:, None])
            if kl_coef:
                ref = token_logprobs(ref_params, CFG, ids)
                per_token += kl_coef * (jnp.exp(ref - logps) - (ref - logps) - 1)   # k3: an unbiased KL estimate
            return (per_token * mask).sum() / jnp.maximum(mask.sum(), 1)

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return update


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=250)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt (n)")
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--clip", type=float, default=0.2)
    ap.add_argument("--kl", type=float, default=0.0, help="KL penalty to the initial policy (0: off)")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="results/grpo_toy")
    args = ap.parse_args(argv)

    params = init_random_params(CFG, jax.random.key(args.seed))
    ref_params = params
    llm = LLM(LoadedModel(CFG, params, None), warmup=False, **ENGINE)
    t0 = time.perf_counter()
    llm.warmup()
    warmup_s = time.perf_counter() - t0
    optimizer = optax.adamw(args.lr, weight_decay=0.0)
    opt_state = optimizer.init(params)
    update = make_update(optimizer, args.clip, args.kl)
    rng = np.random.default_rng(args.seed)
    held_out = prompts_of(np.random.default_rng(args.seed + 10_000), args.eval_prompts)
    initial = evaluate(llm, held_out, seed=777)
    compilations = llm.llm_engine.num_compilations
    times = {"rollout": 0.0, "scoring": 0.0, "update": 0.0, "weights": 0.0}
    curve = []
    for step in range(args.steps):
        prompts = prompts_of(rng, args.prompts)
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(n=args.group, temperature=1.0, seed=args.seed * 100_000 + step,
                                           max_tokens=COMPLETION_LEN, ignore_eos=True, logprobs=0), use_tqdm=False)
        times["rollout"] += time.perf_counter() - t
        t = time.perf_counter()
        rows, completions, rewards, old = [], [], [], []
        for p, o in zip(prompts, outs):
            r = np.array([reward(p, c.token_ids) for c in o.outputs])
            adv = (r - r.mean()) / (r.std() + 1e-4)
            for c, a in zip(o.outputs, adv):
                rows.append(p)
                completions.append(c.token_ids)
                rewards.append(float(a))
                old.append([d[tok].logprob for tok, d in zip(c.token_ids, c.logprobs)])
            curve.append(float(r.mean()))
        ids, mask = pack(rows, completions)
        old_logps = np.zeros(mask.shape, np.float32)
        for b, lp in enumerate(old):
            old_logps[b][mask[b]] = lp
        adv = np.zeros(ids.shape[0], np.float32)
        adv[:len(rewards)] = rewards
        times["scoring"] += time.perf_counter() - t
        t = time.perf_counter()
        params, opt_state, loss = update(params, ref_params, opt_state, ids, mask, old_logps, adv)
        jax.block_until_ready(params)
        times["update"] += time.perf_counter() - t
        t = time.perf_counter()
        llm.update_weights(params)
        times["weights"] += time.perf_counter() - t
        mean_reward = float(np.mean(curve[-args.prompts:]))
        print(f"step {step:3d}: mean reward {mean_reward:.3f}, loss {float(loss):+.4f}", flush=True)
    final = evaluate(llm, held_out, seed=777)
    change = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)))
    total = sum(times.values())
    result = {
        "steps": args.steps, "prompts_per_step": args.prompts, "group": args.group, "lr": args.lr, "kl": args.kl,
        "held_out_reward_initial": initial, "held_out_reward_final": final,
        "improvement": final / initial if initial else None,
        "engine_compilations_after_warmup": llm.llm_engine.num_compilations - compilations,
        "max_param_change": change, "final_loss": float(loss),
        "warmup_s": warmup_s, "seconds": times, "share": {k: v / total for k, v in times.items()},
        "weight_update_ms": 1e3 * times["weights"] / max(args.steps, 1),
        "reward_per_step": [float(np.mean(curve[i * args.prompts:(i + 1) * args.prompts])) for i in range(args.steps)],
    }
    print(f"held-out mean reward: {initial:.3f} before, {final:.3f} after ({result['improvement']:.1f}x); "
          f"engine compilations after warm-up: {result['engine_compilations_after_warmup']}")
    print("time: " + ", ".join(f"{k} {v:.1f} s ({v / total:.0%})" for k, v in times.items())
          + f"; one weight update {result['weight_update_ms']:.1f} ms")
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=2)
        plot(result, args.out + ".png")
        print(f"wrote {args.out}.json and {args.out}.png")
    return result


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(result["reward_per_step"], label="training prompts (mean of the group samples)")
    ax.axhline(result["held_out_reward_initial"], color="gray", ls="--", label="held-out, before")
    ax.axhline(result["held_out_reward_final"], color="green", ls="--", label="held-out, after")
    ax.set(xlabel="GRPO step", ylabel="mean reward", title="GRPO toy: write tokens of the prompt")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
