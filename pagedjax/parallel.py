"""Tensor parallelism on a JAX mesh: one host scheduler, a sharded device step.

    mesh = make_mesh(tensor_parallel_size)          # axes ("dp", "tp"), shape (1, N)
    params = shard_params(params, mesh)             # heads and MLP columns split, see param_spec
    kv_cache = init_sharded_kv_cache(cfg, mesh, num_blocks, block_size, dtype)   # split on kv heads
    attention = make_attention("pallas", mesh=mesh)        # the kernel per shard, in shard_map

What is split (Megatron-style, as vLLM does it):
  q_proj, k_proj, v_proj, gate_proj, up_proj  [L, in, out]  column-split: P(None, None, "tp"), so
      device i holds query heads i*H/N.., kv heads i*KVH/N.. and MLP columns i*I/N..; their biases
      P(None, "tp"). Query head h reads kv head h // (H/KVH), and with N | KVH the group of each of
      a device's query heads is among its own kv heads: attention needs no communication.
  o_proj, down_proj  [L, in, hidden]  row-split: P(None, "tp", None). Each device's product is a
      partial sum; GSPMD adds the all-reduce that makes the residual stream whole again.
  embed_tokens, lm_head, norms, o_bias, down_bias: replicated. Why not vocab-split: sampling needs
      whole rows of logits (argmax, the top-k/top-p sort), so a split head would be all-gathered
      right after it; the tied embedding (SmolLM2) would need a masked lookup plus an all-reduce;
      and an unsplit head computes every logit with the same reduction as one device, so logits
      stay within float rounding of N = 1. The cost is memory: the full table on every device
      (SmolLM2 f32: 113 MB). A vocab split is the next step for large-vocabulary models.
  KV pool (k, v)  [num_layers, num_kv_heads, num_blocks, block_size, head_dim]: P(None, "tp") on the
      kv heads, so each device holds 1/N of the pool (`kv_bytes_per_device`) and the same per-device
      budget holds N times the tokens. Block ids are shared: one block table serves every shard, and
      the scheduler, block tables and numpy packing do not know N.
  Step inputs (token ids, block tables, ...) and logits: replicated.

The matmuls are partitioned by GSPMD from these annotations (mesh axes are Auto). The Pallas kernel
is a custom call GSPMD cannot partition, so `shard_attention` runs it under `jax.shard_map`: each
device calls it on its own heads and its own slice of the pool (check_vma=False: jax 0.10.2 cannot
infer how a pallas_call varies over the mesh).

The "dp" axis has size 1 for now; a later data-parallel axis (replicas with their own pools and
schedulers, or batch-split steps) goes there without renaming anything that uses "tp".
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pagedjax.attention.cache import init_kv_cache
from pagedjax.model.llama import ModelConfig

DATA_AXIS = "dp"
TP_AXIS = "tp"

_COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
_COLUMN_BIAS = ("q_bias", "k_bias", "v_bias", "gate_bias", "up_bias")
_ROW = ("o_proj", "down_proj")


def valid_sizes(cfg: ModelConfig, num_devices: int) -> list[int]:
    return [n for n in range(1, num_devices + 1)
            if cfg.num_kv_heads % n == 0 and cfg.num_heads % n == 0 and cfg.intermediate_size % n == 0]


def check_tensor_parallel(tensor_parallel_size: int, cfg: ModelConfig, num_devices: int | None = None) -> None:
    """Refuse a size the model or the machine cannot split into, naming the limit."""
    n = tensor_parallel_size
    if num_devices is None:
        num_devices = len(jax.devices())
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be an int >= 1, got {n!r}")
    ok = valid_sizes(cfg, num_devices)
    if n > num_devices:
        raise ValueError(f"tensor_parallel_size ({n}) exceeds the {num_devices} {jax.default_backend()} "
                         f"device(s) present (len(jax.devices())); sizes that fit this model here: {ok}")
    for name, count, why in (("num_kv_heads", cfg.num_kv_heads, "each device holds whole kv heads of the KV pool"),
                             ("num_heads", cfg.num_heads, "each device holds whole query heads"),
                             ("intermediate_size", cfg.intermediate_size, "the MLP is split by columns")):
        if count % n:
            raise ValueError(f"tensor_parallel_size ({n}) must divide the model's {name} ({count}): {why}; "
                             f"sizes that fit this model on {num_devices} device(s): {ok}")


def make_mesh(tensor_parallel_size: int, devices: list | None = None) -> Mesh:
    """A (1, N) mesh over axes ("dp", "tp") of the first N devices, Auto axes so GSPMD propagates
    the param and cache shardings through the step (make_mesh defaults to Explicit in 0.10.2)."""
    n = tensor_parallel_size
    devices = list(jax.devices() if devices is None else devices)
    if n > len(devices):
        raise ValueError(f"tensor_parallel_size ({n}) exceeds the {len(devices)} device(s) given")
    # Mesh, not jax.make_mesh: make_mesh asks for every device of a TPU slice when it orders them by
    # topology; the first N devices of jax.devices() are neighbours on GPUs and TPUs alike.
    return Mesh(np.asarray(devices[:n]).reshape(1, n), (DATA_AXIS, TP_AXIS), axis_types=(AxisType.Auto,) * 2)


def param_spec(name: str) -> P:
    if name in _COLUMN:
        return P(None, None, TP_AXIS)
    if name in _COLUMN_BIAS:
        return P(None, TP_AXIS)
    if name in _ROW:
        return P(None, TP_AXIS, None)
    return P()  # embed_tokens, lm_head, norms, o_bias, down_bias


def param_shardings(params: Any, mesh: Mesh) -> Any:
    """NamedShardings with the structure of `params` (see the module docstring)."""
    def one(path, _):
        return NamedSharding(mesh, param_spec(getattr(path[-1], "key", str(path[-1]))))

    return jax.tree_util.tree_map_with_path(one, params)


def shard_params(params: Any, mesh: Mesh) -> Any:
    return jax.device_put(params, param_shardings(params, mesh))


def kv_sharding(mesh: Mesh) -> NamedSharding:
    """The pool [L, KVH, num_blocks, block_size, D] split along kv heads."""
    return NamedSharding(mesh, P(None, TP_AXIS))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def init_sharded_kv_cache(cfg: ModelConfig, mesh: Mesh, num_blocks: int, block_size: int, dtype: Any):
    """Zeroed pool created shard by shard: the whole pool never exists on one device (a pool
    sized for N devices would not fit on one)."""
    s = kv_sharding(mesh)
    return jax.jit(lambda: init_kv_cache(cfg, num_blocks, block_size, dtype), out_shardings=(s, s))()


def kv_bytes_per_device(cfg: ModelConfig, num_blocks: int, block_size: int, dtype: Any,
                        tensor_parallel_size: int = 1) -> int:
    """Bytes of K and V pool one device holds: 1/N of the whole."""
    per_head = cfg.num_layers * num_blocks * block_size * cfg.head_dim * jnp.dtype(dtype).itemsize
    return 2 * per_head * (cfg.num_kv_heads // tensor_parallel_size)


def param_bytes_per_device(params: Any, tensor_parallel_size: int = 1) -> int:
    """Bytes of weights one device holds (split leaves count 1/N)."""
    def one(path, x):
        split = param_spec(getattr(path[-1], "key", str(path[-1]))) != P()
        return x.size * x.dtype.itemsize // (tensor_parallel_size if split else 1)

    return sum(jax.tree.leaves(jax.tree_util.tree_map_with_path(one, params)))


def shard_attention(attention_fn: Callable, mesh: Mesh) -> Callable:
    """A layer's attention `attention_fn(q [T, H, D], k, v [T, KVH, D], kv_cache, layer, meta) ->
    (o, kv_cache)` run per device on its H/N query heads, its KVH/N kv heads and its slice of the
    stacked pool [L, KVH, ...]; the layer index and the metadata are replicated, so every shard
    follows the same block tables."""
    heads = P(None, TP_AXIS, None)
    pool = (P(None, TP_AXIS), P(None, TP_AXIS))

    def sharded(q, k, v, kv_cache, layer, meta):
        return jax.shard_map(attention_fn, mesh=mesh, in_specs=(heads, heads, heads, pool, P(), P()),
                             out_specs=(heads, pool), check_vma=False)(q, k, v, kv_cache, layer, meta)

    return sharded
