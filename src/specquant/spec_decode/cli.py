"""`specquant generate`: prompt in, text out; target-only or speculative with a draft (any drafter kind)."""

from __future__ import annotations

import torch

from specquant.decode.sampling import SamplingConfig
from specquant.model.checkpoint import load_tokenizer, resolve
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.runtime import RuntimeConfig
from specquant.spec_decode.drafters import KINDS, DrafterOptions
from specquant.util.device import check_device
from specquant.util.flags import add_config_flags, config_from_args, print_json

DEFAULT_PROMPT = "The meaning of the word"
# generate's share of RuntimeConfig (no --threads); packaged steps are used when on disk (decode.aot.AotConfig)
RUNTIME_FLAGS = {name: {} for name in ("dtype", "device", "w4_activations", "draft_w4_activations", "compile", "aot")}
RUNTIME_DEFAULTS = RuntimeConfig(aot="cached")


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text (speculative when a draft is given)")
    p.add_argument("--target", default="tiny-target", help="checkpoint directory or bundled name (default: tiny-target)")
    kinds = ", ".join(name for name, kind in KINDS.items() if not kind.needs_checkpoint)
    p.add_argument("--draft", default=None,
                   help=f"draft checkpoint or bundled name (its kind read from config.json), or the name of a "
                        f"drafter kind without a checkpoint ({kinds}), or suffix+DRAFT (the hybrid drafter: the "
                        "suffix draft on a long enough match, else DRAFT's); none = target only (default: tiny-draft "
                        "for the bundled target). suffix / hybrid draft up to --suffix-max-draft-len on suffix "
                        "steps, whatever --draft-len")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_config_flags(p, SamplingConfig)
    add_config_flags(p, SpecConfig)
    add_config_flags(p, DrafterOptions)  # each kind's settings, dests "KIND.field" (apart from SpecConfig's)
    add_config_flags(p, RuntimeConfig, defaults=RUNTIME_DEFAULTS, fields=RUNTIME_FLAGS)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def pick_draft(target: str, draft: str | None) -> str | None:
    """The bundled target drafts with the bundled draft unless told otherwise."""
    if draft is None:
        return "tiny-draft" if target == "tiny-target" else None
    return draft


def run(args):
    check_device(args.device)
    sampling = config_from_args(SamplingConfig, args).validate()
    runtime = config_from_args(RuntimeConfig, args).validate()
    spec = config_from_args(SpecConfig, args).validate()
    resolve(args.target)
    tokenizer = load_tokenizer(args.target)
    options = config_from_args(DrafterOptions, args).validate()
    engine = build_engine(args.target, pick_draft(args.target, args.draft), runtime, spec,
                          target_tokenizer=tokenizer, draft_options=options)
    ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    prompt = torch.tensor([ids], device=args.device)
    result = engine.generate(prompt, args.max_new_tokens, sampling, stop_on_eos=not args.ignore_eos)
    new = result.token_ids[0]
    text = tokenizer.decode(new, skip_special_tokens=True)
    choices = getattr(engine.drafter, "choices", None)  # the hybrid drafter: steps per source
    if args.json:
        extra = {"drafted_by": {src: m.to_dict() for src, m in choices.items()}} if choices else {}
        print_json({"text": text, "token_ids": new, "stats": result.stats, **extra})
    else:
        print(args.prompt + text)
        s = result.stats
        line = (f"[{s['new_tokens']} tokens, ttft {s['prefill_s'] * 1e3:.1f} ms, tpot {s['tpot_s'] * 1e3:.1f} ms, "
                f"{s['tokens_per_s']:.1f} tok/s")
        if "mean_acceptance_length" in s:
            line += f", mean acceptance length {s['mean_acceptance_length']:.2f}"
        if choices:
            line += ", steps drafted by " + ", ".join(f"{src} {m.num_drafts}" for src, m in choices.items())
        print(line + "]")
    return 0
