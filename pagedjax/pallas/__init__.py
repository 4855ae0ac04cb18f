"""Paged attention: Pallas kernels (GPU- and TPU-style) and the pure-jnp references they are tested
against, and the device limits the kernels are tiled for (pagedjax.pallas.common)."""

from pagedjax.pallas.common import (
    KERNEL_BLOCK_SIZES,
    DeviceLimits,
    check_supported,
    device_limits,
)
from pagedjax.pallas.paged_attention import contiguous_attention, paged_attention
from pagedjax.pallas.ragged_paged_attention import ragged_paged_attention
from pagedjax.pallas.reference import (
    contiguous_attention_reference,
    paged_attention_reference,
    ragged_paged_attention_reference,
)

__all__ = [
    "paged_attention",
    "ragged_paged_attention",
    "contiguous_attention",
    "paged_attention_reference",
    "ragged_paged_attention_reference",
    "contiguous_attention_reference",
    "DeviceLimits",
    "device_limits",
    "check_supported",
    "KERNEL_BLOCK_SIZES",
]
