"""Checkpoints -> (ModelConfig, params, tokenizer).

Two sources:
- a Hugging Face directory: config.json, one or more *.safetensors (with or without
  model.safetensors.index.json), tokenizer files read by transformers.AutoTokenizer;
- a .gguf file: tensors dequantized with `gguf` to float32, config and tokenizer (with its chat
  template) through transformers' GGUF support (converted once, then read from the cache).

Both are mapped onto HF tensor names first, so shape checks and error messages speak one language.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pagedjax.model.llama import ModelConfig, param_shapes

logger = logging.getLogger(__name__)

# our layer key -> (HF name inside model.layers.{i}., transpose to [in, out])
_LAYER_TENSORS = {
    "input_layernorm": ("input_layernorm.weight", False),
    "q_proj": ("self_attn.q_proj.weight", True),
    "k_proj": ("self_attn.k_proj.weight", True),
    "v_proj": ("self_attn.v_proj.weight", True),
    "o_proj": ("self_attn.o_proj.weight", True),
    "q_bias": ("self_attn.q_proj.bias", False),
    "k_bias": ("self_attn.k_proj.bias", False),
    "v_bias": ("self_attn.v_proj.bias", False),
    "o_bias": ("self_attn.o_proj.bias", False),
    "post_attention_layernorm": ("post_attention_layernorm.weight", False),
    "gate_proj": ("mlp.gate_proj.weight", True),
    "up_proj": ("mlp.up_proj.weight", True),
    "down_proj": ("mlp.down_proj.weight", True),
    "gate_bias": ("mlp.gate_proj.bias", False),
    "up_bias": ("mlp.up_proj.bias", False),
    "down_bias": ("mlp.down_proj.bias", False),
}
_TOP_TENSORS = {
    "embed_tokens": ("model.embed_tokens.weight", False),
    "norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}

# GGUF (llama.cpp) names -> HF names
_GGUF_TOP = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
_GGUF_LAYER = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias", "attn_output.bias": "self_attn.o_proj.bias",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

# A getter returns (array, name in the source file) or None when the tensor is absent.
Getter = Callable[[str], "tuple[Any, str] | None"]


def load_model(path: str | Path, dtype: Any = jnp.float32) -> tuple[ModelConfig, dict[str, Any], Any]:
    """Load a HF directory or a .gguf file. Returns `(cfg, params, tokenizer)`.

    `tokenizer` is a transformers tokenizer, or None for a HF directory without tokenizer files
    (e.g. a random test model). Raises FileNotFoundError for a missing path and ValueError for an
    unsupported architecture or a missing / wrongly shaped tensor.
    """
    path = Path(path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model path does not exist: {path}")
    dtype = jnp.dtype(dtype)
    if path.is_file() and path.suffix == ".gguf":
        return _load_gguf(path, dtype)
    if path.is_file():
        raise ValueError(f"model path {path} is a file but not a .gguf; expected a .gguf file or a HF "
                         "directory with config.json and *.safetensors")
    return _load_hf_dir(path, dtype)


# ----------------------------------------------------------------------------------------------


def _load_hf_dir(path: Path, dtype: jnp.dtype):
    from safetensors import safe_open
    from transformers import AutoConfig

    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in model directory {path}")
    hf_cfg = AutoConfig.from_pretrained(path)
    cfg = ModelConfig.from_hf(hf_cfg)

    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({path / f for f in weight_map.values()})
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in model directory {path}")
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"safetensors shard listed in {index.name} is missing: {f}")
            # "flax" returns jax arrays: numpy has no bfloat16, which most checkpoints use
            handle = stack.enter_context(safe_open(str(f), framework="flax"))
            for name in handle.keys():
                where[name] = (handle, f.name)

        def get(name: str):
            if name not in where:
                return None
            handle, fname = where[name]
            return handle.get_tensor(name), f"{name} ({fname})"

        params = _assemble(cfg, get, dtype)
    tokenizer = None
    if any((path / f).is_file() for f in _TOKENIZER_FILES):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(path)
    else:
        logger.warning("no tokenizer files in %s; returning tokenizer=None", path)
    return cfg, params, tokenizer


def gguf_config_and_tokenizer(path: Path):
    """transformers' config and tokenizer of a .gguf file. Converting them parses the file's
    metadata twice (~7 s for SmolLM2-135M's 49,152-token vocabulary and merges), so the result is
    saved once per file (keyed by its path, size and modification time and the transformers
    version) under the cache directory, in transformers' own format, and read from there (~0.1 s).
    Saving one removes the saved conversions of files that no longer exist."""
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    from pagedjax.model.hub import cache_dir

    st = path.stat()
    key = hashlib.sha256(f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{transformers.__version__}".encode())
    saved = cache_dir() / "gguf" / f"{path.stem}-{key.hexdigest()[:16]}"
    if (saved / "config.json").is_file():
        try:
            return AutoConfig.from_pretrained(saved), AutoTokenizer.from_pretrained(saved)
        except (OSError, ValueError) as e:   # damaged: convert again
            logger.warning("reconverting %s: the saved config and tokenizer in %s did not load (%s)", path, saved, e)
    hf_cfg = AutoConfig.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    try:
        saved.parent.mkdir(parents=True, exist_ok=True)
        for old in saved.parent.iterdir():   # conversions of files that are gone (or changed)
            source = old / "source.txt"
            if source.is_file() and not Path(source.read_text()).is_file():
                shutil.rmtree(old, ignore_errors=True)
        with tempfile.TemporaryDirectory(dir=saved.parent) as tmp:
            hf_cfg.save_pretrained(Path(tmp) / "d")
            tokenizer.save_pretrained(Path(tmp) / "d")
            (Path(tmp) / "d" / "source.txt").write_text(str(path.resolve()))
            shutil.rmtree(saved, ignore_errors=True)
            os.replace(Path(tmp) / "d", saved)   # atomic: a reader sees all of it or none
    except OSError as e:   # a read-only or full cache: convert again next time
        logger.warning("could not save the config and tokenizer of %s under %s: %s", path, saved, e)
    return hf_cfg, tokenizer


def _load_gguf(path: Path, dtype: jnp.dtype):
    import gguf

    reader = gguf.GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    gguf_arch = arch_field.contents() if arch_field is not None else None
    try:
        hf_cfg, tokenizer = gguf_config_and_tokenizer(path)
    except ValueError as e:  # transformers refuses architectures it has no GGUF mapping for
        raise ValueError(f"unsupported GGUF model {path} (general.architecture={gguf_arch!r}): {e}") from e
    cfg = ModelConfig.from_hf(hf_cfg)

    tensors = {t.name: t for t in reader.tensors}
    # llama.cpp's converter permutes q/k rows of Llama-style models (Mistral included) for its
    # interleaved RoPE; Qwen2 uses the rotate-half (NEOX) layout and is stored as is.
    unpermute = gguf_arch == "llama"
    hf_to_gguf = {hf: g for g, hf in _GGUF_TOP.items()}
    for i in range(cfg.num_layers):
        for g, hf in _GGUF_LAYER.items():
            hf_to_gguf[f"model.layers.{i}.{hf}"] = f"blk.{i}.{g}"

    def get(name: str):
        gname = hf_to_gguf.get(name)
        if gname is None or gname not in tensors:
            return None
        t = tensors[gname]
        return np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32), gname

    def unpermute_qk(hf_name: str, w):
        if unpermute and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = cfg.num_heads if hf_name.endswith("q_proj.weight") else cfg.num_kv_heads
            w = w.reshape(n_head, w.shape[0] // n_head // 2, 2, w.shape[1]).swapaxes(1, 2).reshape(w.shape)
        return w

    params = _assemble(cfg, get, dtype, unpermute_qk)
    return cfg, params, tokenizer


def _assemble(cfg: ModelConfig, get: Getter, dtype: jnp.dtype,
              postprocess: Callable[[str, Any], Any] | None = None) -> dict[str, Any]:
    """Fetch every tensor `param_shapes(cfg)` asks for, check its shape, `postprocess` it (after the
    check, so a bad shape gets our message rather than a reshape error), transpose, stack layers."""
    shapes = param_shapes(cfg)

    def fetch(hf_name: str, ours_shape: tuple[int, ...], transpose: bool):
        got = get(hf_name)
        if got is None:
            raise ValueError(f"checkpoint is missing tensor {hf_name} (expected shape {_hf_shape(ours_shape, transpose)} "
                             f"for {cfg.architecture})")
        w, source = got
        expected = _hf_shape(ours_shape, transpose)
        if tuple(w.shape) != expected:
            raise ValueError(f"tensor {source}: expected shape {expected} from the config, got {tuple(w.shape)}")
        if postprocess is not None:
            w = postprocess(hf_name, w)
        w = jnp.asarray(w).astype(dtype)
        return w.T if transpose else w

    params: dict[str, Any] = {}
    for key, (hf_name, transpose) in _TOP_TENSORS.items():
        if key in shapes:
            params[key] = fetch(hf_name, shapes[key], transpose)
    params["layers"] = {}
    for key, layer_shape in shapes["layers"].items():
        hf_name, transpose = _LAYER_TENSORS[key]
        params["layers"][key] = jnp.stack(
            [fetch(f"model.layers.{i}.{hf_name}", layer_shape[1:], transpose) for i in range(cfg.num_layers)])
    return params


def _hf_shape(ours: tuple[int, ...], transpose: bool) -> tuple[int, ...]:
    return tuple(reversed(ours)) if transpose else tuple(ours)


def write_random_llama(path: str | Path, config: dict, *, seed: int = 0, matrix_std: float = 0.02,
                       norm_std: float = 0.0) -> None:
    """Write a Hugging Face directory (config.json + model.safetensors, no tokenizer) of a random
    Llama with an untied head: matrices N(0, matrix_std), norm weights 1 + N(0, norm_std).

    `config` holds the sizes (vocab_size, hidden_size, intermediate_size, num_hidden_layers,
    num_attention_heads, num_key_value_heads, head_dim, max_position_embeddings). For tests and
    benchmarks that need a checkpoint on disk without a model hub."""
    from safetensors.numpy import save_file

    path = Path(path)
    (path / "config.json").write_text(json.dumps(dict(
        config, architectures=["LlamaForCausalLM"], model_type="llama", rms_norm_eps=1e-5, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, tie_word_embeddings=False, hidden_act="silu")))
    c = config
    hd, q, kv, i, v = (c["hidden_size"], c["num_attention_heads"] * c["head_dim"],
                       c["num_key_value_heads"] * c["head_dim"], c["intermediate_size"], c["vocab_size"])
    shapes = {"model.embed_tokens.weight": (v, hd), "model.norm.weight": (hd,), "lm_head.weight": (v, hd)}
    for layer in range(c["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        shapes |= {p + "input_layernorm.weight": (hd,), p + "post_attention_layernorm.weight": (hd,),
                   p + "self_attn.q_proj.weight": (q, hd), p + "self_attn.k_proj.weight": (kv, hd),
                   p + "self_attn.v_proj.weight": (kv, hd), p + "self_attn.o_proj.weight": (hd, q),
                   p + "mlp.gate_proj.weight": (i, hd), p + "mlp.up_proj.weight": (i, hd),
                   p + "mlp.down_proj.weight": (hd, i)}
    rng = np.random.default_rng(seed)
    tensors = {k: (1 + norm_std * rng.standard_normal(s) if "norm" in k else matrix_std * rng.standard_normal(s))
               .astype(np.float32) for k, s in shapes.items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})


def check_params_like(params: Any, spec: Any) -> None:
    """Refuse `params` unless it has the tree structure, shapes and dtypes (and, for jax arrays,
    shardings) of `spec` (arrays or jax.ShapeDtypeStructs, e.g. the loaded weights): ValueError
    naming the first leaf that differs."""
    old_leaves, old_def = jax.tree_util.tree_flatten_with_path(spec)
    new_leaves, new_def = jax.tree_util.tree_flatten_with_path(params)
    if old_def != new_def:
        old_paths = [jax.tree_util.keystr(p) for p, _ in old_leaves]
        new_paths = [jax.tree_util.keystr(p) for p, _ in new_leaves]
        first = next((f"{a} vs {b}" for a, b in zip(old_paths, new_paths) if a != b),
                     f"{len(new_paths)} leaves vs the model's {len(old_paths)}")
        raise ValueError(f"params: the tree differs from the loaded model's (first difference: params{first})")
    for (path, old), (_, new) in zip(old_leaves, new_leaves):
        name = "params" + jax.tree_util.keystr(path)
        if tuple(new.shape) != tuple(old.shape):
            raise ValueError(f"{name}: shape {tuple(new.shape)} is not the loaded model's {tuple(old.shape)}")
        if jnp.dtype(new.dtype) != old.dtype:
            raise ValueError(f"{name}: dtype {jnp.dtype(new.dtype).name} is not the loaded model's {old.dtype.name}")
        if isinstance(new, jax.Array) and not new.sharding.is_equivalent_to(old.sharding, old.ndim):
            raise ValueError(f"{name}: sharding {new.sharding} is not the loaded model's {old.sharding}; place it "
                             "with jax.device_put(leaf, <the model's leaf>.sharding)")
