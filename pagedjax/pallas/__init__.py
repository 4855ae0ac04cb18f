"""Paged attention: Pallas kernels (GPU- and TPU-style) and the pure-jnp references they are tested against."""

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
]
