"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) as pure functions over a params pytree.

Everything here is jit-friendly: `cfg` is a frozen, hashable dataclass (pass it as a static
argument), params are a dict of arrays, and the per-layer weights are stacked along a leading
`num_layers` axis so `forward` runs one `lax.scan` over the layers and its compile time does not
grow with depth.

Params (shapes for `cfg`; weights are stored `[in, out]` so a projection is `x @ w`):

    embed_tokens   [vocab, hidden]
    layers/
      input_layernorm           [L, hidden]
      q_proj [L, hidden, H*D]   k_proj, v_proj [L, hidden, KVH*D]   o_proj [L, H*D, hidden]
      q_bias [L, H*D]  k_bias, v_bias [L, KVH*D]     (only if cfg.attention_bias: Qwen2, some Llamas)
      o_bias [L, hidden]                              (only if cfg.o_proj_bias)
      post_attention_layernorm  [L, hidden]
      gate_proj, up_proj [L, hidden, I]   down_proj [L, I, hidden]
      gate_bias, up_bias [L, I]  down_bias [L, hidden]  (only if cfg.mlp_bias)
    norm           [hidden]
    lm_head        [hidden, vocab]                    (absent when cfg.tie_word_embeddings)

KV cache: `(k_cache, v_cache)`, each `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`.
A token's flat slot is `block_id * block_size + offset`; `slot_mapping[t] == -1` marks a padding
row whose K/V is not written.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPE_TO_ARCH = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                       "qwen2": "Qwen2ForCausalLM"}


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """The subset of HF `rope_parameters` that changes `inv_freq` (types: default, linear, llama3)."""

    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    attention_bias: bool = False  # bias on q, k, v (Qwen2; Llama's `attention_bias` also sets o_proj_bias)
    o_proj_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    # Mistral's sliding window. Attention here is always full: exact only while a sequence stays
    # within the window, so the engine must keep max_model_len <= sliding_window.
    sliding_window: int | None = None
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    architecture: str = "LlamaForCausalLM"

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        """From a transformers config (LlamaConfig, MistralConfig, Qwen2Config; SmolLM is Llama)."""
        archs = list(getattr(hf, "architectures", None) or [])
        if not archs and getattr(hf, "model_type", None) in _MODEL_TYPE_TO_ARCH:
            archs = [_MODEL_TYPE_TO_ARCH[hf.model_type]]  # GGUF-derived configs carry only model_type
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported model: architectures={archs or None} (model_type="
                f"{getattr(hf, 'model_type', None)!r}); supported architectures: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        act = getattr(hf, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act={act!r}: only the SwiGLU MLP (silu) is implemented")

        num_heads = hf.num_attention_heads
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // num_heads
        rope_params = dict(getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {})
        # transformers 5 moved rope_theta into rope_parameters; config.rope_theta may be missing or None
        theta = getattr(hf, "rope_theta", None) or rope_params.get("rope_theta") or 10000.0
        rope_scaling = _rope_scaling_from_hf(rope_params, hf.max_position_embeddings)
        if float(rope_params.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
            raise ValueError("partial_rotary_factor != 1 is not supported")

        attn_bias = bool(getattr(hf, "attention_bias", False))
        o_bias = attn_bias
        if arch == "Qwen2ForCausalLM":
            attn_bias, o_bias = True, False  # Qwen2 always has q/k/v bias and never o_proj bias
        sliding_window = None
        if arch == "MistralForCausalLM":
            sliding_window = getattr(hf, "sliding_window", None)
        elif arch == "Qwen2ForCausalLM" and getattr(hf, "use_sliding_window", False):
            if "sliding_attention" in (getattr(hf, "layer_types", None) or []):
                sliding_window = getattr(hf, "sliding_window", None)

        eos = getattr(hf, "eos_token_id", None)
        eos_ids = () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos]))
        return cls(
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_layers=hf.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(hf, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(hf.rms_norm_eps),
            rope_theta=float(theta),
            rope_scaling=rope_scaling,
            attention_bias=attn_bias,
            o_proj_bias=o_bias,
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            max_position_embeddings=int(hf.max_position_embeddings),
            sliding_window=sliding_window,
            bos_token_id=getattr(hf, "bos_token_id", None),
            eos_token_ids=eos_ids,
            architecture=arch,
        )


def _rope_scaling_from_hf(rope_params: Mapping[str, Any], max_position_embeddings: int) -> RopeScaling:
    rope_type = rope_params.get("rope_type", rope_params.get("type", "default")) or "default"
    if rope_type == "default":
        return RopeScaling()
    if rope_type == "linear":
        return RopeScaling("linear", factor=float(rope_params["factor"]))
    if rope_type == "llama3":
        return RopeScaling(
            "llama3", factor=float(rope_params["factor"]),
            low_freq_factor=float(rope_params["low_freq_factor"]),
            high_freq_factor=float(rope_params["high_freq_factor"]),
            original_max_position_embeddings=int(
                rope_params.get("original_max_position_embeddings") or max_position_embeddings))
    raise ValueError(f"unsupported rope_type={rope_type!r}; supported: default, linear, llama3")


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """float32 `[head_dim // 2]`, as transformers' modeling_rope_utils computes it.

    Mirrors its float32 arithmetic step by step (the pow is done in float64 on the same float32
    inputs and rounded, i.e. within an ulp of torch's powf).
    """
    dim = cfg.head_dim
    exponent = np.arange(0, dim, 2, dtype=np.int64).astype(np.float32) / np.float32(dim)
    denom = (np.float64(np.float32(cfg.rope_theta)) ** exponent.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / denom
    rs = cfg.rope_scaling
    if rs.rope_type == "linear":
        inv_freq = inv_freq / np.float32(rs.factor)
    elif rs.rope_type == "llama3":
        low_freq_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_freq_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = np.float32(2 * math.pi) / inv_freq
        scaled = np.where(wavelen > low_freq_wavelen, inv_freq / np.float32(rs.factor), inv_freq)
        smooth = ((np.float32(rs.original_max_position_embeddings) / wavelen - np.float32(rs.low_freq_factor))
                  / np.float32(rs.high_freq_factor - rs.low_freq_factor))
        smoothed = (1 - smooth) * scaled / np.float32(rs.factor) + smooth * scaled
        is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
        inv_freq = np.where(is_medium, smoothed, scaled)
    return inv_freq.astype(np.float32)


# ----------------------------------------------------------------------------------------------
# params


def param_shapes(cfg: ModelConfig) -> dict[str, Any]:
    """The params pytree with shape tuples as leaves (what `init_random_params` and the loaders build)."""
    L, Hd, I = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    layers = {
        "input_layernorm": (L, Hd),
        "q_proj": (L, Hd, q), "k_proj": (L, Hd, kv), "v_proj": (L, Hd, kv), "o_proj": (L, q, Hd),
        "post_attention_layernorm": (L, Hd),
        "gate_proj": (L, Hd, I), "up_proj": (L, Hd, I), "down_proj": (L, I, Hd),
    }
    if cfg.attention_bias:
        layers |= {"q_bias": (L, q), "k_bias": (L, kv), "v_bias": (L, kv)}
    if cfg.o_proj_bias:
        layers["o_bias"] = (L, Hd)
    if cfg.mlp_bias:
        layers |= {"gate_bias": (L, I), "up_bias": (L, I), "down_bias": (L, Hd)}
    shapes = {"embed_tokens": (cfg.vocab_size, Hd), "layers": layers, "norm": (Hd,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head"] = (Hd, cfg.vocab_size)
    return shapes


def init_random_params(cfg: ModelConfig, key: jax.Array, dtype: Any = jnp.float32) -> dict[str, Any]:
    """Random params for tests: N(0, 0.02) matrices and biases, norm weights 1 (as HF initializes)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(param_shapes(cfg), is_leaf=lambda s: isinstance(s, tuple))
    keys = jax.random.split(key, len(leaves))
    out = [jnp.ones(shape, dtype) if "norm" in jax.tree_util.keystr(path)
           else (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(dtype)
           for (path, shape), k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, out)


def init_kv_cache(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any = jnp.float32):
    """Zeroed `(k_cache, v_cache)`, each `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`."""
    shape = (cfg.num_layers, cfg.num_kv_heads, num_blocks, block_size, cfg.head_dim)
    return jnp.zeros(shape, dtype), jnp.zeros(shape, dtype)


# ----------------------------------------------------------------------------------------------
# forward


class AttentionMetadata(NamedTuple):
    """What the paged attention needs for one step; built on the host, fixed shapes per bucket.

    slot_mapping:    int32[T]    flat cache slot of each token (block_id * block_size + offset), -1 = padding
    block_tables:    int32[S, max_blocks_per_seq]  physical blocks of each sequence (unused entries 0)
    context_lens:    int32[S]    tokens of each sequence in the cache *including* this step's tokens
    query_start_loc: int32[S+1]  sequence s owns query rows query_start_loc[s]:query_start_loc[s+1]
    num_seqs:        int32[]     live sequences (rows >= num_seqs are padding)
    """

    slot_mapping: jax.Array
    block_tables: jax.Array
    context_lens: jax.Array
    query_start_loc: jax.Array
    num_seqs: jax.Array


AttentionFn = Callable[[jax.Array, jax.Array, jax.Array, AttentionMetadata], jax.Array]


def reference_attention(q: jax.Array, k_cache: jax.Array, v_cache: jax.Array,
                        attn: AttentionMetadata) -> jax.Array:
    """Default `attention_fn`: the pure-jnp ragged paged attention (scale head_dim ** -0.5).

    q: [T, H, D]; k_cache, v_cache: one layer, [KVH, num_blocks, block_size, D] -> [T, H, D].
    """
    from pagedjax.pallas.reference import ragged_paged_attention_reference

    return ragged_paged_attention_reference(q, k_cache, v_cache, attn.block_tables, attn.context_lens,
                                            attn.query_start_loc, attn.num_seqs)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """HF LlamaRMSNorm: normalize in float32, cast back, then multiply by the weight."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * normed.astype(x.dtype)


def rope_cos_sin(cfg: ModelConfig, positions: jax.Array, dtype: Any) -> tuple[jax.Array, jax.Array]:
    """cos, sin `[T, head_dim]` for integer positions, computed in float32 then cast, as HF does."""
    inv_freq = jnp.asarray(rope_inv_freq(cfg))
    freqs = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x: [T, heads, D]; HF's rotate-half convention (GGUF q/k rows are un-permuted to match at load)."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def write_kv(cache: jax.Array, new: jax.Array, slot_mapping: jax.Array) -> jax.Array:
    """Scatter new K or V into the paged cache at flat slots; slot -1 rows are dropped.

    cache: [..., KVH, num_blocks, block_size, D]; new: [..., T, KVH, D] with the same leading dims.
    """
    *lead, kvh, nb, bs, d = cache.shape
    flat = cache.reshape(*lead, kvh, nb * bs, d)
    # -1 would wrap around to the last slot under numpy indexing rules: send it out of range instead,
    # where mode="drop" discards it.
    slots = jnp.where(slot_mapping < 0, nb * bs, slot_mapping)
    # The pool never holds a non-finite value: a request whose activations overflow ends with an
    # error, and its blocks are reused by others whose attention must not meet 0 * NaN.
    new = jnp.where(jnp.isfinite(new), new, 0).astype(cache.dtype)
    flat = flat.at[..., slots, :].set(jnp.swapaxes(new, -3, -2), mode="drop")
    return flat.reshape(cache.shape)


def _linear(x: jax.Array, w: jax.Array, lp: Mapping[str, jax.Array], bias: str) -> jax.Array:
    # NOTE: on GPU, JAX's default f32 matmul precision may use TF32; f32 parity checks there need
    # jax.default_matmul_precision("highest").
    y = x @ w
    return y + lp[bias] if bias in lp else y


def _step_inputs(params, cfg: ModelConfig, token_ids, positions, attn):
    """What both forward paths start from: the metadata as a tuple, the compute dtype, the
    embedded tokens and the rotary cos/sin of their positions."""
    if isinstance(attn, Mapping):
        attn = AttentionMetadata(**attn)
    dtype = params["embed_tokens"].dtype
    cos, sin = rope_cos_sin(cfg, positions, dtype)
    return attn, dtype, params["embed_tokens"][token_ids], cos, sin


def forward(params: Mapping[str, Any], cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
            kv_cache: tuple[jax.Array, jax.Array], attn: AttentionMetadata | Mapping[str, jax.Array],
            *, attention_fn: AttentionFn = reference_attention,
            ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One step over a flat, ragged batch of T tokens (prefill chunks and decode tokens mixed).

    token_ids, positions: int32[T]. Returns the residual stream `[T, hidden_size]` *before* the final
    RMSNorm (`compute_logits` applies it, so only the rows that need logits pay for it) and the
    updated `(k_cache, v_cache)`. Padding rows (slot -1) produce finite garbage and write nothing.
    """
    attn, dtype, x, cos, sin = _step_inputs(params, cfg, token_ids, positions, attn)
    T = token_ids.shape[0]
    k_cache, v_cache = kv_cache

    def layer(x, xs):
        lp, kc, vc = xs
        q, k, v = _qkv(cfg, lp, x, cos, sin)
        # The attention must see this step's own K/V, so write them into this layer's pages first.
        kc, vc = write_kv(kc, k, attn.slot_mapping), write_kv(vc, v, attn.slot_mapping)
        o = attention_fn(q, kc, vc, attn).astype(dtype)
        return _attn_out_and_mlp(cfg, lp, x, o), (k.astype(kc.dtype), v.astype(vc.dtype))

    # PERF (see shared/PLATFORM.md): a cache fed to lax.scan as xs is sliced (copied) layer by layer,
    # ~150 ms per step at batch 32 / context 512 on the 2-core CPU. Here the layer slices are only
    # read (plus the step's few rows written into the local copy); the full cache is written once,
    # after the loop, with one scatter that can update a donated buffer in place. Per-layer buffers
    # or a kernel that reads pages straight from the stacked cache would remove the slice copies.
    x, (new_k, new_v) = jax.lax.scan(layer, x, (params["layers"], k_cache, v_cache))
    k_cache = write_kv(k_cache, new_k, attn.slot_mapping)
    v_cache = write_kv(v_cache, new_v, attn.slot_mapping)
    return x, (k_cache, v_cache)


def _qkv(cfg: ModelConfig, lp: Mapping[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array):
    """A layer's q [T, H, D] and k, v [T, KVH, D] (rotary embeddings applied) from the residual x."""
    T = x.shape[0]
    h = rms_norm(x, lp["input_layernorm"], cfg.rms_norm_eps)
    q = _linear(h, lp["q_proj"], lp, "q_bias").reshape(T, cfg.num_heads, cfg.head_dim)
    k = _linear(h, lp["k_proj"], lp, "k_bias").reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = _linear(h, lp["v_proj"], lp, "v_bias").reshape(T, cfg.num_kv_heads, cfg.head_dim)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


def _attn_out_and_mlp(cfg: ModelConfig, lp: Mapping[str, jax.Array], x: jax.Array, o: jax.Array) -> jax.Array:
    """The rest of a layer after attention: output projection, residual, SwiGLU MLP, residual."""
    x = x + _linear(o.reshape(x.shape[0], -1), lp["o_proj"], lp, "o_bias")
    h = rms_norm(x, lp["post_attention_layernorm"], cfg.rms_norm_eps)
    gate = _linear(h, lp["gate_proj"], lp, "gate_bias")
    up = _linear(h, lp["up_proj"], lp, "up_bias")
    return x + _linear(jax.nn.silu(gate) * up, lp["down_proj"], lp, "down_bias")


class TokenLayout(NamedTuple):
    """Per token of a step: its row (sequence), its position, where its row's new tokens start
    (= the row's cached positions), and whether it is a real token."""

    seq: jax.Array
    pos: jax.Array
    start: jax.Array
    valid: jax.Array


def token_layout(attn: AttentionMetadata, T: int) -> TokenLayout:
    """The `TokenLayout` of a step of T tokens. Rows >= num_seqs are padding."""
    qsl = attn.query_start_loc
    S = attn.block_tables.shape[0]
    t = jnp.arange(T, dtype=jnp.int32)
    live = jnp.arange(S) < attn.num_seqs
    seq = jnp.sum(live[None, :] & (qsl[1:][None, :] <= t[:, None]), axis=1)
    seq = jnp.minimum(seq, S - 1)
    valid = (t >= qsl[0]) & (t < qsl[jnp.clip(attn.num_seqs, 0, S)])
    q_len = qsl[seq + 1] - qsl[seq]
    start = attn.context_lens[seq] - q_len          # first position written this step
    pos = start + (t - qsl[seq])
    return TokenLayout(seq, pos, start, valid)


# Work sizes of `context_attention`: a tile of query tokens reads its rows' pages a chunk at a
# time. On the 2-core CPU (scripts/bench_step.py, SmolLM2, 30 layers, block size 16) tiles of 16
# tokens reading 32 context positions (2 pages) per iteration were the fastest of 8-32 tokens x
# 16-128 positions: one chunk's gathered K (16 x 2 pages x 12 KiB) stays in L2. A tile that is one
# row (a prefill chunk after cached context) reads 128 positions per iteration. Chunks are whole
# pages, at least one, so tiny blocks do not mean tiny loop iterations.
CTX_TILE_TOKENS = 16
CTX_CHUNK_TOKENS = 32
CTX_ROW_CHUNK_TOKENS = 128


def context_attention(q, k_cache, v_cache, layer, tables, seq, start, *, tile: int = CTX_TILE_TOKENS,
                      chunk_tokens: int = CTX_CHUNK_TOKENS, row_chunk_tokens: int = CTX_ROW_CHUNK_TOKENS):
    """Each token's attention over its row's *cached* context (positions < start), read from the
    pool page chunk by page chunk, returned as an online-softmax state to merge with the step's
    own K/V.

    The work follows the live tokens, not the bucket: tokens are sorted by how much context they
    have, tiles of `tile` tokens run only while some token still has context (tokens of a fresh
    prompt, start 0, cost nothing), and each tile loops only over the pages its longest row has.
    A tile whose tokens all belong to one row (a prefill chunk after cached context) reads that
    row's pages once and attends with a matmul; a mixed tile reads each token's pages.

    q [T, KVH, G, D] float32, already scaled; k_cache, v_cache the stacked pool
    [L, KVH, NB, BS, D]; layer an int32 scalar; tables [T, P] each token's row's block table;
    seq [T] each token's row (-1 for padding); start [T] cached positions before the token's
    row's new tokens (0 for padding). Returns (m [T, KVH, G], denom [T, KVH, G], o [T, KVH, G, D]),
    o not yet divided by denom; m is -inf where a token has no context.
    """
    T, KVH, G, D = q.shape
    bs = k_cache.shape[3]
    tile = min(tile, T)
    c = max(1, chunk_tokens // bs)          # pages per iteration
    chunk = c * bs
    rc = max(1, row_chunk_tokens // bs)
    order = jnp.argsort(-start, stable=True)        # most context first; a row's tokens stay together
    Tp = -(-T // tile) * tile
    pad_t = Tp - T
    st = jnp.pad(start[order], (0, pad_t))
    sq = jnp.pad(seq[order], (0, pad_t), constant_values=-1)
    tab = jnp.pad(tables[order], ((0, pad_t), (0, (-tables.shape[1]) % (c * rc))))
    qs = jnp.pad(q[order], ((0, pad_t), (0, 0), (0, 0), (0, 0)))
    n_tiles = (jnp.sum(st > 0) + tile - 1) // tile
    cdims = (tile, KVH, G)

    def read_pages(cache, pages):
        # a page of one kv head is one contiguous row of bs * D values: gathering rows is ~15 %
        # faster on the CPU than gathering [bs, D] slices
        L_, _, NB, _, _ = cache.shape
        rows = cache.reshape(L_, KVH, NB, bs * D)[layer, :, pages]
        return rows.reshape(*pages.shape, KVH, bs, D)

    def run_tile(i, out):
        t0 = i * tile
        qt, stt, tabt, sqt = (jax.lax.dynamic_slice_in_dim(x, t0, tile) for x in (qs, st, tab, sq))
        empty = (jnp.full(cdims, -jnp.inf, jnp.float32), jnp.zeros(cdims, jnp.float32),
                 jnp.zeros((*cdims, D), jnp.float32))

        def one_row():
            # every token of the tile belongs to one row: read its pages once, rc pages at a
            # time, as [tile * G, D] x [D, rc * bs] products, with an online softmax
            def body(j, carry):
                m, den, o = carry
                pages = jax.lax.dynamic_slice_in_dim(tabt[0], j * rc, rc)                 # [rc]
                k, v = read_pages(k_cache, pages), read_pages(v_cache, pages)            # [rc, KVH, bs, D]
                s = jnp.einsum("tkgd,ckjd->tkgcj", qt, k.astype(jnp.float32)).reshape(*cdims, rc * bs)
                pos = j * rc * bs + jnp.arange(rc * bs)
                s = jnp.where(pos[None, None, None, :] < stt[:, None, None, None], s, -jnp.inf)
                m_new = jnp.maximum(m, jnp.max(s, axis=-1))
                m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - m_safe[..., None])
                alpha = jnp.exp(m - m_safe)
                pv = jnp.einsum("tkgcj,ckjd->tkgd", p.reshape(*cdims, rc, bs), v.astype(jnp.float32))
                return m_new, den * alpha + jnp.sum(p, axis=-1), o * alpha[..., None] + pv

            return jax.lax.fori_loop(0, -(-stt[0] // (rc * bs)), body, empty)   # longest context first

        def per_token():
            # tokens of several rows: each reads its own row's pages, c at a time. Scores of every
            # chunk first, one softmax, then the values: fewer small ops per loop iteration than
            # an online softmax, which matters for 16-token tiles on a CPU
            n = -(-stt[0] // chunk)
            width = tab.shape[1] * bs

            def scores(j, s_all):
                pages = jax.lax.dynamic_slice_in_dim(tabt, j * c, c, axis=1)             # [tile, c]
                s = jnp.einsum("tkgd,tckjd->tkgcj", qt, read_pages(k_cache, pages).astype(jnp.float32))
                return jax.lax.dynamic_update_slice_in_dim(s_all, s.reshape(*cdims, chunk), j * chunk, 3)

            s_all = jax.lax.fori_loop(0, n, scores, jnp.full((*cdims, width), -jnp.inf, jnp.float32))
            s_all = jnp.where(jnp.arange(width)[None, None, None, :] < stt[:, None, None, None], s_all, -jnp.inf)
            m = jnp.max(s_all, axis=-1)
            p = jnp.exp(s_all - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])

            def values(j, o):
                pages = jax.lax.dynamic_slice_in_dim(tabt, j * c, c, axis=1)
                pj = jax.lax.dynamic_slice_in_dim(p, j * chunk, chunk, 3).reshape(*cdims, c, bs)
                return o + jnp.einsum("tkgcj,tckjd->tkgd", pj, read_pages(v_cache, pages).astype(jnp.float32))

            return m, jnp.sum(p, axis=-1), jax.lax.fori_loop(0, n, values, empty[2])

        state = jax.lax.cond((sqt[0] == sqt[-1]) & (sqt[0] >= 0), one_row, per_token)
        return tuple(jax.lax.dynamic_update_slice_in_dim(acc, x, t0, 0) for acc, x in zip(out, state))

    out = (jnp.full((Tp, KVH, G), -jnp.inf, jnp.float32), jnp.zeros((Tp, KVH, G), jnp.float32),
           jnp.zeros((Tp, KVH, G, D), jnp.float32))
    m, den, o = jax.lax.fori_loop(0, n_tiles, run_tile, out)
    inv = jnp.argsort(order)
    return m[inv], den[inv], o[inv]


def split_attention(qg, k_new, v_new, ctx, seq, pos, valid):
    """One softmax over two parts: a token's cached context (the state `context_attention`
    returns) and this step's own K/V (same row, causal).

    qg [T, KVH, G, D] float32, scaled; k_new, v_new [T, KVH, D]; ctx = (m, denom, o) per token
    and query head; seq, pos, valid from `token_layout`. Returns f32 [T, KVH * G, D]."""
    T, KVH, G, D = qg.shape
    m_ctx, den_ctx, o_ctx = ctx
    s_new = jnp.einsum("tkgd,ukd->tkgu", qg, k_new.astype(jnp.float32))
    m_new = (seq[None, :] == seq[:, None]) & (pos[None, :] <= pos[:, None]) & valid[None, :] & valid[:, None]
    s_new = jnp.where(m_new[:, None, None, :], s_new, -jnp.inf)
    m = jnp.maximum(m_ctx, jnp.max(s_new, axis=-1))
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p_new = jnp.exp(s_new - m[..., None])
    alpha = jnp.exp(m_ctx - m)
    denom = den_ctx * alpha + jnp.sum(p_new, axis=-1)
    o = o_ctx * alpha[..., None] + jnp.einsum("tkgu,ukd->tkgd", p_new, v_new.astype(jnp.float32))
    o = o / jnp.where(denom > 0, denom, 1.0)[..., None]
    return o.reshape(T, KVH * G, D)


def xla_attention(qg, k_new, v_new, k_cache, v_cache, layer, tables, layout: TokenLayout):
    """A layer's attention on the CPU path in XLA ops: `context_attention` over each token's
    cached context, merged by `split_attention` with the step's own K/V.

    qg [T, KVH, G, D] float32, scaled; k_new, v_new [T, KVH, D]; the stacked pool
    [L, KVH, NB, BS, D]; layer an int32 scalar; tables [T, P] each token's row's block table.
    Returns f32 [T, KVH * G, D]. `pagedjax.native.attention` is the same in one C++ call."""
    seq, pos, start, valid = layout
    ctx = context_attention(qg, k_cache, v_cache, layer, tables, jnp.where(valid, seq, -1),
                            jnp.where(valid, start, 0))
    return split_attention(qg, k_new, v_new, ctx, seq, pos, valid)


def forward_split(params: Mapping[str, Any], cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
                  kv_cache: tuple[jax.Array, jax.Array], attn: AttentionMetadata | Mapping[str, jax.Array],
                  *, attention_fn: Callable = xla_attention) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """`forward` for the CPU: the same math, but the pool is only *read* inside the layer loop
    and the step's K/V are written once after it.

    Why (shared/PLATFORM.md): a cache fed to lax.scan as xs is copied layer slice by layer
    slice, and a cache carried and scattered into costs more still. Here each layer reads only
    the pages its tokens need, straight from the whole stacked cache, and attends over those
    (positions before the row's new tokens) plus the step's own K/V. So a request must never
    read, in the same step, a block another request is filling: the KV cache manager keeps such
    blocks pending until the step has run.

    `attention_fn(qg, k_new, v_new, k_cache, v_cache, layer, tables, layout)` is a layer's
    attention: `xla_attention` (the "reference" backend) or `pagedjax.native.attention`.
    """
    attn, dtype, x, cos, sin = _step_inputs(params, cfg, token_ids, positions, attn)
    T = token_ids.shape[0]
    k_cache, v_cache = kv_cache
    layout = token_layout(attn, T)
    tables = attn.block_tables[layout.seq]              # [T, P]
    G = cfg.num_heads // cfg.num_kv_heads
    scale = cfg.head_dim ** -0.5

    def layer(x, xs):
        lp, l = xs
        q, k, v = _qkv(cfg, lp, x, cos, sin)
        qg = q.astype(jnp.float32).reshape(T, cfg.num_kv_heads, G, cfg.head_dim) * scale
        o = attention_fn(qg, k, v, k_cache, v_cache, l, tables, layout).astype(dtype)
        return _attn_out_and_mlp(cfg, lp, x, o), (k.astype(k_cache.dtype), v.astype(v_cache.dtype))

    layer_ids = jnp.arange(cfg.num_layers, dtype=jnp.int32)
    x, (new_k, new_v) = jax.lax.scan(layer, x, (params["layers"], layer_ids))
    k_cache = write_kv(k_cache, new_k, attn.slot_mapping)
    v_cache = write_kv(v_cache, new_v, attn.slot_mapping)
    return x, (k_cache, v_cache)


def compute_logits(params: Mapping[str, Any], cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final RMSNorm and output head: hidden `[S, hidden_size]` (from `forward`) -> float32 `[S, vocab]`."""
    h = rms_norm(hidden, params["norm"], cfg.rms_norm_eps)
    if cfg.tie_word_embeddings:
        return jnp.einsum("sh,vh->sv", h, params["embed_tokens"], preferred_element_type=jnp.float32)
    return jnp.einsum("sh,hv->sv", h, params["lm_head"], preferred_element_type=jnp.float32)
