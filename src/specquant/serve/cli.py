"""`specquant serve`: an OpenAI-compatible server over one engine (the target, its drafter and runtime flags as
`specquant generate` takes them)."""

from __future__ import annotations

import logging

from specquant.errors import SpecquantError
from specquant.model.checkpoint import load_tokenizer, resolve
from specquant.serve.config import ServeConfig
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.cli import RUNTIME_DEFAULTS, pick_draft
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.spec_decode.drafters import KINDS, DrafterOptions, serving_options
from specquant.util.device import check_device
from specquant.util.flags import add_config_flags, config_from_args

# serve's share of RuntimeConfig: generate's, plus --threads (a server owns its process)
RUNTIME_FLAGS = {name: {} for name in ("dtype", "device", "w4_activations", "draft_w4_activations", "compile", "aot",
                                       "threads")}


def add_parser(sub):
    p = sub.add_parser("serve", help="serve a target (and its drafter) over an OpenAI-compatible HTTP API")
    p.add_argument("--target", default="tiny-target",
                   help="checkpoint directory or bundled name (default: tiny-target)")
    kinds = ", ".join(name for name, kind in KINDS.items() if not kind.needs_checkpoint)
    p.add_argument("--draft", default=None,
                   help=f"draft checkpoint or bundled name, or a drafter kind without a checkpoint ({kinds}); none = "
                        "target only (default: tiny-draft for the bundled target); suffix / suffix+DRAFT keep a "
                        "response cache of earlier requests (--suffix-cache-tokens, 0 = off)")
    add_config_flags(p, ServeConfig)
    add_config_flags(p, SpecConfig)
    add_config_flags(p, DrafterOptions, defaults=serving_options())  # each kind's settings as a server has them
    add_config_flags(p, RuntimeConfig, defaults=RUNTIME_DEFAULTS, fields=RUNTIME_FLAGS)


def build_app(args):
    """The app `run` serves (tests build it the same way)."""
    try:
        from specquant.serve.app import create_app  # FastAPI only for this verb
    except ModuleNotFoundError as e:
        raise SpecquantError(f"specquant serve needs {e.name}; pip install 'specquant[serve]'") from None

    config = config_from_args(ServeConfig, args).validate()
    runtime = config_from_args(RuntimeConfig, args).validate()
    spec = config_from_args(SpecConfig, args).validate()
    options = config_from_args(DrafterOptions, args).validate()
    check_device(runtime.device)
    path = resolve(args.target)
    tokenizer = load_tokenizer(args.target)
    engine = build_engine(args.target, pick_draft(args.target, args.draft), runtime, spec, target_tokenizer=tokenizer,
                          draft_options=options)
    return create_app(engine, tokenizer, config, config.model_name or path.name, threads=runtime.threads), config


def run(args):
    app, config = build_app(args)
    import uvicorn  # present once build_app imported FastAPI: the serve extra brings both

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    uvicorn.run(app, host=config.host, port=config.port, log_level="info",
                timeout_graceful_shutdown=config.shutdown_timeout_s)
    return 0
