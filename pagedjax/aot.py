"""Compile for TPUs and NVIDIA GPUs on a machine that has neither ("deviceless" ahead-of-time).

Interpret mode runs every Pallas kernel on a CPU, but it checks nothing a real compiler checks: a
kernel can pass every CPU test and still ask a GPU for more shared memory than a block may have.
The real compilers need no device. libtpu (from `jax[tpu]`) runs every Mosaic pass and XLA:TPU's
memory allocation against a described TPU topology; the CUDA plugin (`jax-cuda12-plugin`,
`jax-cuda12-pjrt`, with `ptxas` from `nvidia-cuda-nvcc-cu12`) runs XLA:GPU, Triton and ptxas
against a GPU described by a target config. `pip install -e '.[aot]'` brings them.

    from pagedjax import aot
    prog = aot.compile(fn, *abstract_args, target="h100")     # jax.ShapeDtypeStruct arguments
    prog.memory, prog.cost, prog.executable

    prog = aot.compile_engine_step("tpu-v5e", model_config, num_tokens=32, num_seqs=32, ...)

Targets (`TARGETS`): the TPU generations v4, v5e, v5p and v6e as libtpu's topologies, and the
H100, H200 and A100 as target configs written from NVIDIA's published properties
(pagedjax/targets/*.txtpb). Each carries its `DeviceLimits` (what the kernels tile for) and the
chip's published peaks (`Chip`), for roofline estimates.

What a compile tells and what it does not. It proves the program is accepted: Mosaic's layouts,
Triton's block shapes, the shared memory and VMEM it asks for, XLA's buffers. It gives
`memory_analysis()` (argument, output, alias and temporary bytes) and a cost analysis (flops,
bytes accessed). Nothing runs: numerics, speed and DMA behaviour still need the hardware.
Costs: XLA counts a loop body once, whatever its trip count (a scanned layer loop of 30 layers
costs one layer), and a Pallas kernel costs what its `pl.CostEstimate` says. XLA:TPU gives the
cost of the compiled program; XLA:GPU gives none without a device, so for GPU targets `cost` is
XLA's HLO cost analysis of the optimized GPU program, run on the host, plus each Pallas kernel's
estimate read from the traced program (`cost_source` says which). `compile_engine_step` corrects
for the layer loop (see there).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.resources
import os
import time
from collections.abc import Callable
from typing import Any

# libtpu takes a lock file that lets one process at a time load it, for the TPU it drives. A
# process that only compiles (JAX_PLATFORMS=cpu: no TPU is driven) does not need it, and with it
# the tests and a report could not compile side by side.
if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")

import jax  # noqa: E402
import jax.extend  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from pagedjax.pallas.common import DeviceLimits  # noqa: E402

__all__ = ["Chip", "Target", "TARGETS", "Compiled", "get_target", "devices", "compile",
           "abstract", "available", "installed", "compile_engine_step", "StepCost", "roofline", "model_shapes", "pairwise",
           "kernel_cases", "compile_kernel", "KERNEL_FACTORS", "KERNELS", "scatter_correction"]


@dataclasses.dataclass(frozen=True)
class Chip:
    """Published peaks of one chip: dense bf16 FLOP/s, HBM bytes/s and bytes, and where each
    number comes from."""

    name: str
    bf16_flops: float
    hbm_bandwidth: float
    hbm_bytes: float
    source: str


@dataclasses.dataclass(frozen=True)
class Target:
    """A device to compile for. platform "tpu": `topology` is libtpu's topology name (a whole
    host's slice; programs use its first chips). platform "gpu": `topology` is the target-config
    file in pagedjax/targets/."""

    name: str
    platform: str
    topology: str
    chip: Chip
    limits: DeviceLimits

    @property
    def max_devices(self) -> int:
        return 4


# Scoped VMEM: the limit Mosaic puts on one kernel's buffers, measured by compiling kernels with
# ever larger double-buffered blocks for each generation (16 MiB on v4, v5e, v5p; 32 MiB on v6e).
TARGETS: dict[str, Target] = {t.name: t for t in [
    Target("tpu-v4", "tpu", "v4:2x2x1",
           Chip("TPU v4", 275e12, 1200e9, 32 * 2**30,
                "Google Cloud TPU docs, 'TPU v4': 275 TFLOP/s bf16, 32 GiB HBM2 at 1,200 GB/s"),
           DeviceLimits("tpu", "TPU v4", vmem_bytes=16 << 20)),
    Target("tpu-v5e", "tpu", "v5e:2x2",
           Chip("TPU v5e", 197e12, 819e9, 16e9,
                "Google Cloud TPU docs, 'TPU v5e': 197 TFLOP/s bf16, 16 GB HBM2 at 819 GB/s"),
           DeviceLimits("tpu", "TPU v5e", vmem_bytes=16 << 20)),
    Target("tpu-v5p", "tpu", "v5p:2x2x1",
           Chip("TPU v5p", 459e12, 2765e9, 95e9,
                "Google Cloud TPU docs, 'TPU v5p': 459 TFLOP/s bf16, 95 GB HBM2e at 2,765 GB/s"),
           DeviceLimits("tpu", "TPU v5p", vmem_bytes=16 << 20)),
    Target("tpu-v6e", "tpu", "v6e:2x2",
           Chip("TPU v6e", 918e12, 1640e9, 32e9,
                "Google Cloud TPU docs, 'TPU v6e': 918 TFLOP/s bf16, 32 GB HBM at 1,640 GB/s"),
           DeviceLimits("tpu", "TPU v6e", vmem_bytes=32 << 20)),
    Target("h100", "gpu", "h100.txtpb",
           Chip("H100 SXM", 989e12, 3.35e12, 80e9,
                "NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense bf16, 80 GB HBM3 at 3.35 TB/s"),
           DeviceLimits("gpu", "H100 (sm_90)", shared_memory_per_block=232448, core_count=132)),
    Target("h200", "gpu", "h200.txtpb",
           Chip("H200 SXM", 989e12, 4.8e12, 141e9,
                "NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense bf16, 141 GB HBM3e at 4.8 TB/s"),
           DeviceLimits("gpu", "H200 (sm_90)", shared_memory_per_block=232448, core_count=132)),
    Target("a100", "gpu", "a100.txtpb",
           Chip("A100 SXM 80GB", 312e12, 2.039e12, 80e9,
                "NVIDIA A100 datasheet (SXM4 80GB): 312 TFLOP/s dense bf16, 80 GB HBM2e at 2,039 GB/s"),
           DeviceLimits("gpu", "A100 (sm_80)", shared_memory_per_block=166912, core_count=108)),
]}


def get_target(target: str | Target) -> Target:
    if isinstance(target, Target):
        return target
    if target not in TARGETS:
        raise ValueError(f"unknown target {target!r}; targets: {', '.join(TARGETS)}")
    return TARGETS[target]


def _target_config(filename: str) -> str:
    return importlib.resources.files("pagedjax").joinpath("targets", filename).read_text()


def installed(platform: str) -> bool:
    """Whether the deviceless compiler for "tpu" (libtpu) or "gpu" (the CUDA plugin) is installed."""
    import importlib.util

    return importlib.util.find_spec("libtpu" if platform == "tpu" else "jax_cuda12_plugin") is not None


@functools.lru_cache(maxsize=None)
def _topology(name: str, n: int):
    from jax.experimental import topologies

    t = TARGETS[name]
    try:
        if t.platform == "gpu":
            from importlib.metadata import version

            plugin = version("jax-cuda12-plugin")
            if plugin != jax.__version__:
                raise RuntimeError(f"jax-cuda12-plugin {plugin} does not match jax {jax.__version__}")
        if t.platform == "tpu":
            return topologies.get_topology_desc(t.topology, "tpu")
        return topologies.get_topology_desc("cuda", "cuda", topology=f"1x1x{n}",
                                            target_config=_target_config(t.topology))
    except Exception as e:  # no libtpu / CUDA plugin, or a version that does not match jax
        extra = "jax[tpu] (libtpu)" if t.platform == "tpu" else "jax-cuda12-plugin and jax-cuda12-pjrt"
        raise RuntimeError(f"cannot describe {name} for compilation: {e}. Deviceless compilation "
                           f"needs {extra} of jax's own version ({jax.__version__}): "
                           f"pip install -e '.[aot]'") from e


def available(target: str | Target) -> str | None:
    """None if this machine can compile for `target`, else why not (the [aot] extra missing, or of
    another version than jax)."""
    t = get_target(target)
    try:
        devices(t, 1)
    except RuntimeError as e:
        return str(e)
    return None


def devices(target: str | Target, n: int = 1) -> list:
    """The first n (<= 4) devices of the target's topology: compile-only devices, no memory."""
    t = get_target(target)
    if not 1 <= n <= t.max_devices:
        raise ValueError(f"n must be in [1, {t.max_devices}] for {t.name}; got {n}")
    return list(_topology(t.name, n if t.platform == "gpu" else 4).devices[:n])


def abstract(tree: Any, sharding: Any) -> Any:
    """A pytree of arrays or ShapeDtypeStructs as ShapeDtypeStructs placed with `sharding` (one
    sharding, or a pytree of them of the same structure)."""
    if isinstance(sharding, jax.sharding.Sharding):
        return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding), tree)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, sharding)


@dataclasses.dataclass
class Compiled:
    """One program compiled for one target."""

    target: Target
    executable: Any            # jax.stages.Compiled (cannot run: its devices have no memory)
    seconds: float             # wall time of trace + lower + compile
    memory: dict[str, int]     # memory_analysis(): argument/output/alias/temp/code bytes
    cost: dict[str, float]     # flops, bytes_accessed, transcendentals
    cost_source: str

    @property
    def device_bytes(self) -> int:
        """What the program needs resident on one device: arguments (donated ones reused as
        outputs), outputs that are not aliases of arguments, and temporaries."""
        m = self.memory
        return m["argument_bytes"] + m["output_bytes"] - m["alias_bytes"] + m["temp_bytes"]


def _memory(executable) -> dict[str, int]:
    m = executable.memory_analysis()
    return dict(argument_bytes=int(m.argument_size_in_bytes), output_bytes=int(m.output_size_in_bytes),
                alias_bytes=int(m.alias_size_in_bytes), temp_bytes=int(m.temp_size_in_bytes),
                code_bytes=int(m.generated_code_size_in_bytes))


def _kernel_estimates(jaxpr) -> tuple[float, float, float]:
    """(flops, bytes, transcendentals) of the Pallas kernels' cost estimates in a traced program,
    counted as XLA's cost analysis counts the program around them: a loop body once, but a
    scan unrolled into straight-line code (unroll >= length) once per iteration."""
    flops = nbytes = trans = 0.0
    for eqn in jaxpr.eqns:
        est = eqn.params.get("cost_estimate") if eqn.primitive.name == "pallas_call" else None
        if est is not None:
            flops += est.flops
            nbytes += est.bytes_accessed
            trans += est.transcendentals
        times = 1
        if eqn.primitive.name == "scan" and eqn.params.get("unroll", 1) >= eqn.params["length"]:
            times = eqn.params["length"]
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            f, b, t = _kernel_estimates(sub)
            flops, nbytes, trans = flops + times * f, nbytes + times * b, trans + times * t
    return flops, nbytes, trans


def _cost(target: Target, executable, traced) -> tuple[dict[str, float], str]:
    if target.platform == "tpu":
        c = executable.cost_analysis() or {}
        return (dict(flops=float(c.get("flops", 0.0)), bytes_accessed=float(c.get("bytes accessed", 0.0)),
                     transcendentals=float(c.get("transcendentals", 0.0))), "XLA:TPU cost analysis")
    from jax._src import xla_bridge
    from jax._src.lib import xla_client

    host = xla_bridge.get_backend("cpu")
    flops = nbytes = trans = 0.0
    for module in executable.runtime_executable().hlo_modules():
        c = xla_client._xla.hlo_module_cost_analysis(host, module)
        # an opaque custom call (a Triton kernel) counts -1 flops and -1 bytes: take them back
        calls = module.to_string().count('custom_call_target="__gpu$xla.gpu.triton"')
        flops += c.get("flops", 0.0) + calls
        nbytes += c.get("bytes accessed", 0.0) + calls
        trans += c.get("transcendentals", 0.0)
    kf, kb, kt = _kernel_estimates(traced.jaxpr.jaxpr)
    return (dict(flops=flops + kf, bytes_accessed=nbytes + kb, transcendentals=trans + kt),
            "XLA HLO cost analysis of the GPU program (on the host) + Pallas kernel estimates")


def compile(fn: Callable, *args, target: str | Target, mesh: Mesh | None = None, **static) -> Compiled:
    """Compile `fn` (jitted or not) for `target` from abstract arguments.

    args: pytrees of jax.ShapeDtypeStruct (or arrays, whose shapes and dtypes are taken). A leaf
    without a sharding is placed, replicated, on `mesh` (default: the target's first device).
    static: keyword arguments passed to the trace (a jitted function's static arguments).
    Raises whatever the compiler raises (a shared-memory or VMEM excess is a RESOURCE_EXHAUSTED
    error naming the bytes).
    """
    t = get_target(target)
    if mesh is None:
        mesh = Mesh(np.asarray(devices(t, 1)), ("x",))
    where = NamedSharding(mesh, P())

    def place(x):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.ShapeDtypeStruct) and isinstance(sharding, jax.sharding.Sharding):
            return x
        return jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=where)

    args = jax.tree.map(place, args)
    t0 = time.perf_counter()
    if isinstance(fn, functools.partial) and hasattr(fn.func, "trace"):
        # a partial of a jitted function (the engine's step): trace the jitted function itself, so
        # its donations and static arguments hold
        traced = fn.func.trace(*fn.args, *args, **fn.keywords, **static)
    else:
        traced = (fn if hasattr(fn, "trace") else jax.jit(fn)).trace(*args, **static)
    executable = traced.lower().compile()
    seconds = time.perf_counter() - t0
    cost, source = _cost(t, executable, traced)
    return Compiled(t, executable, seconds, _memory(executable), cost, source)


# ---------------------------------------------------------------------------------------------
# the kernel grid
# ---------------------------------------------------------------------------------------------

# What the kernels must compile for, on every target. Buckets are the engine's shapes: a decode
# batch of B sequences (paged and contiguous kernels) and a ragged step of T tokens over S seats.
KERNEL_FACTORS = {
    "head_dim": (64, 128, 256),
    "group": (1, 3, 4, 7, 8),                 # query heads per kv head
    "block_size": (8, 16, 32, 64, 128),       # the engine's (and the ablation's) block sizes
    "dtype": ("bfloat16", "float32"),
    "bucket": ((1, 8, 1), (8, 128, 16), (32, 512, 32)),   # (decode B, ragged T, ragged S)
}
KERNELS = ("paged_attention", "ragged_paged_attention", "contiguous_attention")
NUM_KV_HEADS = 2      # kv heads of every grid case (the kernels' grids run over them)
CONTEXT = 512         # tokens each block table holds (the contiguous cache's max_len)


def pairwise(factors: dict[str, tuple]) -> list[dict[str, Any]]:
    """A small set of rows in which every value of every factor meets every value of every other
    factor at least once (a pairwise covering array), built greedily and deterministically."""
    names = list(factors)
    uncovered = {(a, va, b, vb) for i, a in enumerate(names) for b in names[i + 1:]
                 for va in factors[a] for vb in factors[b]}
    rows = []
    while uncovered:
        # seed the row with an uncovered pair, then give every other factor the value that
        # covers the most pairs still uncovered
        a, va, b, vb = min(uncovered, key=lambda p: (names.index(p[0]), names.index(p[2]),
                                                      factors[p[0]].index(p[1]), factors[p[2]].index(p[3])))
        row = {a: va, b: vb}
        for name in names:
            if name in row:
                continue
            row[name] = max(factors[name], key=lambda v: sum(
                ((x, row[x], name, v) if names.index(x) < names.index(name) else (name, v, x, row[x]))
                in uncovered for x in row))
        uncovered -= {(x, row[x], y, row[y]) for i, x in enumerate(names) for y in names[i + 1:]}
        rows.append(row)
    return rows


def kernel_cases() -> list[tuple[str, dict[str, Any]]]:
    """(kernel, case) pairs: each kernel over the pairwise grid of KERNEL_FACTORS (the contiguous
    kernel has no blocks: its cases drop block_size and repeat none)."""
    grid = pairwise(KERNEL_FACTORS)
    out = []
    for kernel in KERNELS:
        seen = set()
        for row in grid:
            if kernel == "contiguous_attention":
                key = tuple(v for k, v in row.items() if k != "block_size")
                if key in seen:
                    continue
                seen.add(key)
            out.append((kernel, row))
    return out


def compile_kernel(target: str | Target, kernel: str, case: dict[str, Any]) -> Compiled:
    """Compile one kernel, in the variant for the target's platform, tiled for its limits."""
    from pagedjax import pallas

    t = get_target(target)
    d, bs = case["head_dim"], case["block_size"]
    dtype = jnp.dtype(case["dtype"])
    batch, tokens, seats = case["bucket"]
    kvh, h = NUM_KV_HEADS, case["group"] * NUM_KV_HEADS
    pages = CONTEXT // bs
    S = jax.ShapeDtypeStruct
    i32 = jnp.int32
    pool = S((kvh, 4 * pages + 1, bs, d), dtype)
    fn = functools.partial(getattr(pallas, kernel), limits=t.limits)
    if kernel == "paged_attention":
        args = (S((batch, h, d), dtype), pool, pool, S((batch, pages), i32), S((batch,), i32))
    elif kernel == "ragged_paged_attention":
        args = (S((tokens, h, d), dtype), pool, pool, S((seats, pages), i32), S((seats,), i32),
                S((seats + 1,), i32), S((), i32))
    else:
        cache = S((batch, kvh, CONTEXT, d), dtype)
        args = (S((batch, h, d), dtype), cache, cache, S((batch,), i32))
    return compile(fn, *args, target=t)


# ---------------------------------------------------------------------------------------------
# the engine step
# ---------------------------------------------------------------------------------------------


def model_shapes() -> dict[str, Any]:
    """ModelConfigs of the models the reports compile (shapes only, no weights): the default model
    and a Llama-3-8B-shaped one (32 layers, hidden 4096, 32 query / 8 kv heads of 128, 128k vocab)."""
    from pagedjax.model.llama import ModelConfig

    return {
        "smollm2-135m": ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                    num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                                    rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
                                    max_position_embeddings=8192, bos_token_id=1, eos_token_ids=(2,)),
        "llama-3-8b": ModelConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                                  num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                                  rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                                  bos_token_id=128000, eos_token_ids=(128001, 128009)),
    }


@dataclasses.dataclass
class StepCost:
    """One engine step compiled for a target, with its cost for the model's full depth."""

    program: Compiled          # the step as the engine runs it (layer loop; greedy sampling)
    flops: float               # the step's, every layer counted
    bytes_accessed: float
    transcendentals: float
    weight_bytes: int          # per device
    kv_pool_bytes: int         # per device
    sampler: Compiled          # the second call when a row samples (temperature > 0)


def compile_engine_step(target: str | Target, cfg, *, num_tokens: int, num_seqs: int, pages: int,
                        num_blocks: int, block_size: int = 16, dtype: Any = jnp.bfloat16,
                        tensor_parallel_size: int = 1, backend: str = "pallas",
                        with_costs: bool = True) -> StepCost:
    """Compile the engine's whole step (model, paged attention, greedy sampling and top
    logprobs) and its sampler (top-k/top-p/min-p draws, a second call) for `target`, with abstract weights and an abstract KV pool of
    num_blocks blocks: nothing is materialized. The bucket is (num_tokens T, num_seqs S, pages P
    block-table columns). tensor_parallel_size N > 1 splits heads over the target's first N
    devices as the engine does (pagedjax.parallel).

    Costs: XLA counts a loop body once, whatever its trip count, so a step's cost is taken from the
    same step compiled with its layers laid out one after another (unroll=True: the same
    computation without the loop; its memory analysis equals the looped one's where measured).
    with_costs=False skips that compile (cost then counts the loop body once). On a GPU target
    the cost comes from XLA's generic HLO cost analysis, which counts a scatter as reading and
    writing its whole operand; the step's per-layer K and V writes are in place (XLA:TPU's own
    cost analysis counts them so), so for backends that write in the loop the pool-sized terms
    of each write are taken back and its rows counted instead (`scatter_correction`).
    """
    from pagedjax import parallel
    from pagedjax.attention import make_attention
    from pagedjax.model.llama import param_shapes
    from pagedjax.runner import make_step, resample_step
    from pagedjax.scheduler.batch import StepInput

    t = get_target(target)
    n = tensor_parallel_size
    parallel.check_tensor_parallel(n, cfg, num_devices=t.max_devices)
    mesh = parallel.make_mesh(n, devices(t, n)) if n > 1 else Mesh(np.asarray(devices(t, 1)), ("x",))
    replicated = NamedSharding(mesh, P())

    attention = make_attention(backend)

    def programs(c, unroll=False):
        shapes = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, dtype), param_shapes(c),
                              is_leaf=lambda s: isinstance(s, tuple))
        pool = jax.ShapeDtypeStruct((c.num_layers, c.num_kv_heads, num_blocks, block_size, c.head_dim), dtype)
        if n > 1:
            params = abstract(shapes, parallel.param_shardings(shapes, mesh))
            kv = abstract((pool, pool), parallel.kv_sharding(mesh))
        else:
            params, kv = abstract(shapes, replicated), abstract((pool, pool), replicated)
        inputs = abstract(StepInput.padding(num_tokens, num_seqs, pages), replicated)
        step = make_step(c, backend=backend, mesh=mesh if n > 1 else None, limits=t.limits, unroll=unroll)
        return params, kv, inputs, step

    params, kv, inputs, step = programs(cfg)
    program = compile(step, params, kv, inputs, target=t, mesh=mesh)
    # the sampler: a second call when a row samples (temperature > 0)
    vocab = jax.ShapeDtypeStruct((num_seqs, cfg.vocab_size), jnp.float32, sharding=replicated)
    rows = jax.ShapeDtypeStruct((num_seqs,), jnp.float32, sharding=replicated)
    ids = jax.ShapeDtypeStruct((num_seqs,), jnp.int32, sharding=replicated)
    sampler = compile(resample_step, vocab, rows, ids, inputs.sampling, target=t, mesh=mesh)

    def total(p: Compiled):
        return np.array([p.cost["flops"], p.cost["bytes_accessed"], p.cost["transcendentals"]])

    cost = total(program)
    layers = 1
    if with_costs:
        p, kv_, inp, st = programs(cfg, unroll=True)
        cost = total(compile(st, p, kv_, inp, target=t, mesh=mesh))
        layers = cfg.num_layers
    weights = parallel.param_bytes_per_device(params, n)
    pool = parallel.kv_bytes_per_device(cfg, num_blocks, block_size, dtype, n)
    if t.platform == "gpu" and attention.writes_kv:
        rows = 2 * num_tokens * (cfg.num_kv_heads // n) * cfg.head_dim * jnp.dtype(dtype).itemsize
        cost[1] -= layers * scatter_correction(pool, rows)
    return StepCost(program, float(cost[0]), float(cost[1]), float(cost[2]), weights, pool, sampler)


def scatter_correction(operand_bytes: int, update_bytes: int) -> int:
    """What XLA's generic HLO cost analysis over-counts for in-place scatters of `update_bytes`
    into operands of `operand_bytes` in all: it counts operand + output + updates, where an
    in-place scatter reads its updates and writes as many bytes. Measured in tests/test_aot.py
    on a lone donated scatter compiled for an H100."""
    return 2 * operand_bytes - update_bytes


def roofline(chip: Chip, flops: float, bytes_accessed: float) -> dict[str, float]:
    """A lower bound on a program's time from the chip's peaks: it cannot beat its flops at peak
    FLOP/s, nor its bytes at peak HBM bandwidth. Which of the two binds says what limits it."""
    compute, memory = flops / chip.bf16_flops, bytes_accessed / chip.hbm_bandwidth
    return dict(seconds=max(compute, memory), compute_seconds=compute, memory_seconds=memory,
                bound="memory" if memory >= compute else "compute")
