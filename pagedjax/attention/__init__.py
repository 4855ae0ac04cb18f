"""One door to attention, for every backend: the model calls this and nothing else.

    attention = make_attention("pallas", limits=..., mesh=...)   # or "native", "reference", "jnp"
    plan = attention.plan(meta, num_tokens)             # once a step, outside the layer loop
    o, kv_cache = attention(q, k, v, kv_cache, layer, plan)     # once a layer

q [T, H, D] and k, v [T, KVH, D] are a layer's projections (rotary embeddings applied), in the
model's dtype; kv_cache is the whole stacked pool `(k_cache, v_cache)`, each
[L, KVH, num_blocks, block_size, D] (pagedjax.attention.cache); layer is the layer's index (an
int32 scalar: traced inside the scanned layer loop, a constant when the layers are unstacked);
meta is the step's AttentionMetadata. o is [T, H, D] in q's dtype, with zeros for padding
tokens. A backend object is hashable: the jitted step takes it as a static argument. A backend
whose `applies_rope(dtype)` is true for the model's dtype takes q and k *before* the rotary
embedding and applies it itself, given `plan(meta, num_tokens, rope=(cos, sin))` ("native", for
float32 models: two XLA ops a layer fewer).

Two ways to get a step's own K/V into the attention, one per kind of backend:
  writes_kv = True   ("pallas", "jnp"): each layer scatters its K/V into its layer of the pool,
                     carried through the layer loop (in place: nothing is sliced out or copied),
                     then attends over the pool, which now holds them. This is how the Pallas
                     kernel works on a GPU or TPU.
  writes_kv = False  ("reference"): the pool is only read inside the loop; each token attends
                     to its row's cached context in the pool plus the step's own K/V, and the
                     model writes every layer's K/V once after the loop. This is the CPU's way
                     (see pagedjax.attention.xla for why). "native" attends the same way and
                     then writes its layer's K/V itself, in the same C++ call (aliased buffers),
                     each row's after its reads: a writes_kv backend, whose pool XLA never copies.

Backends:
  "pallas"     the ragged Pallas kernel (pagedjax.pallas), tiled for the device `limits` describe;
               under tensor parallelism it runs per device in shard_map on its own heads.
  "native"     one C++ call per layer through jax.ffi (pagedjax.native): the fast CPU path.
  "reference"  the same split attention in XLA ops (pagedjax.attention.xla); GSPMD shards it.
  "jnp"        the pure-jnp ragged reference of the kernel (pagedjax.pallas.reference), written
               then read like "pallas": the truth the model tests compare against.
  "auto"       "native" on a CPU ("reference" if it cannot be built, or with tensor
               parallelism), "pallas" on a GPU or TPU.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pagedjax.attention.cache import init_kv_cache, write_kv, write_layer
from pagedjax.attention.metadata import AttentionMetadata, TokenLayout, token_layout
from pagedjax.pallas.common import DeviceLimits, device_limits

__all__ = [
    "AttentionMetadata", "TokenLayout", "token_layout", "init_kv_cache", "write_kv", "write_layer",
    "BACKENDS", "Attention", "PallasAttention", "JnpAttention", "XlaAttention", "NativeAttention",
    "make_attention", "resolve_backend",
]

BACKENDS = ("auto", "pallas", "reference", "native", "jnp")


class Attention:
    """The interface (see the module docstring). Subclasses are frozen dataclasses."""

    writes_kv: bool = False
    # whether the step should run the layers over unstacked weights (pagedjax.model.llama.unstack_layers)
    unstacked_layers: bool = False

    def applies_rope(self, dtype) -> bool:
        """Whether, for a model of `dtype`, this backend takes q and k before the rotary embedding
        and applies it itself: the model then passes `plan(meta, T, rope=(cos, sin))` and
        unrotated projections (the keys it writes are rotated all the same)."""
        return False

    def pool_dtype(self, dtype):
        """The dtype the pool is stored in for values of `dtype` (see cache.values_dtype)."""
        return dtype

    def plan(self, meta: AttentionMetadata, num_tokens: int, rope: Any = None) -> Any:
        """What every layer's call needs beyond `meta`, derived once a step (rope: see
        `applies_rope`)."""
        return meta

    def __call__(self, q, k, v, kv_cache, layer, plan):
        raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class _WriteThenRead(Attention):
    writes_kv = True

    def attend(self, q, k_cache, v_cache, layer, meta: AttentionMetadata):
        raise NotImplementedError

    def _layer(self, q, k, v, kv_cache, layer, meta):
        k_cache, v_cache = kv_cache
        k_cache = write_layer(k_cache, layer, k, meta.slot_mapping)
        v_cache = write_layer(v_cache, layer, v, meta.slot_mapping)
        return self.attend(q, k_cache, v_cache, layer, meta), (k_cache, v_cache)

    def __call__(self, q, k, v, kv_cache, layer, meta):
        return self._layer(q, k, v, kv_cache, layer, meta)


@dataclasses.dataclass(frozen=True)
class PallasAttention(_WriteThenRead):
    """The ragged Pallas kernel. limits: the device it is tiled and compiled for (default: the
    local one). mesh: a ("dp", "tp") mesh to run it per device on its own heads."""

    limits: DeviceLimits | None = None
    mesh: Any = None

    def attend(self, q, k_cache, v_cache, layer, meta):
        from pagedjax.pallas import ragged_paged_attention

        return ragged_paged_attention(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                      meta.query_start_loc, meta.num_seqs, layer=layer,
                                      limits=self.limits or device_limits())

    def __call__(self, q, k, v, kv_cache, layer, meta):
        if self.mesh is None:
            return self._layer(q, k, v, kv_cache, layer, meta)
        from pagedjax import parallel

        # a custom call GSPMD cannot partition: each device writes and reads its own kv heads
        return parallel.shard_attention(self._layer, self.mesh)(q, k, v, kv_cache, layer, meta)


@dataclasses.dataclass(frozen=True)
class JnpAttention(_WriteThenRead):
    """The pure-jnp ragged reference, written then read as the kernel is: the truth in tests."""

    def attend(self, q, k_cache, v_cache, layer, meta):
        from pagedjax.pallas.reference import ragged_paged_attention_reference

        return ragged_paged_attention_reference(q, k_cache, v_cache, meta.block_tables, meta.context_lens,
                                                meta.query_start_loc, meta.num_seqs, layer=layer)


@dataclasses.dataclass(frozen=True)
class _Split(Attention):
    """The CPU backends: each token over the pool's cached context, the step's K/V merged in
    (pagedjax.attention.xla); a plan is (layout, tables) plus what a backend adds."""

    writes_kv = False

    def plan(self, meta, num_tokens, rope=None):
        layout = token_layout(meta, num_tokens)
        return layout, meta.block_tables[layout.seq]          # each token's row's table [T, P]

    def split(self, qg, k, v, k_cache, v_cache, layer, tables, layout, *extra):
        """-> (o, (k_cache, v_cache)): the output and the pool (unchanged unless writes_kv)."""
        raise NotImplementedError

    def __call__(self, q, k, v, kv_cache, layer, plan):
        layout, tables, *extra = plan
        T, H, D = q.shape
        kvh = k.shape[1]
        qg = q.astype(jnp.float32).reshape(T, kvh, H // kvh, D) * D ** -0.5
        o, kv_cache = self.split(qg, k, v, kv_cache[0], kv_cache[1], layer, tables, layout, *extra)
        return o.astype(q.dtype), kv_cache


@dataclasses.dataclass(frozen=True)
class XlaAttention(_Split):
    """The "reference" backend: context and split attention in XLA ops."""

    def split(self, qg, k, v, k_cache, v_cache, layer, tables, layout):
        from pagedjax.attention.xla import xla_attention

        return xla_attention(qg, k, v, k_cache, v_cache, layer, tables, layout), (k_cache, v_cache)


@dataclasses.dataclass(frozen=True)
class NativeAttention(_Split):
    """The "native" backend: the same in one C++ call per layer (pagedjax.native), which also
    writes the layer's K/V into the pool after its reads. Its pool's pages are laid out for the
    kernel's sums (`pagedjax.native.to_pages`), so only this backend reads and writes them; whole
    blocks still move as they are (swaps, copy-on-write, prefix sharing)."""

    # each call writes its layer and hands the pool back (aliased), so the layers laid out one
    # after another update it in place; XLA:CPU copies a stacked weight's slice before every matmul
    writes_kv = True
    unstacked_layers = True

    def pool_dtype(self, dtype):
        # a bfloat16 pool as its bits: the kernel reads and writes them as bfloat16 either way,
        # and XLA then never converts the pool
        return jnp.uint16 if jnp.dtype(dtype) == jnp.bfloat16 else dtype

    def applies_rope(self, dtype):
        # a float32 model's rotary embedding in the kernel (two XLA fusions a layer fewer); a
        # bfloat16 model's stays XLA's, rounded to bfloat16 as transformers rounds it
        return jnp.dtype(dtype) == jnp.float32

    def plan(self, meta, num_tokens, rope=None):
        return (*super().plan(meta, num_tokens), meta.slot_mapping, rope)

    def __call__(self, q, k, v, kv_cache, layer, plan):
        from pagedjax import native

        layout, tables, slots, rope = plan
        if rope is None:
            return super().__call__(q, k, v, kv_cache, layer, plan)
        T, H, D = q.shape
        qg = q.reshape(T, k.shape[1], H // k.shape[1], D)   # rotated and scaled by the kernel
        o, kv_cache = native.attention(qg, k, v, kv_cache[0], kv_cache[1], layer, tables, layout, slot_mapping=slots,
                                       rope=(*rope, D ** -0.5))
        return o.astype(q.dtype), kv_cache

    def split(self, qg, k, v, k_cache, v_cache, layer, tables, layout, slots, rope=None):
        from pagedjax import native

        return native.attention(qg, k, v, k_cache, v_cache, layer, tables, layout, slot_mapping=slots)


def resolve_backend(backend: str, tensor_parallel_size: int = 1, platform: str | None = None) -> str:
    """The backend an engine runs: "auto" is "native" on a CPU when the kernel builds and the heads
    are not split over devices (an FFI call has no sharding rule), else "reference"; "pallas"
    on a GPU or TPU. An explicit "native" that cannot run is an error that says why."""
    from pagedjax import native

    platform = platform or jax.default_backend()
    if backend == "auto":
        if platform != "cpu":
            return "pallas"
        return "native" if tensor_parallel_size == 1 and native.available() else "reference"
    if backend not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(repr(b) for b in BACKENDS)}, got {backend!r}")
    if backend == "native":
        if platform != "cpu":
            raise ValueError(f"attention_backend='native' is a CPU kernel; this process runs on "
                             f"{platform!r} (use 'auto' or 'pallas')")
        if tensor_parallel_size != 1:
            raise ValueError(f"attention_backend='native' needs tensor_parallel_size 1, got {tensor_parallel_size} "
                             "(use 'reference' to split heads over devices)")
        if not native.available():
            raise ValueError(f"attention_backend='native': the CPU kernel could not be built: "
                             f"{native.unavailable_reason()}")
    return backend


def make_attention(backend: str, *, limits: DeviceLimits | None = None, mesh: Any = None) -> Attention:
    """The backend object for a resolved backend name (see resolve_backend)."""
    if backend == "pallas":
        return PallasAttention(limits, mesh)
    if backend == "native":
        return NativeAttention()
    if backend == "reference":
        return XlaAttention()
    if backend == "jnp":
        return JnpAttention()
    raise ValueError(f"no attention backend {backend!r}; resolve 'auto' first (resolve_backend)")
