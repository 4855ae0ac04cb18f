"""The Llama-family model against Hugging Face PyTorch: tiny random models (fast) and SmolLM2 (slow).

Every step runs ragged and paged, as the engine will: several sequences of different lengths in
one forward call, prefill chunks mixed with decode tokens, block tables drawn in shuffled order,
and a KV cache that starts as NaN everywhere, so a slot read before it was written shows up.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from helpers import require_native, require_native_matmul
from pagedjax import native
from pagedjax.attention import AttentionMetadata, init_kv_cache, make_attention
from pagedjax.model import ModelConfig, compute_logits, forward, load_model
from pagedjax.model.llama import init_random_params, rope_inv_freq
from pagedjax.model.step_weights import to_step_layout

BLOCK_SIZE = 4


class Pager:
    """Host bookkeeping for the tests: per-sequence block tables, cached lengths, slot mapping.

    A stand-in for the scheduler's batch packing: blocks come from a shuffled free list (block 0
    is the null block and never handed out) and are taken as sequences grow.
    """

    def __init__(self, num_blocks: int, rng: np.random.Generator):
        self.free = [int(b) for b in rng.permutation(np.arange(1, num_blocks))]
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    def step(self, work, T: int, S: int, max_blocks: int):
        """work: [(seq_id, new token ids)], in row order. Returns (token_ids, positions, attn, last_rows)."""
        token_ids = np.zeros(T, np.int32)
        positions = np.zeros(T, np.int32)
        slots = np.full(T, -1, np.int32)
        block_tables = np.zeros((S, max_blocks), np.int32)
        context_lens = np.zeros(S, np.int32)
        qsl = np.zeros(S + 1, np.int32)
        t = 0
        for i, (sid, toks) in enumerate(work):
            start = self.lens.get(sid, 0)
            table = self.tables.setdefault(sid, [])
            for j, tok in enumerate(toks):
                p = start + j
                if p // BLOCK_SIZE >= len(table):
                    table.append(self.free.pop())
                token_ids[t], positions[t] = tok, p
                slots[t] = table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                t += 1
            self.lens[sid] = start + len(toks)
            block_tables[i, : len(table)] = table
            context_lens[i] = self.lens[sid]
            qsl[i + 1] = t
        assert t <= T
        qsl[len(work) + 1:] = t
        # padding rows: arbitrary token and position; slot -1 keeps them out of the cache
        token_ids[t:] = 7
        positions[t:] = 3
        attn = AttentionMetadata(jnp.asarray(slots), jnp.asarray(block_tables), jnp.asarray(context_lens),
                                 jnp.asarray(qsl), jnp.asarray(len(work), jnp.int32))
        return jnp.asarray(token_ids), jnp.asarray(positions), attn, qsl[1: len(work) + 1] - 1


@functools.partial(jax.jit, static_argnames=("cfg", "backend"), donate_argnames=("kv_cache",))
def step_fn(params, cfg, token_ids, positions, kv_cache, attn, backend="jnp"):
    """backend: the attention the model runs with (pagedjax.attention), default the jnp reference."""
    hidden, kv_cache = forward(params, cfg, token_ids, positions, kv_cache, attn, make_attention(backend))
    return compute_logits(params, cfg, hidden), kv_cache


def nan_cache(cfg: ModelConfig, num_blocks: int, dtype=jnp.float32, backend="jnp"):
    """A cache no real value was written to: NaN for the backends that write then read (they
    mask values too); large finite garbage for the CPU split backends, which rely on the pool
    never holding a non-finite value (write_kv guarantees it) and would otherwise meet 0 * NaN."""
    k, v = init_kv_cache(cfg, num_blocks, BLOCK_SIZE, dtype)
    if not make_attention(backend).writes_kv:
        g = jax.random.uniform(jax.random.key(3), k.shape, jnp.float32, -1e4, 1e4).astype(dtype)
        return g, -g
    return jnp.full_like(k, jnp.nan), jnp.full_like(v, jnp.nan)


# ----------------------------------------------------------------------------------------------
# tiny random HF models

TINY = dict(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
            bos_token_id=1, eos_token_id=2)


def _variant(name):
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen2ForCausalLM
    from transformers import LlamaForCausalLM, MistralForCausalLM

    if name == "llama":  # SmolLM-like: tied head, GQA
        return LlamaForCausalLM, LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=True)
    if name == "llama-untied":
        return LlamaForCausalLM, LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False)
    if name == "llama-untied-bias":  # untied head; Llama's attention_bias (q,k,v,o) and mlp_bias
        return LlamaForCausalLM, LlamaConfig(**TINY, rope_theta=10000.0, tie_word_embeddings=False,
                                             attention_bias=True, mlp_bias=True)
    if name == "llama3-rope":  # small original_max so every band (kept, smoothed, divided) occurs
        return LlamaForCausalLM, LlamaConfig(
            **TINY, tie_word_embeddings=False,
            rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
            rope_theta=500000.0)
    if name == "linear-rope":
        return LlamaForCausalLM, LlamaConfig(**TINY, tie_word_embeddings=True, rope_theta=10000.0,
                                             rope_scaling={"rope_type": "linear", "factor": 4.0})
    if name == "qwen2":  # q/k/v bias, no o bias
        return Qwen2ForCausalLM, Qwen2Config(**TINY, rope_theta=1000000.0, tie_word_embeddings=False)
    if name == "mistral":  # head_dim decoupled from hidden_size / heads
        return MistralForCausalLM, MistralConfig(**TINY, head_dim=32, rope_theta=10000.0,
                                                 tie_word_embeddings=False)
    raise KeyError(name)


def make_hf_model(name: str, seed: int = 0):
    """A random HF model whose every weight (biases and norm weights too) is non-trivial.

    HF initializes biases to 0 and norms to 1, which would let a dropped bias or norm pass; and
    std 0.02 gives nearly flat logits, which makes greedy comparisons fragile.
    """
    cls, config = _variant(name)
    torch.manual_seed(seed)
    model = cls(config).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if "norm" in pname:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.15)
    return model


@pytest.fixture(scope="module", params=["llama", "llama-untied-bias", "llama3-rope", "linear-rope",
                                        "qwen2", "mistral"])
def tiny(request, tmp_path_factory):
    hf = make_hf_model(request.param)
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)  # safetensors
    cfg, params, tokenizer = load_model(path)
    return request.param, hf, cfg, params, path


def hf_logits(hf, ids) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float().numpy()


def assert_close_rel(ours, ref, rel, what=""):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert np.all(np.isfinite(ours)), f"{what}: non-finite values"
    err = np.max(np.abs(ours - ref)) / np.max(np.abs(ref))
    assert err <= rel, f"{what}: max abs error / max |ref| = {err:.2e} > {rel:.0e}"


def test_config_from_hf(tiny):
    name, hf, cfg, params, _ = tiny
    c = hf.config
    assert cfg.num_layers == c.num_hidden_layers and cfg.num_kv_heads == 2 and cfg.num_heads == 4
    assert cfg.head_dim == (32 if name == "mistral" else 16)
    assert cfg.tie_word_embeddings == c.tie_word_embeddings
    assert ("lm_head" in params) == (not c.tie_word_embeddings)
    assert cfg.attention_bias == (name in ("qwen2", "llama-untied-bias"))
    assert cfg.o_proj_bias == (name == "llama-untied-bias")
    assert cfg.rope_theta == c.rope_parameters["rope_theta"]
    assert cfg.eos_token_ids == (2,) and cfg.bos_token_id == 1
    # inv_freq exactly as transformers computes it, rope scaling included
    np.testing.assert_allclose(rope_inv_freq(cfg), hf.model.rotary_emb.inv_freq.numpy(), rtol=1e-6, atol=0)
    if name == "llama3-rope":
        assert cfg.rope_scaling.rope_type == "llama3"
    # every layer's stacked q_proj is HF's weight, transposed
    for i in range(cfg.num_layers):
        np.testing.assert_array_equal(params["layers"]["q_proj"][i],
                                      hf.model.layers[i].self_attn.q_proj.weight.detach().numpy().T)


def in_layout(params, layout: str):
    """The model's params as a step holds them: "" as they are, "unstacked" (one array per weight
    per layer), "panels" (unstacked, projections and head for the native matmul)."""
    if layout == "panels":
        require_native_matmul()
    return to_step_layout(params, unstacked=True, panels=layout == "panels") if layout else params


@pytest.mark.parametrize("backend", ["jnp", "reference", "native", "native, unstacked", "native, panels", "pallas"])
def test_ragged_prefill_and_decode_match_hf(tiny, backend):
    """4 prompts prefilled in one call; then greedy decode with a 5th prompt arriving mid-way,
    prefilled in two chunks alongside the others' decode tokens. Every attention backend: the
    Pallas kernel (interpreted) reads its layer of the stacked pool the loop carries. "unstacked":
    the layers over one array per weight per layer, run one after another (the engine's CPU path);
    "panels": and multiplied by the native matmul (that path on a CPU with AVX-512, or AVX2 and FMA)."""
    backend, _, layout = backend.partition(", ")
    if backend == "native":
        require_native()
    name, hf, cfg, params, _ = tiny
    params = in_layout(params, layout)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (5, 1, 12, 7, 9)]
    T, S, max_blocks, num_blocks = 40, 6, 8, 48
    pager = Pager(num_blocks, rng)
    kv = nan_cache(cfg, num_blocks, backend=backend)

    # one ragged prefill of the first four prompts
    token_ids, positions, attn, _ = pager.step(list(enumerate(prompts[:4])), T, S, max_blocks)
    logits, kv = step_fn(params, cfg, token_ids, positions, kv, attn, backend)
    logits = np.asarray(logits)
    start = 0
    for sid in range(4):
        n = len(prompts[sid])
        assert_close_rel(logits[start:start + n], hf_logits(hf, prompts[sid]), 1e-4, f"{name} prefill seq {sid}")
        start += n
    # padding rows give finite (ignored) values: no NaN escaped from the never-written cache
    assert np.all(np.isfinite(logits[start:]))

    compiled = step_fn._cache_size()
    seqs = [list(p) for p in prompts]
    last = {sid: int(np.argmax(logits[sum(map(len, prompts[:sid + 1])) - 1])) for sid in range(4)}
    for sid in range(4):
        seqs[sid].append(last[sid])
    chunks = [prompts[4][:6], prompts[4][6:]]
    for step in range(6):
        work = [(sid, [seqs[sid][-1]]) for sid in range(4)]
        if step < 2:  # sequence 4 joins: its prefill in two chunks, mixed with the decodes
            work.insert(1, (4, chunks[step]))
        else:
            work.append((4, [seqs[4][-1]]))
        token_ids, positions, attn, rows = pager.step(work, T, S, max_blocks)
        logits, kv = step_fn(params, cfg, token_ids, positions, kv, attn, backend)
        logits = np.asarray(logits)
        for (sid, _), row in zip(work, rows):
            if sid == 4 and step == 0:
                continue  # first chunk: no token sampled yet
            ref = hf_logits(hf, seqs[sid])[-1]
            assert_close_rel(logits[row], ref, 1e-4, f"{name} step {step} seq {sid}")
            # greedy tokens equal HF's; the reference logits decide the token
            assert int(np.argmax(logits[row])) == int(np.argmax(ref)), f"{name} step {step} seq {sid}"
            seqs[sid].append(int(np.argmax(ref)))
    # fixed shapes: the decode steps, with membership changing, reused the prefill's compilation
    assert step_fn._cache_size() == compiled
    # the greedy continuation equals HF generate for one of them
    with torch.no_grad():
        gen = hf.generate(torch.tensor([prompts[0]]), max_new_tokens=7, do_sample=False,
                          eos_token_id=None, pad_token_id=0)[0].tolist()
    assert gen == seqs[0][: len(gen)]


@pytest.mark.parametrize("backend", ["jnp", "reference", "native", "native, unstacked", "native, panels"])
def test_padding_rows_write_nothing(backend):
    """slot -1 rows leave the cache untouched; real rows land exactly at their slots, whether each
    layer writes its K/V in the loop ("jnp"; "native" in its C++ call, in its own page layout,
    read back through native.from_pages) or the model writes them all after it ("reference");
    and a one-token step writes its one token, or nothing when it is padding."""
    from transformers import LlamaConfig

    backend, _, layout = backend.partition(", ")
    if backend == "native":
        require_native()
    cfg = ModelConfig.from_hf(LlamaConfig(**TINY, rope_theta=10000.0, architectures=["LlamaForCausalLM"]))
    params = in_layout(init_random_params(cfg, jax.random.key(0)), layout)
    num_blocks = 6
    kv = init_kv_cache(cfg, num_blocks, BLOCK_SIZE)
    slots = jnp.array([5, -1, 9, -1], jnp.int32)
    # (the native kernel refuses a row with fewer positions than tokens: there it counts all four)
    context = 4 if backend == "native" else 2
    attn = AttentionMetadata(slots, jnp.array([[1, 2, 0]], jnp.int32), jnp.array([context], jnp.int32),
                             jnp.array([0, 4], jnp.int32), jnp.asarray(1, jnp.int32))
    # two real tokens at rows 0 and 2; context_lens counts them but the rows in between are padding,
    # which the model must not write however the attention treats them
    _, (k, v) = forward(params, cfg, jnp.array([3, 4, 5, 6], jnp.int32), jnp.array([0, 0, 1, 0], jnp.int32),
                        kv, attn, make_attention(backend))
    position_major = native.from_pages if backend == "native" else lambda k, v: (k, v)
    k, v = position_major(k, v)
    flat = np.asarray(k).reshape(cfg.num_layers, cfg.num_kv_heads, num_blocks * BLOCK_SIZE, cfg.head_dim)
    written = np.any(flat != 0, axis=(0, 1, 3))
    assert sorted(np.nonzero(written)[0].tolist()) == [5, 9]
    assert np.all(np.asarray(v).reshape(flat.shape)[:, :, [5, 9]] != 0)
    for slot, expect in ((-1, []), (7, [7])):
        one = AttentionMetadata(jnp.array([slot], jnp.int32), jnp.array([[1, 0, 0]], jnp.int32),
                                jnp.array([1], jnp.int32), jnp.array([0, 1], jnp.int32), jnp.asarray(1, jnp.int32))
        _, kv_one = forward(params, cfg, jnp.array([3], jnp.int32), jnp.array([0], jnp.int32),
                            init_kv_cache(cfg, num_blocks, BLOCK_SIZE), one, make_attention(backend))
        k, _ = position_major(*kv_one)
        flat = np.asarray(k).reshape(cfg.num_layers, cfg.num_kv_heads, num_blocks * BLOCK_SIZE, cfg.head_dim)
        assert np.nonzero(np.any(flat != 0, axis=(0, 1, 3)))[0].tolist() == expect


def test_bfloat16_close_to_hf_f32(tmp_path):
    hf = make_hf_model("llama-untied-bias")
    hf.save_pretrained(tmp_path)
    cfg, params, _ = load_model(tmp_path, dtype=jnp.bfloat16)
    assert params["layers"]["q_proj"].dtype == jnp.bfloat16
    rng = np.random.default_rng(2)
    prompts = [rng.integers(3, cfg.vocab_size, n).tolist() for n in (6, 3)]
    pager = Pager(16, rng)
    token_ids, positions, attn, _ = pager.step(list(enumerate(prompts)), 16, 2, 4)
    logits, _ = step_fn(params, cfg, token_ids, positions, nan_cache(cfg, 16, jnp.bfloat16), attn)
    assert logits.dtype == jnp.float32
    ref = np.concatenate([hf_logits(hf, p) for p in prompts])
    assert_close_rel(np.asarray(logits)[: len(ref)], ref, 3e-2, "bf16")


def test_unsupported_architecture_message():
    from transformers import GPT2Config

    with pytest.raises(ValueError, match=r"architectures=\['GPT2LMHeadModel'\].*LlamaForCausalLM"):
        ModelConfig.from_hf(GPT2Config(architectures=["GPT2LMHeadModel"]))


def test_init_random_params_shapes_and_jit_once():
    from transformers import Qwen2Config

    cfg = ModelConfig.from_hf(Qwen2Config(**TINY, architectures=["Qwen2ForCausalLM"]))
    params = init_random_params(cfg, jax.random.key(0), jnp.bfloat16)
    assert params["layers"]["q_bias"].shape == (2, 64) and params["lm_head"].shape == (64, 300)
    assert all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(params))
    f = jax.jit(forward, static_argnames=("cfg", "attention"))
    rng = np.random.default_rng(0)
    pager = Pager(16, rng)
    kv = init_kv_cache(cfg, 16, BLOCK_SIZE, jnp.bfloat16)
    for work in ([(0, [5, 6, 7]), (1, [8])], [(0, [9]), (1, [10]), (2, [11, 12])]):
        token_ids, positions, attn, _ = pager.step(work, 8, 4, 4)
        hidden, kv = f(params, cfg, token_ids, positions, kv, attn, make_attention("jnp"))
        assert hidden.shape == (8, 64) and np.all(np.isfinite(np.asarray(hidden, np.float32)))
    assert f._cache_size() == 1  # new batch membership, same shapes: no retrace


# ----------------------------------------------------------------------------------------------
# the real default model


@pytest.mark.slow
def test_smollm2_gguf_matches_transformers():
    from transformers import AutoModelForCausalLM

    from pagedjax.model.hub import default_model_path

    gguf_path = default_model_path()
    cfg, params, tok = load_model(gguf_path)
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (30, 576, 9, 3, 49152)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0
    prompt = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                     tokenize=False, add_generation_prompt=True)
    ids = tok(prompt)["input_ids"]

    hf = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                              dtype=torch.float32).eval()
    ref = hf_logits(hf, ids)

    T, S, max_blocks, num_blocks = 64, 2, 16, 32
    assert len(ids) < T
    pager = Pager(num_blocks, np.random.default_rng(0))
    kv = nan_cache(cfg, num_blocks)
    token_ids, positions, attn, rows = pager.step([(0, ids)], T, S, max_blocks)
    logits, kv = step_fn(params, cfg, token_ids, positions, kv, attn)
    assert_close_rel(np.asarray(logits)[: len(ids)], ref, 1e-4, "smollm2 prefill")

    out = [int(np.argmax(np.asarray(logits)[rows[0]]))]
    while len(out) < 12 and out[-1] not in cfg.eos_token_ids:
        token_ids, positions, attn, rows = pager.step([(0, [out[-1]])], T, S, max_blocks)
        logits, kv = step_fn(params, cfg, token_ids, positions, kv, attn)
        out.append(int(np.argmax(np.asarray(logits)[rows[0]])))
    text = tok.decode(out, skip_special_tokens=True)
    assert text.startswith("The capital of France is Paris."), text
    with torch.no_grad():
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=len(out), do_sample=False)[0, len(ids):].tolist()
    assert gen == out
