"""The Llama-family model (pure functions over a stacked params pytree) and its weight loaders."""

from pagedjax.attention import AttentionMetadata, init_kv_cache
from pagedjax.model.llama import (
    ModelConfig,
    RopeScaling,
    compute_logits,
    forward,
    init_random_params,
)
from pagedjax.model.weights import load_model

__all__ = [
    "AttentionMetadata", "ModelConfig", "RopeScaling", "compute_logits", "forward", "init_kv_cache",
    "init_random_params", "load_model",
]
