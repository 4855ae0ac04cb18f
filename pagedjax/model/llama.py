"""The Llama family (Llama 2/3, Mistral, Qwen2, SmolLM) as pure functions over a params pytree.

Everything here is jit-friendly: `cfg` is a frozen, hashable dataclass (pass it as a static
argument), params are a dict of arrays, and the per-layer weights are stacked along a leading
`num_layers` axis so `forward` runs one `lax.scan` over the layers and its compile time does not
grow with depth. `unstack_layers` gives the same weights as one dict per layer, projections
transposed to `[out, in]`, which `forward` runs one after another (the engine's native CPU path
does: see there why).

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

KV cache: `(k_cache, v_cache)`, each `[num_layers, num_kv_heads, num_blocks, block_size, head_dim]`
(pagedjax.attention.cache). Attention is not here: `forward` calls a pagedjax.attention backend,
one signature for the Pallas kernel and the CPU paths alike.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.attention import Attention, AttentionMetadata, write_kv

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


# ----------------------------------------------------------------------------------------------
# forward


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


def linear(x: jax.Array, w: jax.Array, lp: Mapping[str, jax.Array], bias: str, *, out_in: bool = False) -> jax.Array:
    """x [T, in] times the weight w: `[in, out]` (the model's layout), `[out, in]` with out_in
    (the unstacked layout, see `unstack_layers`), or an object that multiplies itself, `x @ w` (a
    step's own layout: pagedjax.model.step_weights); plus the layer's bias named `bias`, if any."""
    # NOTE: on GPU, JAX's default f32 matmul precision may use TF32; f32 parity checks there need
    # jax.default_matmul_precision("highest").
    y = jnp.einsum("ti,oi->to", x, w) if out_in and isinstance(w, jax.Array) else x @ w
    return y + lp[bias] if bias in lp else y


def qkv(cfg: ModelConfig, lp: Mapping[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array,
        *, out_in: bool = False, rope: bool = True):
    """A layer's q [T, H, D] and k, v [T, KVH, D] (rotary embeddings applied, unless not `rope`)
    from the residual x. out_in: the layer's weights are `[out, in]` (one layer of `unstack_layers`)."""
    T = x.shape[0]
    h = rms_norm(x, lp["input_layernorm"], cfg.rms_norm_eps)
    q = linear(h, lp["q_proj"], lp, "q_bias", out_in=out_in).reshape(T, cfg.num_heads, cfg.head_dim)
    k = linear(h, lp["k_proj"], lp, "k_bias", out_in=out_in).reshape(T, cfg.num_kv_heads, cfg.head_dim)
    v = linear(h, lp["v_proj"], lp, "v_bias", out_in=out_in).reshape(T, cfg.num_kv_heads, cfg.head_dim)
    return (apply_rope(q, cos, sin), apply_rope(k, cos, sin), v) if rope else (q, k, v)


def attn_out_and_mlp(cfg: ModelConfig, lp: Mapping[str, jax.Array], x: jax.Array, o: jax.Array,
                     *, out_in: bool = False) -> jax.Array:
    """The rest of a layer after attention: output projection, residual, SwiGLU MLP, residual."""
    x = x + linear(o.reshape(x.shape[0], -1), lp["o_proj"], lp, "o_bias", out_in=out_in)
    h = rms_norm(x, lp["post_attention_layernorm"], cfg.rms_norm_eps)
    gate = linear(h, lp["gate_proj"], lp, "gate_bias", out_in=out_in)
    up = linear(h, lp["up_proj"], lp, "up_bias", out_in=out_in)
    return x + linear(jax.nn.silu(gate) * up, lp["down_proj"], lp, "down_bias", out_in=out_in)


def forward(params: Mapping[str, Any], cfg: ModelConfig, token_ids: jax.Array, positions: jax.Array,
            kv_cache: tuple[jax.Array, jax.Array], meta: AttentionMetadata, attention: Attention,
            *, unroll: bool = False) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """One step over a flat, ragged batch of T tokens (prefill chunks and decode tokens mixed).

    token_ids, positions: int32[T]; kv_cache the stacked pool `(k_cache, v_cache)`; meta the
    step's AttentionMetadata; attention a backend of pagedjax.attention (one signature for all).
    Returns the residual stream `[T, hidden_size]` *before* the final RMSNorm (`compute_logits`
    applies it, so only the rows that need logits pay for it) and the updated pool, holding the
    step's K/V. Padding rows (slot -1) produce finite garbage and write nothing.

    The layers run in one lax.scan over the stacked weights, so compile time does not grow with
    depth; with `unstack_layers(params)` they run one after another instead, each reading its own
    weight arrays (faster on a CPU, see there). The pool is threaded from layer to layer (each
    backend hands it back): one that writes the step's K/V itself (`attention.writes_kv`) updates
    its layer in place; for the others the pool is only read by the layers, and every layer's K/V
    are written after them, in one scatter into the donated pool that the threading orders after
    the last read, so XLA need not copy the pool to protect it.
    unroll=True lays the layers out one after another instead of in a loop (pagedjax.aot does,
    to count a compiled step's cost: XLA's cost analysis counts a loop body once).
    """
    dtype = params["embed_tokens"].dtype
    cos, sin = rope_cos_sin(cfg, positions, dtype)
    x = params["embed_tokens"][token_ids]
    # a backend that applies the rotary embedding itself gets it through the plan
    fused_rope = attention.applies_rope(dtype)
    plan = attention.plan(meta, token_ids.shape[0], **({"rope": (cos, sin)} if fused_rope else {}))
    out_in = layers_unstacked(params)

    def layer(x, cache, xs):
        lp, index = xs
        q, k, v = qkv(cfg, lp, x, cos, sin, out_in=out_in, rope=not fused_rope)
        o, cache = attention(q, k, v, cache, index, plan)
        return attn_out_and_mlp(cfg, lp, x, o.astype(dtype), out_in=out_in), cache, (k, v)

    if out_in:
        # one trace of the layer for all of them (its index an argument): the step's program then
        # holds one layer function, called once per layer, which XLA inlines; tracing and lowering
        # every layer's copy was most of what a start with the compilation cache warm still paid
        run_layer = jax.jit(layer)
        kvs = []
        for index, lp in enumerate(params["layers"]):
            x, kv_cache, kv = run_layer(x, kv_cache, (lp, jnp.int32(index)))
            kvs.append(kv)
        new_k, new_v = (jnp.stack(t) for t in zip(*kvs))
    else:
        def body(carry, xs):
            x, cache, kv = layer(*carry, xs)
            return (x, cache), None if attention.writes_kv else kv

        layers = (params["layers"], jnp.arange(cfg.num_layers, dtype=jnp.int32))
        (x, kv_cache), new_kv = jax.lax.scan(body, (x, kv_cache), layers, unroll=unroll)
        if not attention.writes_kv:
            new_k, new_v = new_kv
    if attention.writes_kv:
        return x, kv_cache
    k_cache, v_cache = kv_cache
    return x, (write_kv(k_cache, new_k, meta.slot_mapping), write_kv(v_cache, new_v, meta.slot_mapping))


def layers_unstacked(params: Mapping[str, Any]) -> bool:
    """Whether `params` hold the layers as a sequence of per-layer dicts (`unstack_layers`)."""
    return isinstance(params["layers"], (list, tuple))


def unstack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """The same weights with `layers` as a tuple of num_layers dicts, one array per weight per
    layer, each projection matrix transposed to `[out, in]` (copies). `forward` then runs the
    layers one after another, each matmul reading its weight where it lies; from the stack, XLA on
    a CPU first copies each layer's slice out (a dynamic slice feeding a matmul is materialised),
    so every weight is read twice a step (SmolLM2-135M on a 2-core CPU: decode steps 8-10 % faster
    unstacked). `[out, in]` is the layout XLA's CPU matmuls stream fastest from memory when a few
    rows meet a large weight: that model's layers' matmuls alone, 30 layers at 8-32 tokens, run
    10-20 % faster than over `[in, out]`, and alike at 1 and 64-256 tokens (a 2-core AMD Zen 3).
    The price is compile time, which then grows with depth (that engine's 35 buckets: 66 s instead
    of 46 s, once per machine with the persistent compilation cache)."""
    if layers_unstacked(params):
        return dict(params)
    leaves, treedef = jax.tree.flatten(params["layers"])
    n = leaves[0].shape[0]
    return {**params, "layers": tuple(treedef.unflatten([leaf[i].T if leaf.ndim == 3 else leaf[i] for leaf in leaves])
                                      for i in range(n))}


def stack_layers(params: Mapping[str, Any]) -> dict[str, Any]:
    """The inverse of `unstack_layers`: the model's own layout (a copy when unstacked)."""
    if not layers_unstacked(params):
        return dict(params)

    def stack(*per_layer):
        stacked = jnp.stack(per_layer)
        return jnp.swapaxes(stacked, 1, 2) if stacked.ndim == 3 else stacked

    return {**params, "layers": jax.tree.map(stack, *params["layers"])}


def causal_forward(params: Mapping[str, Any], cfg: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """Whole sequences at once, for training: token_ids int32[B, L], each row from position 0
    (padding after a row's end changes nothing before it). The same layers as `forward` (`qkv`,
    `attn_out_and_mlp`) with dense causal attention in place of the paged pool, so the engine and a
    trainer share one model definition. Returns the residual stream [B, L, hidden_size] before the
    final norm (`compute_logits` applies it); differentiable."""
    B, L = token_ids.shape
    dtype = params["embed_tokens"].dtype
    cos, sin = rope_cos_sin(cfg, jnp.tile(jnp.arange(L, dtype=jnp.int32), B), dtype)
    x = params["embed_tokens"][token_ids.reshape(-1)]
    causal = jnp.tril(jnp.ones((L, L), jnp.bool_))
    group = cfg.num_heads // cfg.num_kv_heads

    def layer(x, lp):
        q, k, v = qkv(cfg, lp, x, cos, sin)
        q = q.reshape(B, L, cfg.num_kv_heads, group, cfg.head_dim).astype(jnp.float32)
        k = k.reshape(B, L, cfg.num_kv_heads, cfg.head_dim).astype(jnp.float32)
        v = v.reshape(B, L, cfg.num_kv_heads, cfg.head_dim).astype(jnp.float32)
        scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k) * cfg.head_dim ** -0.5
        probs = jax.nn.softmax(jnp.where(causal, scores, -jnp.inf), axis=-1)
        o = jnp.einsum("bhgqk,bkhd->bqhgd", probs, v).reshape(B * L, cfg.num_heads, cfg.head_dim)
        return attn_out_and_mlp(cfg, lp, x, o.astype(dtype)), None

    x, _ = jax.lax.scan(layer, x, params["layers"])
    return x.reshape(B, L, -1)


def compute_logits(params: Mapping[str, Any], cfg: ModelConfig, hidden: jax.Array) -> jax.Array:
    """Final RMSNorm and output head: hidden `[S, hidden_size]` (from `forward`) -> float32 `[S, vocab]`."""
    h = rms_norm(hidden, params["norm"], cfg.rms_norm_eps)
    if "head" in params:   # the head as a step holds it (pagedjax.model.step_weights)
        return (h @ params["head"]).astype(jnp.float32)
    if cfg.tie_word_embeddings:
        return jnp.einsum("sh,vh->sv", h, params["embed_tokens"], preferred_element_type=jnp.float32)
    return jnp.einsum("sh,hv->sv", h, params["lm_head"], preferred_element_type=jnp.float32)
