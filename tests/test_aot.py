"""Every Pallas kernel and the whole engine step compiled -- not only lowered -- for TPUs and NVIDIA
GPUs by the real compilers, on this machine without either (pagedjax.aot).

Interpret mode runs the kernels' math on a CPU but none of a compiler's limits: Mosaic's layouts
and VMEM on a TPU, Triton's block shapes and a GPU block's shared memory, XLA's HBM. libtpu
compiles for described TPU topologies and the CUDA plugin (Triton, then ptxas) for GPUs described
by target configs, all with JAX_PLATFORMS=cpu. The grid: every kernel, in its variant for the
target's platform, over a pairwise covering array of head_dim {64, 128, 256} x query heads per kv
head {1, 3, 4, 7, 8} x block_size {8 .. 128} x dtype {bf16, f32} x the engine's bucket shapes.
Needs the [aot] extra (`make test` installs it); without it these tests skip, saying why; with it
installed, a target that cannot be described is a failure.
"""

import itertools
import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import pytest  # noqa: E402

from pagedjax import aot  # noqa: E402
from pagedjax.pallas import common  # noqa: E402
from pagedjax.pallas.ragged_paged_attention import ragged_paged_attention_gpu  # noqa: E402

pytestmark = pytest.mark.aot

KERNEL_TARGETS = ["tpu-v4", "tpu-v5e", "tpu-v5p", "tpu-v6e", "h100", "a100"]
STEP_TARGETS = ["tpu-v5e", "tpu-v6e", "h100"]
MODELS = aot.model_shapes()
# (T tokens, S seats, P block-table columns): a decode step of 32 sequences, and a mixed step of
# 512 tokens (prefill chunks beside decodes), both over 512-token tables of 16-token blocks
BUCKETS = {"decode": (32, 32, 32), "mixed": (512, 32, 32)}


def require(target):
    """Skip where the [aot] extra is not installed; fail where it is and still cannot compile."""
    why = aot.available(target)
    if why is None:
        return
    if aot.installed(aot.get_target(target).platform):
        pytest.fail(why)
    pytest.skip(why)


def test_grid_covers_every_pair():
    rows = aot.pairwise(aot.KERNEL_FACTORS)
    names = list(aot.KERNEL_FACTORS)
    for a, b in itertools.combinations(names, 2):
        seen = {(r[a], r[b]) for r in rows}
        missing = set(itertools.product(aot.KERNEL_FACTORS[a], aot.KERNEL_FACTORS[b])) - seen
        assert not missing, f"{a} x {b}: {sorted(missing)} never meet"
    # block_size (5) x group (5) needs 25 rows at least; the greedy array needs no more
    assert len(rows) == 25
    kernels = {k for k, _ in aot.kernel_cases()}
    assert kernels == set(aot.KERNELS)


@pytest.mark.parametrize("target", KERNEL_TARGETS)
def test_kernel_grid_compiles(target):
    require(target)
    failures = []
    for kernel, case in aot.kernel_cases():
        try:
            aot.compile_kernel(target, kernel, case)
        except Exception as e:  # the compiler's own error, first line
            failures.append(f"{kernel} {case}: {str(e).strip().splitlines()[0][:300]}")
    assert not failures, f"{len(failures)} of {len(aot.kernel_cases())} failed on {target}:\n" + "\n".join(failures)


def test_h100_ragged_f32_block_128():
    # The case that first failed on an H100/H200: f32 pools, head_dim 128, block_size 128, 8 query
    # heads over 1 kv head, T=40, S=5. With the old fixed tiling (128-token steps, two pipeline
    # stages) Triton asks for 262,144 bytes of shared memory where 232,448 exist; tiled for the
    # H100's limits it compiles.
    require("h100")
    S = jax.ShapeDtypeStruct
    f32, i32 = jnp.float32, jnp.int32
    pool = S((1, 37, 128, 128), f32)
    args = (S((40, 8, 128), f32), pool, pool, S((5, 5), i32), S((5,), i32), S((6,), i32), S((), i32))
    limits = aot.get_target("h100").limits
    prog = aot.compile(lambda *a: ragged_paged_attention_gpu(*a, limits=limits), *args, target="h100")
    assert prog.memory["argument_bytes"] > 0 and prog.cost["flops"] > 0
    with pytest.raises(Exception, match=r"Shared memory size limit exceeded: requested 262144"):
        aot.compile(lambda *a: ragged_paged_attention_gpu(*a, limits=limits, tokens_per_step=128),
                    *args, target="h100")


@pytest.mark.parametrize("bucket", list(BUCKETS))
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("target", STEP_TARGETS)
def test_engine_step_compiles(target, model, bucket):
    require(target)
    cfg = MODELS[model]
    T, S, P = BUCKETS[bucket]
    kw = dict(num_tokens=T, num_seqs=S, pages=P, num_blocks=S * P + 1, block_size=16,
              dtype=jnp.bfloat16, with_costs=False)
    if model == "llama-3-8b" and target == "tpu-v5e":
        # 16 GB of bf16 weights do not fit one v5e's 16 GB of HBM: XLA says so at compile time.
        # (test_tensor_parallel_step_compiles runs it over 4 chips.)
        with pytest.raises(Exception, match=r"Ran out of memory on HBM"):
            aot.compile_engine_step(target, cfg, **kw)
        return
    step = aot.compile_engine_step(target, cfg, **kw)
    mem = step.program.memory
    # the pool is donated: its buffers come back as the new pool, not as a copy
    assert mem["alias_bytes"] >= step.kv_pool_bytes
    assert mem["argument_bytes"] >= step.weight_bytes + step.kv_pool_bytes
    assert step.flops > 2 * T * (step.weight_bytes / 2) / cfg.num_layers  # at least one layer's matmuls


@pytest.mark.parametrize("target", ["tpu-v5e", "h100"])
def test_tensor_parallel_step_compiles(target):
    # tensor_parallel_size=4: heads and MLP columns split over a v5e:2x2 slice's 4 chips, or over 4
    # H100s described as one host's GPUs, the Pallas kernel under shard_map per device.
    require(target)
    cfg = MODELS["llama-3-8b"]
    step = aot.compile_engine_step(target, cfg, num_tokens=32, num_seqs=32, pages=32, num_blocks=1025,
                                   block_size=16, dtype=jnp.bfloat16, tensor_parallel_size=4,
                                   with_costs=False)
    # each device holds a quarter of the split weights (embedding and head replicated) and of the pool
    replicated = 2 * cfg.vocab_size * cfg.hidden_size * 2
    assert step.weight_bytes < replicated + (16.1e9 - replicated) / 4 + 1e8
    assert step.kv_pool_bytes * 4 == 2 * cfg.num_layers * cfg.num_kv_heads * 1025 * 16 * cfg.head_dim * 2
    assert step.program.memory["argument_bytes"] < 8e9  # it fits a 16 GB v5e per device


def test_costs_count_every_layer():
    # XLA counts a loop body once; compile_engine_step extrapolates from 0 and 1 layers. A decode
    # step's flops must then be about 2 x (matmul weights) x tokens, whatever the depth.
    require("tpu-v5e")
    cfg = MODELS["smollm2-135m"]
    step = aot.compile_engine_step("tpu-v5e", cfg, num_tokens=8, num_seqs=8, pages=8, num_blocks=65,
                                   block_size=16, dtype=jnp.bfloat16)
    matmul_params = cfg.num_layers * (cfg.hidden_size * (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
                                      + cfg.num_heads * cfg.head_dim * cfg.hidden_size
                                      + 3 * cfg.hidden_size * cfg.intermediate_size) \
        + cfg.vocab_size * cfg.hidden_size
    assert 0.9 < step.flops / (2 * 8 * matmul_params) < 1.5


def test_gpu_cost_counts_an_in_place_scatter_as_its_whole_operand():
    # What compile_engine_step corrects on GPU targets: XLA's generic HLO cost analysis counts a
    # donated (in-place) scatter of 32 rows into an 8 MB pool as reading and writing all 8 MB;
    # XLA:TPU's own cost analysis counts the rows.
    require("h100")
    require("tpu-v6e")
    S = jax.ShapeDtypeStruct
    pool, rows, idx = S((4096, 8, 128), jnp.bfloat16), S((32, 128), jnp.bfloat16), S((32,), jnp.int32)
    scatter = jax.jit(lambda p, r, i: p.at[i, 0, :].set(r, mode="drop"), donate_argnums=0)
    pool_bytes, row_bytes = 4096 * 8 * 128 * 2, 32 * 128 * 2
    gpu = aot.compile(scatter, pool, rows, idx, target="h100")
    assert gpu.memory["alias_bytes"] == pool_bytes  # in place
    assert gpu.cost["bytes_accessed"] == 2 * pool_bytes + row_bytes + 32 * 4
    assert gpu.cost["bytes_accessed"] - aot.scatter_correction(pool_bytes, row_bytes) == 2 * row_bytes + 32 * 4
    tpu = aot.compile(scatter, pool, rows, idx, target="tpu-v6e")
    assert tpu.cost["bytes_accessed"] < 40 * row_bytes


# ---------------------------------------------------------------------------------------------
# refused when the engine is built, naming the limit (no compiler needed)
# ---------------------------------------------------------------------------------------------


def test_every_accepted_configuration_passes_the_build_check():
    for t, d, g, bs, dtype in itertools.product(aot.TARGETS.values(), (64, 128, 256), (1, 3, 4, 7, 8),
                                                common.KERNEL_BLOCK_SIZES, ("bfloat16", "float32")):
        common.check_supported(head_dim=d, num_heads=2 * g, num_kv_heads=2, block_size=bs, dtype=dtype,
                               limits=t.limits)


def test_refusals_name_the_limit_and_the_nearest_choice():
    h100 = aot.get_target("h100").limits
    with pytest.raises(ValueError, match=r"head_dim \(96\) must be a power of two.*nearest valid head_dim is 64"):
        common.check_supported(head_dim=96, num_heads=8, num_kv_heads=2, block_size=16, dtype="bfloat16",
                               limits=h100)
    with pytest.raises(ValueError, match=r"block_size \(12\) must be one of \(8, 16, 32, 64, 128\).*nearest: 8"):
        common.check_supported(head_dim=64, num_heads=8, num_kv_heads=2, block_size=12, dtype="bfloat16",
                               limits=h100)
    # a GPU with 64 KiB per block (sm_75) cannot hold f32 tiles of head_dim 256 for a group of 16
    small = common.DeviceLimits("gpu", "sm_75", shared_memory_per_block=65536, core_count=40)
    with pytest.raises(ValueError, match=r"need \d+ bytes of shared memory.*allows 65536.*bfloat16"):
        common.check_supported(head_dim=256, num_heads=16, num_kv_heads=1, block_size=16, dtype="float32",
                               limits=small)
    # a TPU's VMEM: head_dim 32768 would need more than 16 MiB per program
    with pytest.raises(ValueError, match=r"bytes of VMEM per program exceed the 16777216"):
        common.check_supported(head_dim=32768, num_heads=8, num_kv_heads=1, block_size=128, dtype="float32",
                               limits=aot.get_target("tpu-v5e").limits)


def test_unknown_target_lists_the_targets():
    with pytest.raises(ValueError, match=r"unknown target 'b200'.*tpu-v5e.*h100"):
        aot.get_target("b200")
