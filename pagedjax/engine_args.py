"""vLLM's engine arguments, sorted: `LLM(model, **kwargs)` and `LLMEngine(model, **kwargs)` take
vLLM's names, so a script written for vLLM runs here as it is.

Each keyword is one of:
- an EngineConfig knob (pagedjax.config): max_model_len, max_num_seqs, block_size, ...;
- where the model comes from (pagedjax.model.hub): revision, download_dir, tokenizer, ...;
- checked: a value that describes what pagedjax does anyway is accepted in silence, any other is
  refused with ValueError (quantization="awq" cannot be ignored: it would load other weights);
- without effect here (NO_EFFECT): accepted, and named in one warning;
- none of these: TypeError, so that a misspelt knob is not silently dropped.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from typing import Any

from pagedjax.config import EngineConfig

logger = logging.getLogger(__name__)

# vLLM engine arguments accepted without effect: name -> why it has none here
NO_EFFECT: dict[str, str] = {
    "enforce_eager": "there are no CUDA graphs to skip: every step runs a jitted XLA program of its shape bucket "
                     "(LLM(..., enforce_eager=True) compiles each bucket when first needed instead of at start-up)",
    "max_seq_len_to_capture": "there are no CUDA graphs: token_buckets, seq_buckets and page_buckets set the "
                              "compiled shapes",
    "cuda_graph_sizes": "there are no CUDA graphs: token_buckets sets the compiled step sizes",
    "compilation_config": "steps are compiled by jax.jit, one program per shape bucket",
    "disable_custom_all_reduce": "tensor parallelism's collectives are XLA's own",
    "distributed_executor_backend": "one process drives every device (tensor_parallel_size)",
    "worker_cls": "one process drives every device; there are no workers",
    "trust_remote_code": "no model code is downloaded: the Llama-family model is pagedjax's own",
    "code_revision": "no model code is downloaded",
    "model_impl": "the Llama-family model is pagedjax's own",
    "hf_overrides": "the model's config.json is read as stored",
    "tokenizer_mode": "the tokenizer is transformers' AutoTokenizer (fast where one exists), as vLLM's 'auto'",
    "disable_log_stats": "the engine logs no periodic stats; the scheduler's metrics are kept either way",
    "swap_space": "host swap is sized in blocks by num_host_blocks and used with preemption_mode='swap'",
    "cpu_offload_gb": "the weights stay on the device",
    "disable_async_output_proc": "outputs are processed within the step that produced them",
    "served_model_name": "there is no server to report a model name",
    "generation_config": "sampling defaults are SamplingParams' own; generation_config.json is not read",
    "calculate_kv_scales": "the KV cache is stored in the model's dtype, unscaled",
    "enable_sleep_mode": "the engine does not release its device memory while idle",
    "use_tqdm_on_load": "loading shows no progress bar",
    "max_loras": "LoRA adapters are not supported",
    "max_lora_rank": "LoRA adapters are not supported",
    "limit_mm_per_prompt": "the models are text-only",
    "mm_processor_kwargs": "the models are text-only",
}

# vLLM engine arguments whose value is checked: name -> (values that describe what pagedjax does
# anyway, what the message says is possible)
CHECKED: dict[str, tuple[tuple[Any, ...], str]] = {
    "quantization": ((None, "gguf"), "None (the weights as stored; a quantized GGUF file is dequantized on "
                                     "load) or 'gguf'"),
    "load_format": (("auto", "safetensors", "gguf"), "'auto', 'safetensors' or 'gguf' (the loader reads "
                                                     "*.safetensors directories and .gguf files)"),
    "pipeline_parallel_size": ((1,), "1 (tensor_parallel_size splits a model over devices)"),
    "data_parallel_size": ((1,), "1 (one engine per process)"),
    "enable_lora": ((False,), "False (LoRA adapters are not supported)"),
    "speculative_config": ((None,), "None (no speculative decoding)"),
    "scheduling_policy": (("fcfs",), "'fcfs' (requests are scheduled first come, first served)"),
    "task": (("auto", "generate"), "'auto' or 'generate' (the engine generates text)"),
    "runner": (("auto", "generate"), "'auto' or 'generate' (the engine generates text)"),
    "skip_tokenizer_init": ((False,), "False (the engine detokenizes every output)"),
}

# vLLM's name -> ours, for a knob pagedjax has under another name
ALIASES: dict[str, str] = {
    "num_gpu_blocks_override": "num_blocks",   # both count the whole pool, the null block included
}

# where the model comes from: passed to pagedjax.model.hub.prepare_model
SOURCE_ARGS = ("revision", "download_dir", "tokenizer", "tokenizer_revision", "hf_token")

CONFIG_FIELDS = frozenset(f.name for f in dataclasses.fields(EngineConfig))


class EngineArgs:
    """vLLM's EngineArgs: a model and the engine's keyword arguments, for
    `LLMEngine.from_engine_args(EngineArgs(model=..., max_model_len=...))`. The arguments are
    checked when the engine is built from them."""

    def __init__(self, model: str = "smollm2-135m", **kwargs: Any):
        self.model = model
        self.kwargs = kwargs

    def __getattr__(self, name: str) -> Any:
        kwargs = self.__dict__.get("kwargs", {})
        if name in kwargs:
            return kwargs[name]
        raise AttributeError(f"EngineArgs has no argument {name!r}")

    def __repr__(self) -> str:
        return f"EngineArgs(model={self.model!r}, " + ", ".join(f"{k}={v!r}" for k, v in self.kwargs.items()) + ")"


def split_engine_kwargs(kwargs: dict[str, Any], owner: str = "LLMEngine") -> tuple[dict[str, Any], dict[str, Any]]:
    """Sort `kwargs` into (EngineConfig's, the model source's); refuse unknown names (TypeError)
    and checked ones of another value (ValueError); warn once, naming them all, about those
    without effect here."""
    known = CONFIG_FIELDS | set(SOURCE_ARGS) | set(NO_EFFECT) | set(CHECKED) | set(ALIASES)
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown:
        close = {k: m[0] for k in unknown if (m := difflib.get_close_matches(k, known, n=1))}
        hint = "; did you mean " + ", ".join(f"{m!r} for {k!r}" for k, m in close.items()) if close else ""
        raise TypeError(f"{owner} got unexpected keyword arguments {unknown}: not an EngineConfig field "
                        f"(pagedjax.config) nor an engine argument of vLLM's this engine knows{hint}")
    config: dict[str, Any] = {}
    source: dict[str, Any] = {}
    ignored = []
    for name, value in kwargs.items():
        if name in CONFIG_FIELDS:
            config[name] = value
        elif name in SOURCE_ARGS:
            source[name] = value
        elif name in ALIASES:
            ours = ALIASES[name]
            if ours in kwargs and value is not None and kwargs[ours] != value:
                raise ValueError(f"{name} ({value!r}) and {ours} ({kwargs[ours]!r}) name the same knob; pass one")
            if value is not None:
                config[ours] = value
        elif name in CHECKED:
            allowed, says = CHECKED[name]
            if not any(value == a and type(value) is type(a) for a in allowed):
                raise ValueError(f"{name} must be {says}, got {value!r}")
        else:
            ignored.append(name)
    if ignored:
        logger.warning("%s: these engine arguments have no effect here: %s", owner,
                       "; ".join(f"{name} ({NO_EFFECT[name]})" for name in sorted(ignored)))
    return config, source
