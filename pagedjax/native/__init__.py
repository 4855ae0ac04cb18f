"""Native CPU kernels, built on first use and called from jitted code through `jax.ffi`.

Three kernels:
- `attention`, the CPU step's attention (pagedjax/native/attention.cc): each token over its row's
  cached context, read page by page from the pool, and over the step's own K/V of its row. It
  computes what `pagedjax.attention.xla.xla_attention` computes with XLA ops (`context_attention`
  + `split_attention`), and replaces it in the "native" attention backend ("auto" on a CPU picks
  that backend when the kernel builds). Its pool's pages are laid out for its sums (`to_pages`)
  and it writes the step's K/V into them itself (`slot_mapping`).
- `matmul` (pagedjax/native/matmul.cc, CPUs with AVX-512 or AVX2 and FMA): x times a weight held as `Panels`, on
  every core at the memory's rate; the native path's projections and output head
  (pagedjax.model.step_weights). `PAGEDJAX_NATIVE_MATMUL=0` leaves them to XLA.
- `greedy` (pagedjax/native/greedy.cc): the step's greedy tokens, their logprobs and logsumexp
  from the logits, non-finite rows zeroed, in one pass per row; the native path's step uses it.

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
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("attention.cc")
TARGET = "pagedjax_cpu_attention"
SYMBOL = "PagedjaxCpuAttention"
WRITING = ("_writing", "Writing")   # the suffixes of the handler that writes the step's K/V into the pool
ROPE = ("_writing_rope", "WritingRope")   # ... and applies the rotary embedding to q and k first
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


def cpu_vendor() -> str:
    """This CPU's vendor as /proc/cpuinfo gives it ("GenuineIntel", "AuthenticAMD"), else ""."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("vendor_id")), "")
    except OSError:
        return ""
    return line.partition(":")[2].strip()


def _has_pair_products() -> bool:
    """Whether this CPU has AVX-512 with AVX512_BF16's pair products (vdpbf16ps)."""
    return {"avx512f", "avx512_bf16"} <= cpu_flags()


def attention_flags() -> tuple[str, ...]:
    """The attention kernel's build flags beyond FLAGS on this CPU: on Intel cores with
    AVX512_BF16 `-DPAGEDJAX_WIDEN_BF16`, because there a bfloat16 page widened to float32 is read
    faster than by the pair products (see kBf16PairProducts in attention.cc). A source built with
    `-UPAGEDJAX_WIDEN_BF16` after these takes the pair products all the same."""
    wide = _has_pair_products() and cpu_vendor() == "GenuineIntel"
    return ("-DPAGEDJAX_WIDEN_BF16",) if wide else ()


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
def _prebuild() -> None:
    """Build the libraries this machine's step uses (attention, greedy, and the matmul where it
    runs) side by side, once per process, the first time any is needed: a first start on a new
    machine then waits for the longest build (~12 s on 2 cores), not their sum (~19 s). Each is
    still built, loaded and its failure reported by its own registration; built ones are reused."""
    if compiler() is None:
        return
    jobs = [(SOURCE, attention_flags()), (GREEDY_SOURCE, ())]
    if _matmul_wanted() is None:
        jobs.append((MATMUL_SOURCE, MATMUL_FLAGS))
    with ThreadPoolExecutor(len(jobs)) as pool:
        for done in [pool.submit(build, source=src, extra_flags=flags) for src, flags in jobs]:
            try:
                done.result()
            except NativeUnavailable:
                pass   # reported by that kernel's registration


_VALUE_PAIRS: dict[str, bool] = {}
_PAIR_PRODUCTS: dict[str, bool] = {}


def _load(source: Path, extra_flags: tuple[str, ...], handlers: dict[str, str],
          optional: dict[str, str] | None = None) -> str | None:
    """Build `source` (the libraries of this machine side by side first, `_prebuild`), load it and
    register its FFI handlers, {target: symbol}, and those of `optional` it has (another version
    of a source may not). Returns None when it worked, else the reason it did not."""
    _prebuild()
    try:
        lib = ctypes.cdll.LoadLibrary(str(build(source=source, extra_flags=extra_flags)))
        wanted = {**handlers, **{t: sym for t, sym in (optional or {}).items() if hasattr(lib, sym)}}
        for target, symbol in wanted.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
            # how its bf16 pages hold their values (an attention library's; older ones: position pairs)
            _VALUE_PAIRS[target] = hasattr(lib, "PagedjaxValuePairs") and lib.PagedjaxValuePairs() == 1
            # and how it multiplies them (older ones: pair products wherever the CPU has them)
            _PAIR_PRODUCTS[target] = (lib.PagedjaxPairProducts() == 1 if hasattr(lib, "PagedjaxPairProducts")
                                      else _has_pair_products())
    except (NativeUnavailable, OSError, AttributeError) as e:
        return str(e)
    return None


@lru_cache(maxsize=None)
def _register(source: Path = SOURCE, target: str = TARGET, extra_flags: tuple[str, ...] = ()) -> str | None:
    """Build, load and register an FFI target once per process. Returns None when it worked,
    else the reason it did not."""
    return _load(source, (*attention_flags(), *extra_flags), {target: SYMBOL},
                 {target + suffix: SYMBOL + symbol for suffix, symbol in (WRITING, ROPE)})


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


def bf16_pair_products(target: str = TARGET) -> bool:
    """Whether the kernel registered as `target` (this machine's own by default) reads a bfloat16
    pool (head dim a multiple of 32, blocks a multiple of 16 tokens) with AVX512_BF16's pair
    products: the queries and the softmax weights then enter those products rounded to bfloat16
    and every sum is float32, as flash attention does on an accelerator. Otherwise pages are
    widened to float32 and the queries and weights stay float32: on CPUs without those
    instructions, and on Intel's, whose cores read widened pages faster (`attention_flags`)."""
    if target == TARGET and not available():
        raise NativeUnavailable(unavailable_reason())
    return _PAIR_PRODUCTS[target]


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


# the packed forms of a panel (matmul.cc's Kind): the FFI attribute and bytes per record of 32
# inputs x 32 outputs
PACKED = {"q4": (4, 768), "q8": (8, 1152), "bf16": (16, 2048)}


# without -ffast-math: every output is summed in the order the source gives
MATMUL_FLAGS = ("-fno-fast-math",)


def matmul_cpu_supported() -> bool:
    """Whether this CPU has what matmul.cc is written for: AVX-512, or AVX2 with FMA."""
    flags = cpu_flags()
    return "avx512f" in flags or {"avx2", "fma"} <= flags


def _matmul_wanted() -> str | None:
    """Why the native matmul is not used here, or None."""
    if os.environ.get("PAGEDJAX_NATIVE_MATMUL", "1") == "0":
        return "turned off by PAGEDJAX_NATIVE_MATMUL=0"
    if not matmul_cpu_supported():
        return "the native matmul is written for AVX-512 or AVX2 with FMA, which this CPU does not have"
    return None


@lru_cache(maxsize=None)
def _register_matmul(target: str = MATMUL_TARGET, extra_flags: tuple[str, ...] = ()) -> str | None:
    return (_matmul_wanted() if target == MATMUL_TARGET else None) or _load(
        MATMUL_SOURCE, (*MATMUL_FLAGS, *extra_flags),
        {target: "PagedjaxCpuMatmul", target + "_packed": "PagedjaxCpuMatmulPacked"})


def register_matmul_build(extra_flags: tuple[str, ...]) -> str:
    """Build matmul.cc with `extra_flags` too (`-mno-avx512f`: the AVX2 path, on an AVX-512 CPU)
    and register it beside the project's own; returns the target to pass to `matmul(...,
    target=)`. For tests and benchmarks of a path this CPU would not take."""
    target = f"{MATMUL_TARGET}_{hashlib.sha256(' '.join(extra_flags).encode()).hexdigest()[:12]}"
    reason = _register_matmul(target, tuple(extra_flags))
    if reason is not None:
        raise NativeUnavailable(reason)
    return target


def matmul_available() -> bool:
    """Whether `matmul` runs here: a CPU with AVX-512 or AVX2 and FMA, the library built, and not
    turned off (`PAGEDJAX_NATIVE_MATMUL=0`, read once per process)."""
    return _register_matmul() is None


def matmul_unavailable_reason() -> str | None:
    return _register_matmul()


def packing_enabled() -> bool:
    """Whether `Panels.from_out_in` packs weights that are exactly 4-bit, 8-bit or bfloat16 blocks
    (the default; `PAGEDJAX_NATIVE_MATMUL=f32` keeps every panel float32, to compare)."""
    return os.environ.get("PAGEDJAX_NATIVE_MATMUL", "1") != "f32"


def matmul(x, panels, kind: str = "f32", target: str = MATMUL_TARGET):
    """x f32 [T, K] times a weight held as panels (`Panels`): f32 [N / 32, K, 32], or one of the
    packed forms (`kind` "q4", "q8", "bf16": u8 [N / 32, K / 32, record bytes]); f32 [T, N], each
    output summed over k in order, independently of the other rows (pagedjax/native/matmul.cc).
    `target`: one from `register_matmul_build`."""
    reason = _register_matmul() if target == MATMUL_TARGET else None
    if reason is not None:
        raise NativeUnavailable(reason)
    out = jax.ShapeDtypeStruct((x.shape[0], panels.shape[0] * PANEL), jnp.float32)
    x = jnp.asarray(x, jnp.float32)
    if kind == "f32":
        return jax.ffi.ffi_call(target, out)(x, panels)
    return jax.ffi.ffi_call(target + "_packed", out)(x, panels, kind=np.int32(PACKED[kind][0]))


@jax.tree_util.register_pytree_node_class
class Panels:
    """A float32 weight of `n` outputs held for the native matmul, in ceil(n / 32) panels of 32
    outputs (the zero outputs past `n` dropped from the product). `kind` "f32": `panels` f32
    [P, in, 32], each panel's weights for every input contiguous. Packed kinds hold a weight
    whose every value is exactly one of a smaller form, in records of 32 inputs (`panels` u8
    [P, in / 32, bytes], layouts in matmul.cc): "q4", per 32 inputs of an output a scale and a
    minimum times 4-bit integers (a GGUF Q4_1 tensor, dequantized); "q8", a scale times 8-bit
    integers (Q8_0); "bf16". The product is the float32 panel's, bit for bit, from fewer bytes.
    `x @ Panels` is x times the weight; `to_out_in` gives it back."""

    def __init__(self, panels, n: int, kind: str = "f32"):
        self.panels, self.n, self.kind = panels, n, kind

    @classmethod
    def from_out_in(cls, w, pack: bool | None = None) -> Panels:
        """From a weight `[out, in]` (the unstacked layers' layout, see pagedjax.model.llama),
        packed in the smallest form that holds every value exactly when `pack` (default
        `packing_enabled()`); float32 otherwise."""
        n, k = w.shape
        w = np.pad(np.asarray(w, np.float32), ((0, -n % PANEL), (0, 0)))
        if pack if pack is not None else packing_enabled():
            for kind, packer in _PACKERS.items():
                # the first panel says at once whether a form can hold the rest (a weight
                # updated by training has left every form)
                if packer(w[:PANEL]) is not None and (packed := packer(w)) is not None:
                    return cls(jnp.asarray(packed), n, kind)
        return cls(jnp.asarray(w.reshape(-1, PANEL, k).transpose(0, 2, 1)), n)

    def to_out_in(self):
        panels = np.asarray(self.panels)
        w = _UNPACKERS[self.kind](panels) if self.kind != "f32" else panels.transpose(0, 2, 1)
        return jnp.asarray(w.reshape(-1, w.shape[-1])[:self.n])

    @property
    def nbytes(self) -> int:
        return self.panels.nbytes

    def __rmatmul__(self, x):
        y = matmul(x, self.panels, self.kind)
        return y if y.shape[1] == self.n else y[:, :self.n]

    def tree_flatten(self):
        return (self.panels,), (self.n, self.kind)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(children[0], *aux)


# -- packing: numpy on the host, once per loaded weight; w is f32 [N, K] with N a multiple of 32.
# Each form is tried over every block of 32 inputs of an output and kept only if it gives back
# every value's bits exactly (in the 4- and 8-bit forms NaNs and infinities never do; bfloat16
# holds any float32 whose low 16 bits are zero); the layouts are matmul.cc's records.

def _records(a: np.ndarray) -> np.ndarray:
    """[N, K / 32, 32 (k), ...] -> [P, K / 32, 32 (k), 32 (n), ...]: the panels' records."""
    n = a.shape[0]
    return np.moveaxis(a.reshape(n // PANEL, PANEL, *a.shape[1:]), 1, 3)


def _per_output(a: np.ndarray) -> np.ndarray:
    """Per (output, record) f32 [N, K / 32] -> each record's 32 values, as bytes [P, K / 32, 128]."""
    n, kb = a.shape
    return np.ascontiguousarray(a.reshape(n // PANEL, PANEL, kb).transpose(0, 2, 1)).view(np.uint8)


def _scaled(blocks: np.ndarray, base: np.ndarray, spread: np.ndarray, top: int):
    """Integers q in [lo, top] with scale * q + base == blocks exactly, for a half-precision scale
    near spread / top (the nearest, else one step either side); (scale, q) or None."""
    lo = 0 if top == 15 else -128
    scale = (spread / top).astype(np.float16)
    found = np.zeros(blocks.shape[:2], bool)
    best_scale, best_q = np.zeros(blocks.shape[:2], np.float32), np.zeros(blocks.shape, np.float32)
    with np.errstate(all="ignore"):
        for step in (0, 1, -1):
            s = (scale if step == 0 else np.nextafter(scale, np.float16(np.inf if step > 0 else -np.inf))).astype(np.float32)
            q = np.rint((blocks - base[..., None]) / np.where(s > 0, s, 1)[..., None]).astype(np.float32)
            again = (s[..., None] * q + base[..., None]).view(np.uint32)    # bits: -0.0 is not 0.0
            exact = ((q >= lo) & (q <= top) & (again == blocks.view(np.uint32))).all(-1) & ~found
            best_scale[exact], best_q[exact] = s[exact], q[exact]
            found |= exact
            if found.all():
                return best_scale, best_q
            if step == 0 and found.mean() < 0.99:   # the other two only mend a scale rounded at a tie
                return None
    return None


def _pack_q4(w: np.ndarray) -> np.ndarray | None:
    n, k = w.shape
    if k % 32:
        return None
    blocks = w.reshape(n, k // 32, 32)
    low = blocks.min(-1)
    found = _scaled(blocks, low, blocks.max(-1) - low, 15)
    if found is None:
        return None
    scale, q = found
    q = _records(q.astype(np.uint8))                        # [P, KB, 32 k, 32 n]
    nibbles = q[..., :16] | (q[..., 16:] << 4)              # byte j: outputs j and j + 16
    return np.concatenate([_per_output(scale), _per_output(low), nibbles.reshape(*q.shape[:2], 512)], -1)


def _pack_q8(w: np.ndarray) -> np.ndarray | None:
    n, k = w.shape
    if k % 32:
        return None
    blocks = w.reshape(n, k // 32, 32)
    found = _scaled(blocks, np.zeros(blocks.shape[:2], np.float32), np.abs(blocks).max(-1), 127)
    if found is None:
        return None
    scale, q = found
    q = _records(q.astype(np.int8)).view(np.uint8)
    return np.concatenate([_per_output(scale), q.reshape(*q.shape[:2], 1024)], -1)


def _pack_bf16(w: np.ndarray) -> np.ndarray | None:
    n, k = w.shape
    bits = w.view(np.uint32)
    if k % 32 or (bits & 0xFFFF).any():
        return None
    high = _records((bits >> 16).astype(np.uint16).reshape(n, k // 32, 32))
    return np.ascontiguousarray(high).view(np.uint8).reshape(*high.shape[:2], 2048)


def _from_records(a: np.ndarray) -> np.ndarray:
    """[P, K / 32, 32 (k), 32 (n)] -> [P * 32, K]: the inverse of `_records`."""
    p, kb = a.shape[:2]
    return a.transpose(0, 3, 1, 2).reshape(p * PANEL, kb * 32)


def _scales(packed: np.ndarray, at: int) -> np.ndarray:
    """The per-output f32 values stored at byte `at` of every record, as [P, K / 32, 1, 32]."""
    return np.ascontiguousarray(packed[..., at:at + 128]).view(np.float32)[:, :, None, :]


def _unpack_q4(packed: np.ndarray) -> np.ndarray:
    nibbles = packed[..., 256:].reshape(*packed.shape[:2], 32, 16)
    q = np.concatenate([nibbles & 0xF, nibbles >> 4], -1).astype(np.float32)
    return _from_records(_scales(packed, 0) * q + _scales(packed, 128))


def _unpack_q8(packed: np.ndarray) -> np.ndarray:
    q = np.ascontiguousarray(packed[..., 128:]).view(np.int8).reshape(*packed.shape[:2], 32, 32)
    return _from_records(_scales(packed, 0) * q.astype(np.float32))


def _unpack_bf16(packed: np.ndarray) -> np.ndarray:
    high = np.ascontiguousarray(packed).view(np.uint16).reshape(*packed.shape[:2], 32, 32)
    return _from_records((high.astype(np.uint32) << 16).view(np.float32))


_PACKERS = {"q4": _pack_q4, "q8": _pack_q8, "bf16": _pack_bf16}
_UNPACKERS = {"q4": _unpack_q4, "q8": _unpack_q8, "bf16": _unpack_bf16}


def attention(qg, k_new, v_new, k_cache, v_cache, layer, tables, layout, target: str = TARGET,
              *, slot_mapping=None, rope=None):
    """Drop-in for `pagedjax.attention.xla.xla_attention` (same arguments, same result): qg f32
    [T, KVH, G, D] scaled queries; k_new, v_new [T, KVH, D] the step's own K/V; the pool
    [L, KVH, NB, BS, D] f32 or bf16 (or bf16 as uint16 bits), its pages in the kernel's layout
    (`to_pages`), not yet holding them; layer an int32 scalar; tables [T, P] each token's row's
    block table; layout the `TokenLayout` of the step. Returns f32 [T, KVH * G, D] (0 for
    padding tokens). `target`: one from `register_source`.

    slot_mapping (int32 [T], -1 for none) also writes the step's K/V into the pool's `layer` at
    those slots, each row's after its own reads (a row reads only positions before its step's
    first, and the blocks it writes are its own), and returns `(o, (k_cache, v_cache))`: the pool
    handed back in the same buffers (aliased), now holding them. Thread it on to the next layer's call and XLA
    updates the donated pool in place; unless it is donated or threaded on, XLA copies it first.

    rope = (cos, sin, scale), with slot_mapping: qg and k_new come *before* the rotary embedding
    (cos, sin f32 [T, D], as `pagedjax.model.llama.rope_cos_sin` gives them); the kernel rotates
    both (writing the rotated keys) and multiplies the rotated queries by `scale`, which saves
    the step the XLA ops that would do it."""
    reason = _register() if target == TARGET else None
    if reason is not None:
        raise NativeUnavailable(reason)
    if rope is not None and slot_mapping is None:
        raise ValueError("native.attention: rope needs slot_mapping (the rotating call also writes the keys)")
    T, KVH, G, D = qg.shape
    out = jax.ShapeDtypeStruct((T, KVH, G, D), jnp.float32)
    i32 = lambda x: jnp.asarray(x, jnp.int32)  # noqa: E731
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    operands = (f32(qg), f32(k_new), f32(v_new), k_cache, v_cache, i32(layer), i32(tables),
                i32(jnp.where(layout.valid, layout.seq, -1)), i32(jnp.where(layout.valid, layout.start, 0)))
    if slot_mapping is None:
        return jax.ffi.ffi_call(target, out)(*operands).reshape(T, KVH * G, D)
    like = lambda c: jax.ShapeDtypeStruct(c.shape, c.dtype)  # noqa: E731
    results = (out, like(k_cache), like(v_cache))
    if rope is None:
        call = jax.ffi.ffi_call(target + WRITING[0], results, input_output_aliases={3: 1, 4: 2})
        o, k_cache, v_cache = call(*operands, i32(slot_mapping))
    else:
        cos, sin, scale = rope
        call = jax.ffi.ffi_call(target + ROPE[0], results, input_output_aliases={3: 1, 4: 2})
        o, k_cache, v_cache = call(*operands, i32(slot_mapping), f32(cos), f32(sin), scale=np.float32(scale))
    return o.reshape(T, KVH * G, D), (k_cache, v_cache)


def value_pairs(target: str = TARGET) -> bool:
    """Whether the attention kernel registered as `target` (this machine's own by default, or one
    from `register_source`) keeps a bfloat16 page's values in value pairs (builds without AVX-512)
    rather than position pairs (AVX-512 builds): see `to_pages`."""
    if target == TARGET and not available():
        raise NativeUnavailable(unavailable_reason())
    return _VALUE_PAIRS[target]


def _page_shapes(pool, target: str):
    """K's values per 32-bit lane W (1 for float32, 2 for 16-bit values) and how V is held: "rows",
    "positions" (position pairs) or "values" (value pairs)."""
    w = 4 // jnp.dtype(pool.dtype).itemsize
    bs, d = pool.shape[-2:]
    if w == 1:
        return w, "rows"
    if value_pairs(target):
        return w, "values" if d % 16 == 0 else "rows"
    return w, "positions" if bs % 2 == 0 else "rows"


def _page_views(k_cache, target: str):
    """For K and V, how a page [BS, D] splits into axes position-major, and which two axes the
    kernel's layout swaps (None: V in rows)."""
    w, values = _page_shapes(k_cache, target)
    bs, d = k_cache.shape[-2:]
    k = ((bs, d // w, w), (-3, -2))
    v = {"positions": ((bs // 2, 2, d), (-2, -1)), "values": ((bs, d // 16, 2, 8), (-2, -1))}.get(values)
    return k, v


def _swap_page_axes(x, view, undo: bool):
    """x's pages [.., BS, D] rearranged by `view` (see _page_views), or that undone."""
    if view is None:
        return x
    split, (a, b) = view
    if undo:  # from the kernel's split: the same axes swapped back
        split = list(split)
        split[a], split[b] = split[b], split[a]
    *lead, bs, d = x.shape
    return jnp.swapaxes(x.reshape(*lead, *split), a, b).reshape(*lead, bs, d)


def to_pages(k_cache, v_cache, target: str = TARGET):
    """A pool in the other backends' layout (each page [BS, D], position-major) as the native
    kernel `target` lays it out, so that 16 positions sit side by side in a vector the way its
    sums want them. With W values per 32-bit lane (1 for float32, 2 for bfloat16): K pages
    [D / W, BS, W]; V pages of a float32 pool in rows [BS, D]; of a bfloat16 pool, as the build
    multiplies them, in position pairs [BS / 2, D, 2] (value d of positions o, o + 1 in one lane:
    AVX-512 builds, whose pair products take two positions at once) or in value pairs
    [BS, D / 16, 8, 2] (values d and d + 8 of each 16 of one position in one lane: other builds,
    which widen a lane row into two vectors of one position's values); rows where the pairs do
    not fit (an odd BS; D not a multiple of 16). For tests and tools; the kernel writes its own
    pool (`slot_mapping`)."""
    k_view, v_view = _page_views(k_cache, target)
    return _swap_page_axes(k_cache, k_view, False), _swap_page_axes(v_cache, v_view, False)


def from_pages(k_cache, v_cache, target: str = TARGET):
    """`to_pages` undone: the native kernel's pool in the position-major layout."""
    k_view, v_view = _page_views(k_cache, target)
    return _swap_page_axes(k_cache, k_view, True), _swap_page_axes(v_cache, v_view, True)


# -- greedy ---------------------------------------------------------------------------------------

GREEDY_SOURCE = Path(__file__).with_name("greedy.cc")
GREEDY_TARGET = "pagedjax_cpu_greedy"


@lru_cache(maxsize=None)
def _register_greedy() -> str | None:
    return _load(GREEDY_SOURCE, (), {GREEDY_TARGET: "PagedjaxCpuGreedy"})


def greedy_available() -> bool:
    """Whether `greedy` runs here (building it if needed)."""
    return _register_greedy() is None


def greedy_unavailable_reason() -> str | None:
    return _register_greedy()


def greedy(logits):
    """The step's greedy choice from logits f32 [S, V]: (safe, token, logprob, lse, finite), where
    `safe` is the logits with every row holding a non-finite value zeroed (`finite` False for it),
    token int32 [S] the first index of each row's maximum of `safe`, lse f32 [S] its logsumexp and
    logprob f32 [S] the token's log-probability. What `jnp.isfinite`, `jnp.where` and
    `pagedjax.sampling.greedy` give: safe, finite and the token exactly; lse and logprob summed in
    double, within float32 rounding of the exact values (XLA's float32 sums drift ~1e-5). `safe`
    takes the logits' buffer (XLA copies them first where they live on)."""
    reason = _register_greedy()
    if reason is not None:
        raise NativeUnavailable(reason)
    S, V = logits.shape
    out = (jax.ShapeDtypeStruct((S, V), jnp.float32), jax.ShapeDtypeStruct((S,), jnp.int32),
           jax.ShapeDtypeStruct((S,), jnp.float32), jax.ShapeDtypeStruct((S,), jnp.float32),
           jax.ShapeDtypeStruct((S,), jnp.bool_))
    return jax.ffi.ffi_call(GREEDY_TARGET, out, input_output_aliases={0: 0})(jnp.asarray(logits, jnp.float32))
