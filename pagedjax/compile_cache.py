"""JAX's persistent compilation cache, on by default: a second process compiles nothing it has
compiled before.

    enable_compilation_cache()   # LLMEngine calls it before its first compilation

Compiled programs are kept under `<pagedjax cache>/xla/<key>` (`$PAGEDJAX_CACHE`, else
`~/.cache/pagedjax`), where the key names the jax and jaxlib versions, the backend and the
machine (for a CPU: its architecture, model name and instruction-set flags): a program compiled by
another jax, or for another CPU, is never loaded. Every program is kept, however quickly it
compiled (jax's own default keeps only those that took a second or more).

Off with `PAGEDJAX_COMPILATION_CACHE=0`; a directory set by the user (`JAX_COMPILATION_CACHE_DIR`
or `jax.config.update("jax_compilation_cache_dir", ...)`) is left as it is.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
from pathlib import Path

logger = logging.getLogger(__name__)
_enabled: Path | None = None


def machine_key() -> str:
    """What a compiled program depends on besides its source: jax, jaxlib, backend, machine."""
    import jax
    import jaxlib

    backend = jax.default_backend()
    ident = platform.machine()
    if backend == "cpu":
        model = flags = ""
        try:
            for line in Path("/proc/cpuinfo").read_text().splitlines():
                if line.startswith("model name") and not model:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:
                    flags = line.split(":", 1)[1].strip()
        except OSError:
            model = platform.processor()
        ident += "|" + model + "|" + flags
    else:
        ident += "|" + "|".join(sorted({d.device_kind for d in jax.devices()}))
    digest = hashlib.sha256(ident.encode()).hexdigest()[:16]
    return f"jax-{jax.__version__}_jaxlib-{jaxlib.__version__}_{backend}_{digest}"


def enable_compilation_cache(directory: str | os.PathLike | None = None) -> Path | None:
    """Turn the persistent cache on (once per process); returns its directory, or None when it
    is off (`PAGEDJAX_COMPILATION_CACHE=0`) or the user chose a directory of their own."""
    global _enabled
    import jax

    if _enabled is not None:
        return _enabled
    if os.environ.get("PAGEDJAX_COMPILATION_CACHE", "1").lower() in ("0", "false", "no", "off"):
        return None
    if jax.config.jax_compilation_cache_dir:
        return None
    if directory is None:
        from pagedjax.model.hub import cache_dir

        directory = cache_dir() / "xla" / machine_key()
    path = Path(directory)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:   # a read-only home: run without the cache rather than fail
        logger.warning("compilation cache off: cannot create %s (%s)", path, e)
        return None
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    _enabled = path
    logger.info("persistent compilation cache: %s", path)
    return path
