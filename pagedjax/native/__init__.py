"""Native CPU kernels, built on first use and called from jitted code through `jax.ffi`.

Two kernels:
- `attention`, the CPU step's attention (pagedjax/native/attention.cc): each token over its row's
  cached context, read page by page from the pool, and over the step's own K/V of its row. It
  computes what `pagedjax.attention.xla.xla_attention` computes with XLA ops (`context_attention`
  + `split_attention`), and replaces it in the "native" attention backend ("auto" on a CPU picks
  that backend when the kernel builds).
- `matmul` (pagedjax/native/matmul.cc, AVX-512 CPUs): x times a weight held as `Panels`, on
  every core at the memory's rate; the native path's projections and output head
  (pagedjax.model.step_weights). `PAGEDJAX_NATIVE_MATMUL=0` leaves them to XLA.

The source is compiled once per machine with the C++ compiler found as `$CXX`, else `g++`, else
`c++`, against the XLA FFI headers jaxlib ships (`jax.ffi.include_dir()`), with `-march=native`:
each library is tied to this CPU and this jaxlib, so it lives in the cache directory
(`$PAGEDJAX_CACHE`, else ~/.cache/pagedjax) under a name hashed from the source, the flags, the
jaxlib version, the compiler and the CPU's feature flags, never in the repository. If no compiler is found or the build
fails, `available()` says why and "auto" falls back to the XLA ops.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.cc")
TARGET = "pagedjax_cpu_attention"
SYMBOL = "PagedjaxCpuAttention"
PASSING_POOL = ("_passing_pool", "PassingPool")   # the suffixes of the handler that hands the pool back
# -ffast-math lets the dot products and exp vectorise (glibc's vector exp); the kernel never
# computes with infinities (see kNoScore in the source)
FLAGS = ("-O3", "-march=native", "-ffast-math", "-std=c++17", "-shared", "-fPIC")


class NativeUnavailable(RuntimeError):
    """The native kernels cannot be built or loaded here; the message says why."""


def compiler() -> str | None:
    """The C++ compiler the kernels are built with, or None."""
    for name in (os.environ.get("CXX"), "g++", "c++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _library_path(cxx: str, source: Path, flags: tuple[str, ...]) -> Path:
    from pagedjax.model.hub import cache_dir

    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    key = hashlib.sha256()
    for part in (source.read_bytes(), " ".join(flags).encode(), _jaxlib_version().encode(), "".join(version).encode(),
                 platform.machine().encode(), _cpu_features().encode()):
        key.update(part)
        key.update(b"\0")
    return cache_dir() / "native" / f"{source.stem}-{key.hexdigest()[:16]}.so"


def _cpu_features() -> str:
    """What -march=native compiles for: a cache directory shared between machines (a network
    home) must not hand an AVX-512 build to a CPU without it."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return platform.processor()


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def build(force: bool = False, source: Path = SOURCE, extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile the kernel library if this machine has no current build; returns its path.
    Raises `NativeUnavailable` with the compiler's message when it cannot. `source`: another
    version of attention.cc (a benchmark comparing kernels side by side); `extra_flags`: added
    to the compiler's (e.g. `-mno-avx512bf16` to build the path CPUs without it take)."""
    flags = (*FLAGS, *extra_flags)
    cxx = compiler()
    if cxx is None:
        raise NativeUnavailable("no C++ compiler found (tried $CXX, g++, c++)")
    lib = _library_path(cxx, Path(source), flags)
    if lib.is_file() and not force:
        return lib
    lib.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:
        part = Path(tmp) / lib.name
        cmd = [cxx, *flags, f"-I{jax.ffi.include_dir()}", str(source), "-o", str(part)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeUnavailable(f"`{' '.join(cmd)}` exited with {proc.returncode}:\n"
                                    f"{(proc.stderr or proc.stdout).strip()[-3000:]}")
        os.replace(part, lib)    # atomic: a concurrent build leaves one whole library
    logger.info("built %s", lib)
    return lib


@lru_cache(maxsize=None)
def _register(source: Path = SOURCE, target: str = TARGET, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Build, load and register an FFI target once per process. Returns None when it worked,
    else the reason it did not."""
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source=source, extra_flags=extra_flags)))
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, SYMBOL)), platform="cpu")
        if hasattr(lib, SYMBOL + PASSING_POOL[1]):   # another version of the source may not have it
            jax.ffi.register_ffi_target(target + PASSING_POOL[0], jax.ffi.pycapsule(getattr(lib, SYMBOL + PASSING_POOL[1])),
                                        platform="cpu")
    except (NativeUnavailable, OSError, AttributeError) as e:
        return str(e)
    return None


def register_source(source: Path = SOURCE, extra_flags: tuple[str, ...] = ()) -> str:
    """Build another version of attention.cc, or this one with `extra_flags`, and register it
    beside the project's own; returns the target to pass to `attention(..., target=)`. For
    benchmarks that compare kernels in one process and tests of paths this CPU would not take."""
    source = Path(source).resolve()
    key = hashlib.sha256(source.read_bytes() + " ".join(extra_flags).encode()).hexdigest()[:12]
    target = f"{TARGET}_{key}"
    reason = _register(source, target, tuple(extra_flags))
    if reason is not None:
        raise NativeUnavailable(reason)
    return target


def available() -> bool:
    """Whether the native kernels are built and registered (building them if needed)."""
    return _register() is None


def bf16_pair_products() -> bool:
    """Whether the kernel, as built for this CPU, reads a bfloat16 pool (head dim a multiple of
    32, blocks a multiple of 16 tokens) with AVX512_BF16's pair products: the queries and the
    softmax weights then enter those products rounded to bfloat16 and every sum is float32, as
    flash attention does on an accelerator. Without those instructions pages are widened to
    float32 and the queries and weights stay float32."""
    return {"avx512f", "avx512_bf16"} <= cpu_flags()


def unavailable_reason() -> str | None:
    return _register()


def cpu_flags() -> set[str]:
    """This CPU's feature flags as Linux names them (/proc/cpuinfo: "avx512f", "amx_bf16", ...);
    empty where that file is not there."""
    line = _cpu_features()
    return set(line.partition(":")[2].split()) if ":" in line else set()


# -- matmul ---------------------------------------------------------------------------------------

MATMUL_SOURCE = Path(__file__).with_name("matmul.cc")
MATMUL_TARGET = "pagedjax_cpu_matmul"
PANEL = 32   # outputs per panel (see matmul.cc)


@lru_cache(maxsize=None)
def _register_matmul() -> str | None:
    if os.environ.get("PAGEDJAX_NATIVE_MATMUL", "1") == "0":
        return "turned off by PAGEDJAX_NATIVE_MATMUL=0"
    if "avx512f" not in cpu_flags():
        return "the native matmul is written for AVX-512, which this CPU does not have"
    try:
        # without -ffast-math: every output is summed in the order the source gives
        lib = ctypes.cdll.LoadLibrary(str(build(source=MATMUL_SOURCE, extra_flags=("-fno-fast-math",))))
        jax.ffi.register_ffi_target(MATMUL_TARGET, jax.ffi.pycapsule(lib.PagedjaxCpuMatmul), platform="cpu")
    except (NativeUnavailable, OSError, AttributeError) as e:
        return str(e)
    return None


def matmul_available() -> bool:
    """Whether `matmul` runs here: a CPU with AVX-512, the library built, and not turned off
    (`PAGEDJAX_NATIVE_MATMUL=0`, read once per process)."""
    return _register_matmul() is None


def matmul_unavailable_reason() -> str | None:
    return _register_matmul()


def matmul(x, panels):
    """x f32 [T, K] times a weight held as panels f32 [N / 32, K, 32] (`Panels`): f32 [T, N], each
    output summed over k in order, independently of the other rows (pagedjax/native/matmul.cc)."""
    reason = _register_matmul()
    if reason is not None:
        raise NativeUnavailable(reason)
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * PANEL), jnp.float32)
    return jax.ffi.ffi_call(MATMUL_TARGET, out)(jnp.asarray(x, jnp.float32), panels)


@jax.tree_util.register_pytree_node_class
class Panels:
    """A float32 weight of `n` outputs held for the native matmul: `panels` f32 [ceil(n / 32), in,
    32], each 32 outputs' weights for every input contiguous (the zero outputs past `n` dropped
    from the product). `x @ Panels` is x times the weight; `to_out_in` gives it back."""

    def __init__(self, panels, n: int):
        self.panels, self.n = panels, n

    @classmethod
    def from_out_in(cls, w) -> Panels:
        """From a weight `[out, in]` (the unstacked layers' layout, see pagedjax.model.llama)."""
        n, k = w.shape
        pad = -n % PANEL
        w = jnp.pad(jnp.asarray(w, jnp.float32), ((0, pad), (0, 0)))
        return cls(w.reshape(-1, PANEL, k).transpose(0, 2, 1), n)

    def to_out_in(self):
        p, k, _ = self.panels.shape
        return self.panels.transpose(0, 2, 1).reshape(p * PANEL, k)[:self.n]

    def __rmatmul__(self, x):
        y = matmul(x, self.panels)
        return y if y.shape[1] == self.n else y[:, :self.n]

    def tree_flatten(self):
        return (self.panels,), self.n

    @classmethod
    def tree_unflatten(cls, n, children):
        return cls(children[0], n)


def attention(qg, k_new, v_new, k_cache, v_cache, layer, tables, layout, target: str = TARGET,
              *, passing_pool: bool = False):
    """Drop-in for `pagedjax.attention.xla.xla_attention` (same arguments, same result): qg f32
    [T, KVH, G, D] scaled queries; k_new, v_new [T, KVH, D] the step's own K/V; the pool
    [L, KVH, NB, BS, D] f32 or bf16, not yet holding them; layer an int32 scalar; tables [T, P]
    each token's row's block table; layout the `TokenLayout` of the step. Returns f32
    [T, KVH * G, D] (0 for padding tokens). `target`: one from `register_source`.

    passing_pool=True returns `(o, (k_cache, v_cache))`: the pool handed back unchanged, in the
    same buffers. Thread it on (the next layer's call, then the step's K/V write) and the write
    comes after every read by construction, so XLA updates the donated pool in place; a write
    into the pool the calls were given could not be ordered after the last of them, and XLA
    copies the whole pool to keep that read safe. Unless the pool is donated or threaded on,
    XLA copies it before the call instead."""
    reason = _register() if target == TARGET else None
    if reason is not None:
        raise NativeUnavailable(reason)
    T, KVH, G, D = qg.shape
    out = jax.ShapeDtypeStruct((T, KVH, G, D), jnp.float32)
    if passing_pool:
        like = lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype)  # noqa: E731
        call = jax.ffi.ffi_call(target + PASSING_POOL[0], (out, like(k_cache), like(v_cache)),
                                input_output_aliases={3: 1, 4: 2})
    else:
        call = jax.ffi.ffi_call(target, out)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    result = call(f32(qg), f32(k_new), f32(v_new), k_cache, v_cache, i32(layer), i32(tables),
                  i32(jnp.where(layout.valid, layout.seq, -1)), i32(jnp.where(layout.valid, layout.start, 0)))
    if passing_pool:
        o, k_cache, v_cache = result
        return o.reshape(T, KVH * G, D), (k_cache, v_cache)
    return result.reshape(T, KVH * G, D)
