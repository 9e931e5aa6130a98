"""`hf-paged serve MODEL_OR_PATH` (or `python -m hf_paged.entrypoints.serve MODEL_OR_PATH`):
load with transformers (and peft adapters: `--lora NAME=PATH`, each served as the model NAME),
build an Engine, serve the OpenAI API on 127.0.0.1:8000 by default."""

from __future__ import annotations

import argparse
import ast
import functools
import gc
import sys

from hf_paged import envs
from hf_paged.config import EngineConfig
from hf_paged.entrypoints.fronts import STREAM_INTERVAL_S

DTYPES = ("auto", "float32", "bfloat16", "float16")


def _engine_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        parsed = value  # a bare word: a string option (attention_backend=torch)
    return key.strip(), parsed


def _lora(text: str) -> tuple[str, str]:
    name, sep, path = text.partition("=")
    name, path = name.strip(), path.strip()
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    if name == "__base__":
        raise argparse.ArgumentTypeError("__base__ is peft's name for no adapter")
    return name, path


def add_model_arguments(p: argparse.ArgumentParser) -> None:
    """What loads the model (load()): shared by `hf-paged serve` and `hf-paged warmup`."""
    p.add_argument("model", help="a local folder or a hub id (AutoModelForCausalLM)")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder or id (default: model)")
    p.add_argument(
        "--lora",
        action="append",
        type=_lora,
        default=[],
        metavar="NAME=PATH",
        help="a peft LoRA adapter (folder or hub id) served as the model NAME; repeatable",
    )
    p.add_argument("--dtype", choices=DTYPES, default="auto")
    p.add_argument("--device-map", default=None, help="transformers' device_map (cuda, auto...)")
    p.add_argument(
        "--quantization",
        choices=("bnb-4bit", "bnb-8bit"),
        default=None,
        help="load with bitsandbytes",
    )


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """The Engine's options (model_engine_options()): shared by serve and warmup."""
    p.add_argument("--max-num-seqs", type=int, default=None, help="requests in one batch")
    p.add_argument("--max-model-len", type=int, default=None)
    add_engine_option(p)


def add_engine_option(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """--engine-option KEY=VALUE (repeatable): any Engine option, parsed as Python literals."""
    p.add_argument(
        "--engine-option",
        action="append",
        type=_engine_option,
        default=[],
        metavar="KEY=VALUE",
        help=help
        or "any Engine option (hf_paged.config.EngineConfig), e.g. num_blocks=4096, "
        "compile=False; repeatable",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="hf-paged serve",
        description=__doc__,
        epilog="`hf-paged warmup MODEL [same options]` fills the on-disk compile caches this "
        "command then starts from (docs/startup.md)",
    )
    add_model_arguments(p)
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to listen on every interface")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--api-key",
        default=envs.HF_PAGED_API_KEY,
        help="require `Authorization: Bearer KEY` on every route but /health "
        "(default: $HF_PAGED_API_KEY; none: no key)",
    )
    p.add_argument("--served-model-name", default=None, help="the `model` clients send")
    add_engine_arguments(p)
    p.add_argument(
        "--max-queued",
        type=int,
        default=1024,
        help="sequences waiting beyond max-num-seqs before requests get 429",
    )
    p.add_argument("--max-body-bytes", type=int, default=4 << 20)
    p.add_argument(
        "--stream-interval-ms",
        type=float,
        default=STREAM_INTERVAL_S * 1000,
        help="the engine hands tokens to the HTTP side at most once per this many ms per live "
        "stream (256 streams: every ~128 ms, many tokens per chunk); 0: after every step",
    )
    p.add_argument(
        "--engine-process",
        action="store_true",
        help="run the engine (scheduler, model, step loop) in a process of its own, which loads "
        "the model; this process serves HTTP, tokenizes and detokenizes, so neither takes the "
        "GIL from the other",
    )
    p.add_argument("--log-level", default="info")
    return p


def check_loras(args) -> None:
    names = [name for name, _ in args.lora]
    served = getattr(args, "served_model_name", None) or args.model
    if len(set(names)) != len(names):
        raise ValueError(f"--lora: each adapter needs a name of its own, got {names}")
    if served in names:
        raise ValueError(f"--lora: {served!r} is the base model's served name")


def engine_options(args) -> dict:
    """serve's Engine options, checked with the server's own (before minutes of loading)."""
    if not args.stream_interval_ms >= 0:
        raise ValueError(f"--stream-interval-ms: must be >= 0, got {args.stream_interval_ms}")
    return model_engine_options(args)


def model_engine_options(args) -> dict:
    """The Engine options of add_model_arguments / add_engine_arguments, checked."""
    check_loras(args)
    options = dict(args.engine_option)
    for key in ("max_num_seqs", "max_model_len"):
        if getattr(args, key) is not None:
            options[key] = getattr(args, key)
    EngineConfig.from_options(**options)  # bad options fail before minutes of loading
    return options


def load(args):
    import torch
    from transformers import AutoModelForCausalLM

    kwargs = {}
    if args.dtype != "auto":
        kwargs["dtype"] = getattr(torch, args.dtype)
    elif not torch.cuda.is_available():
        kwargs["dtype"] = torch.float32
    if args.device_map is not None:
        kwargs["device_map"] = args.device_map
    elif torch.cuda.is_available():
        kwargs["device_map"] = "cuda"
    if args.quantization is not None:
        from transformers import BitsAndBytesConfig

        four = args.quantization == "bnb-4bit"
        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_4bit=four, load_in_8bit=not four)
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs).eval()
    if args.lora:
        from peft import PeftModel

        (first, path), *rest = args.lora
        model = PeftModel.from_pretrained(model, path, adapter_name=first).eval()
        for name, path in rest:
            model.load_adapter(path, adapter_name=name)
    return model, load_tokenizer(args)


def load_tokenizer(args):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(args.tokenizer or args.model)


def build(args, options: dict):
    """The engine and the app the command serves (engine_options(args) checked first): an
    Engine, or with --engine-process an EngineProcess that loaded the model in its process
    (close() ends it; EngineStartError if it could not start)."""
    from hf_paged.entrypoints.api_server import build_app

    if getattr(args, "engine_process", False):
        from hf_paged.entrypoints.core_messages import EngineSpec
        from hf_paged.entrypoints.engine_client import EngineProcess

        engine = EngineProcess(
            EngineSpec(functools.partial(load, args), options),
            load_tokenizer(args),
            max_queued=args.max_queued,
        )
    else:
        from hf_paged.engine.engine import Engine

        model, tokenizer = load(args)
        engine = Engine(model, tokenizer, **options)
    try:
        app = build_app(
            engine,
            args.served_model_name or args.model,
            api_key=args.api_key,
            max_queued=args.max_queued,
            max_body_bytes=args.max_body_bytes,
            adapters={name: name for name, _ in args.lora},  # loaded under their served names
            stream_interval_s=args.stream_interval_ms / 1000,
        )
    except BaseException:
        if hasattr(engine, "close"):  # an engine process: it ends with the refusal
            engine.close()
        raise
    return engine, app


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["serve"]:  # `hf-paged serve MODEL`
        argv = argv[1:]
    args = build_parser().parse_args(argv)
    try:
        import uvicorn

        from hf_paged.entrypoints import api_server  # noqa: F401 (fastapi, prometheus_client)

        if args.lora:
            import peft  # noqa: F401
    except ImportError as exc:
        extras = "serve,peft" if args.lora else "serve"
        print(f"error: serving needs `pip install hf_paged[{extras}]` ({exc})", file=sys.stderr)
        return 2
    try:
        options = engine_options(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from hf_paged.entrypoints.engine_client import EngineProcess, EngineStartError

    try:
        engine, app = build(args, options)
    except (ValueError, EngineStartError) as exc:  # what the engine refuses, after loading
        print(f"error: {exc}", file=sys.stderr)
        return 2
    gc.freeze()  # the model's heap lives as long as the server: no collection scans it
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        if isinstance(engine, EngineProcess):
            engine.close()
        else:
            engine.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
