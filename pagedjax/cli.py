"""The `pagedjax` command.

    pagedjax serve MODEL [--host 0.0.0.0] [--port 8000] [engine arguments]

The engine arguments are EngineConfig's knobs under vLLM's flag names (`--max-model-len`,
`--max-num-seqs`, `--block-size`, `--enable-prefix-caching` / `--no-enable-prefix-caching`,
`--scheduling static`, `--allocation contiguous`, ...), `--dtype`, `--max-logprobs`, the model's
source (`--revision`, `--download-dir`, `--tokenizer`), and vLLM's flags that have no effect here
(`--enforce-eager`, `--trust-remote-code`, ...; accepted with one warning).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import typing

from pagedjax.config import EngineConfig
from pagedjax.engine_args import NO_EFFECT, SOURCE_ARGS

_BOOL_NO_EFFECT = {"enforce_eager", "trust_remote_code", "disable_log_stats", "disable_custom_all_reduce",
                   "enable_sleep_mode", "calculate_kv_scales", "disable_async_output_proc", "use_tqdm_on_load"}


_SERVER_ARGS = {"served_model_name"}   # the server's own, not the engine's


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """EngineConfig's fields as flags, typed from their annotations."""
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "extra":
            continue
        hint = hints[f.name]
        args = typing.get_args(hint)
        if hint is bool:
            parser.add_argument(_flag(f.name), action=argparse.BooleanOptionalAction, default=None)
        elif typing.get_origin(hint) is typing.Literal:
            parser.add_argument(_flag(f.name), choices=list(args), default=None)
        elif tuple[int, ...] in args or hint == tuple[int, ...]:
            parser.add_argument(_flag(f.name), type=int, nargs="+", default=None)
        else:
            kind = next((a for a in (int, float, str) if a is hint or a in args), str)
            parser.add_argument(_flag(f.name), type=kind, default=None)
    parser.add_argument("--dtype", default="auto", help="float32, bfloat16, float16 or auto (the checkpoint's)")
    parser.add_argument("--max-logprobs", type=int, default=20)
    for name in SOURCE_ARGS:
        parser.add_argument(_flag(name), default=None)
    for name in sorted(set(NO_EFFECT) - _SERVER_ARGS):
        if name in _BOOL_NO_EFFECT:
            parser.add_argument(_flag(name), action="store_true", default=None, help=argparse.SUPPRESS)
        else:
            parser.add_argument(_flag(name), default=None, help=argparse.SUPPRESS)


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The flags that were given, as LLMEngine keyword arguments."""
    names = [f.name for f in dataclasses.fields(EngineConfig) if f.name != "extra"]
    names += ["max_logprobs", *SOURCE_ARGS, *(set(NO_EFFECT) - _SERVER_ARGS)]
    kw = {n: getattr(args, n) for n in names if getattr(args, n, None) is not None}
    for n in ("token_buckets", "seq_buckets", "page_buckets"):
        if n in kw:
            kw[n] = tuple(kw[n])
    kw["dtype"] = args.dtype
    return kw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pagedjax", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (pagedjax.serve.api_server)")
    serve.add_argument("model", nargs="?", default="smollm2-135m")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model name clients send (default: MODEL)")
    serve.add_argument("--no-warmup", action="store_true", help="compile the step's shapes on first use, not at start")
    serve.add_argument("--log-level", default="info")
    add_engine_args(serve)
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")

    import uvicorn

    from pagedjax.engine import LLMEngine
    from pagedjax.serve.api_server import build_app
    from pagedjax.serve.async_llm import AsyncLLM

    engine = LLMEngine(args.model, **engine_kwargs(args))
    if not args.no_warmup:
        logging.getLogger("pagedjax").info("compiled every step shape in %.1f s", engine.warmup())
    app = build_app(AsyncLLM(engine), args.served_model_name or args.model)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(), timeout_graceful_shutdown=5)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
