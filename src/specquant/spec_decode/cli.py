"""`specquant generate`: prompt in, text out; target-only or speculative with a draft model."""

from __future__ import annotations

import torch

from specquant.decode.aot import AotConfig
from specquant.decode.compiled import Stepper
from specquant.spec_decode.engine import generate
from specquant.decode.sampling import SamplingConfig
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer, resolve
from specquant.quant.config import DRAFT_W4_ACTIVATIONS, W4_ACTIVATIONS
from specquant.spec_decode.config import SpecConfig
from specquant.util.device import DEVICES, check_device
from specquant.util.dtypes import DTYPES
from specquant.util.flags import add_config_flags, config_from_args, print_json

DEFAULT_PROMPT = "The meaning of the word"


def add_parser(sub):
    p = sub.add_parser("generate", help="generate text (speculative when a draft is given)")
    p.add_argument("--target", default="tiny-target", help="checkpoint directory or bundled name (default: tiny-target)")
    p.add_argument("--draft", default=None,
                   help="draft checkpoint or bundled name, or 'none' (default: tiny-draft for the bundled target)")
    p.add_argument("--prompt", default=DEFAULT_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=64)
    add_config_flags(p, SamplingConfig)
    add_config_flags(p, SpecConfig)
    p.add_argument("--dtype", choices=list(DTYPES), default="float32")
    p.add_argument("--device", choices=DEVICES, default="cpu")
    p.add_argument("--w4-activations", choices=W4_ACTIVATIONS, default="float",
                   help="a W4 target's activations: float (W4A16, as the checkpoint) or int8 (W4A8, GGUF's "
                        "Q4_0 x Q8_0 on the native VNNI kernel: cheaper verify steps, slightly lower quality)")
    p.add_argument("--draft-w4-activations", choices=DRAFT_W4_ACTIVATIONS, default="auto",
                   help="a W4 drafter's activations: auto (int8 where the W4A8 kernel runs: a drafter only "
                        "proposes, so only acceptance can change), float or int8")
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode / verify steps (graphs cached on disk under "
                        "$SPECQUANT_CACHE/compile). Off by default: on CPU it pays only past ~2000 new tokens per "
                        "process with a warm cache, more with a cold one (docs/SHAPES.md)")
    add_config_flags(p, AotConfig)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def pick_draft(target: str, draft: str | None) -> str | None:
    if draft is None:
        return "tiny-draft" if target == "tiny-target" else None
    return None if draft.lower() == "none" else draft


def run(args):
    check_device(args.device)
    sampling = config_from_args(SamplingConfig, args).validate()
    draft_name = pick_draft(args.target, args.draft)
    resolve(args.target)
    if draft_name is not None:
        resolve(draft_name)
    tokenizer = load_tokenizer(args.target)
    ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    prompt = torch.tensor([ids], device=args.device)
    target = load_model(args.target, args.dtype, args.device, fuse=True, w4_activations=args.w4_activations)
    aot = config_from_args(AotConfig, args).aot
    if args.compile and aot == "build":
        raise SpecquantError("--compile and --aot build are two ways to compile the same step; pick one")
    aot = "off" if args.compile else aot  # --compile: torch.compile's steps instead of packages
    if draft_name is None:
        result = generate(Stepper(target, compile=args.compile, aot=aot), prompt, args.max_new_tokens, sampling,
                          stop_on_eos=not args.ignore_eos)
    else:
        from specquant.spec_decode.engine import SpecEngine

        from specquant.drafter_loader import drafter_kind, load_block_draft

        spec = config_from_args(SpecConfig, args).validate()
        if drafter_kind(draft_name) == "block":  # read from its config.json (DFlashDraftModel), not its name
            from specquant.spec_decode.drafters.block import BlockDrafter

            drafter = BlockDrafter(load_block_draft(draft_name, args.dtype, args.device,
                                                    args.draft_w4_activations), target, spec)
            engine = SpecEngine(target, drafter, spec, compile=args.compile, aot=aot)
        else:
            draft = load_model(draft_name, args.dtype, args.device, fuse=True,
                               w4_activations=args.draft_w4_activations)
            engine = SpecEngine(target, draft, spec, tokenizer, load_tokenizer(draft_name), compile=args.compile,
                                aot=aot)
        result = engine.generate(prompt, args.max_new_tokens, sampling, stop_on_eos=not args.ignore_eos)
    new = result.token_ids[0]
    text = tokenizer.decode(new, skip_special_tokens=True)
    if args.json:
        print_json({"text": text, "token_ids": new, "stats": result.stats})
    else:
        print(args.prompt + text)
        s = result.stats
        line = (f"[{s['new_tokens']} tokens, ttft {s['prefill_s'] * 1e3:.1f} ms, tpot {s['tpot_s'] * 1e3:.1f} ms, "
                f"{s['tokens_per_s']:.1f} tok/s")
        if "mean_acceptance_length" in s:
            line += f", mean acceptance length {s['mean_acceptance_length']:.2f}"
        print(line + "]")
    return 0
