"""The Llama-family model (pure functions over a stacked params pytree) and its weight loaders."""

from pagedjax.model.llama import (
    AttentionMetadata,
    ModelConfig,
    RopeScaling,
    compute_logits,
    forward,
    init_kv_cache,
    init_random_params,
    reference_attention,
)
from pagedjax.model.weights import load_model

__all__ = [
    "AttentionMetadata", "ModelConfig", "RopeScaling", "compute_logits", "forward", "init_kv_cache",
    "init_random_params", "load_model", "reference_attention",
]
