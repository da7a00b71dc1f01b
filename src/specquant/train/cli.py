"""`specquant distill SUBCOMMAND`: one entry per distillation in SUBCOMMANDS, all sharing TrainConfig's flags.

Adding one (e.g. `draft`): write add_<name>(parser) and run_<name>(args), call add_train_flags(parser) in the
former and train_config_from_args(args) in the latter, and add `"<name>": (add_<name>, run_<name>)` below.
"""

from __future__ import annotations

import argparse
import json

from specquant.errors import SpecquantError
from specquant.util.flags import add_config_flags, config_from_args
from specquant.train.config import LeanConfig, QADConfig, TrainConfig
from specquant.train.outdir import OUR_OUTPUTS

def add_train_flags(p: argparse.ArgumentParser, **defaults):
    """Every TrainConfig field as a flag (defaults from the dataclass, or `defaults` for this subcommand)."""
    add_config_flags(p, TrainConfig)
    if defaults:
        p.set_defaults(**defaults)
    p.add_argument("--out", required=True, help="output directory: model/ (best held-out step), checkpoints/, "
                                                 "log.jsonl")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--overwrite", action="store_true",
                   help=f"start over in a non-empty --out (removes only {', '.join(OUR_OUTPUTS)} there)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (under torchrun: cuda:LOCAL_RANK)")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"),
                   help="training dtype of the models (default: float32)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")


def train_config_from_args(args) -> TrainConfig:
    return config_from_args(TrainConfig, args).validate()


# --- distill target -------------------------------------------------------------------------------------------


def add_target(p: argparse.ArgumentParser):
    p.add_argument("--teacher", required=True, help="high-precision checkpoint or bundled name (tiny-target)")
    p.add_argument("--student", required=True, help="its W4 checkpoint from `specquant quantize`")
    p.add_argument("--data", default=None, help="training text (.txt) or `specquant regen` output (.jsonl); "
                                                 "default: the bundled calibration text")
    add_config_flags(p, QADConfig)
    add_config_flags(p, LeanConfig)
    add_train_flags(p)


def run_target(args) -> int:
    from specquant.train.lean_qad import run_lean_qad
    from specquant.train.qad import run_qad

    common = dict(teacher=args.teacher, student=args.student, data=args.data, out=args.out,
                  train=train_config_from_args(args), qad=config_from_args(QADConfig, args).validate(),
                  resume=args.resume, overwrite=args.overwrite, device=args.device, dtype=args.dtype,
                  progress=args.progress and not args.json)
    lean = config_from_args(LeanConfig, args).validate()
    result = run_lean_qad(**common, lean=lean) if lean.lean else run_qad(**common)
    if result is None:  # not rank 0
        return 0
    if args.json:
        print(json.dumps(result, default=float))
    else:
        first, best = result["start_eval"], result["best_eval"]
        where = "after every block" if result.get("mode") == "lean" else f"best step {result['best']['step']}"
        print(f"held-out KL(teacher || student): step 0 {first['kl']:.5f} -> {where} "
              f"{best['kl']:.5f} (± {best['kl_sem']:.5f}); ppl {first['ppl']:.2f} -> {best['ppl']:.2f} "
              f"(teacher {best['ppl_ref']:.2f}); top-1 {first['top1_agree']:.2%} -> {best['top1_agree']:.2%}")
        print(f"model: {result['model']}  log: {result['log']}  ({_per_step(result['seconds_per_step'])}, "
              f"{result['optimizer']})")
    return 0


def _per_step(seconds: float | None) -> str:
    """A resumed run that had no step left to train has no step time."""
    return "no step trained in this call" if seconds is None else f"{seconds:.2f} s/step"


def add_draft(p: argparse.ArgumentParser):
    from specquant.train.block_draft import BlockDraftTrainConfig
    from specquant.model.mtp import HEADS as MTP_HEADS
    from specquant.train.draft import KINDS, DraftConfig

    p.add_argument("--kind", required=True, choices=KINDS,
                   help="block: DFlash-style block drafter; lm: small LM; mtp: Qwen3.5's MTP layer")
    p.add_argument("--target", required=True, help="the target to draft for (stage 2's when --stage1-target is set)")
    p.add_argument("--stage1-target", default=None, help="train stage 1 against this (high-precision) target first")
    p.add_argument("--data", default=None, help="training text (.txt) or `specquant regen` output (.jsonl); "
                                                 "default: the bundled calibration text")
    add_config_flags(p, DraftConfig)
    add_config_flags(p, BlockDraftTrainConfig)
    p.add_argument("--mtp-into-target", default=None, metavar="DIR",
                   help="mtp: also write the trained mtp.* tensors into a copy of --target at DIR (for --draft mtp)")
    p.add_argument("--mtp-w4", default=None, metavar="DIR",
                   help="mtp: also write a W4 (RTN) copy of the trained MTP drafter at DIR")
    p.add_argument("--mtp-w4-group", type=int, default=32, choices=(32, 64, 128, -1),
                   help="mtp: input channels per scale of the --mtp-w4 copy (-1: per output channel)")
    p.add_argument("--mtp-head", default="shared", choices=MTP_HEADS,
                   help="mtp: the head the --mtp-w4 copy drafts through: the target's own lm_head (shared) or a "
                        "copy of it at this precision")
    add_train_flags(p, lr=1e-3, warmup=20, min_lr_ratio=0.1)


def run_draft(args) -> int:
    from specquant.train.block_draft import BlockDraftTrainConfig
    from specquant.train.draft import DraftConfig, run_draft as run

    if (args.mtp_into_target or args.mtp_w4) and args.kind != "mtp":
        raise SpecquantError(f"--mtp-into-target / --mtp-w4 write an MTP layer; they need --kind mtp, not {args.kind}")
    result = run(args.kind, args.target, args.out, train_config_from_args(args),
                 config_from_args(DraftConfig, args), config_from_args(BlockDraftTrainConfig, args).validate(),
                 data=args.data, stage1_target=args.stage1_target, resume=args.resume, overwrite=args.overwrite,
                 device=args.device, dtype=args.dtype, progress=args.progress and not args.json)
    if result is None:
        return 0
    if args.mtp_into_target:
        from specquant.train.mtp import write_into_target

        result["target_with_mtp"] = str(write_into_target(result["model"], args.target, args.mtp_into_target,
                                                          overwrite=args.overwrite))
    if args.mtp_w4:
        from specquant.drafter_loader import write_w4_mtp

        write_w4_mtp(result["model"], args.mtp_w4, group_size=args.mtp_w4_group, head=args.mtp_head,
                     overwrite=args.overwrite)
        result["w4_model"] = args.mtp_w4
    if args.json:
        print(json.dumps(result, default=float))
    else:
        for st in result["stages"]:
            print(f"{st['stage']}: target {st['target']}; best step {st['best']['step']} "
                  f"({_per_step(st['seconds_per_step'])}) -> {st['model']}")
            if st["best_eval"]:
                print("  held-out: " + ", ".join(f"{k} {v:.4f}" for k, v in st["best_eval"].items()
                                                 if isinstance(v, float)))
        if "target_with_mtp" in result:
            print(f"target with the trained mtp.* tensors: {result['target_with_mtp']}")
        if "w4_model" in result:
            print(f"W4 MTP drafter: {result['w4_model']}")
    return 0


# --- distill prune-head ---------------------------------------------------------------------------------------
# Here rather than on export or quantize: it derives a drafter checkpoint from text statistics (the regen text or a
# file, distill's --data), as `distill draft` derives one by training; quantize and export change no vocabulary.


def add_prune_head(p: argparse.ArgumentParser):
    p.add_argument("--draft", required=True, help="draft checkpoint (block or LM) or bundled name")
    p.add_argument("--keep", type=int, required=True, help="token ids the draft head keeps (the most frequent)")
    p.add_argument("--data", default=None, help="text (.txt) or `specquant regen` output (.jsonl) to count on; "
                                                 "default: the bundled calibration text")
    p.add_argument("--tokenizer", default=None, help="checkpoint whose tokenizer reads --data (default: the "
                                                      "draft's own; a block drafter has none: pass its target)")
    p.add_argument("--out", required=True, help="output directory: the draft checkpoint with the map in its "
                                                 "config.json")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty --out")
    p.add_argument("--json", action="store_true", help="print one JSON object with the result")


def run_prune_head(args) -> int:
    from specquant.train.prune_head import build_token_map, write_pruned_checkpoint
    from specquant.util.files import check_out_dir

    check_out_dir(args.out, args.overwrite)
    ids, summary = build_token_map(args.draft, args.keep, args.data, args.tokenizer)
    out = write_pruned_checkpoint(args.draft, args.out, ids, summary["data"], args.overwrite)
    result = {**summary, "out": str(out)}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"kept {result['kept']} of {result['vocab_size']} ids, covering {result['coverage']:.2%} of "
              f"{result['tokens_counted']} tokens of {result['data']} -> {out}")
    return 0


SUBCOMMANDS = {
    "target": (add_target, run_target, "quantization-aware distillation of a W4 target toward its "
                                       "high-precision self, on the frozen grid"),
    "draft": (add_draft, run_draft, "train a drafter (block or lm) against a target, in one or two stages"),
    "prune-head": (add_prune_head, run_prune_head, "a drafter whose head keeps the N most frequent token ids "
                                                   "(lossless: the target verifies over the full vocabulary)"),
}


def add_parser(subparsers):
    p = subparsers.add_parser("distill", help="distillation: `target` (QAD of the W4 target)",
                              description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="distill_kind", required=True)
    for name, (add, _, text) in SUBCOMMANDS.items():
        add(sub.add_parser(name, help=text, description=text))
    return p


def run(args) -> int:
    return SUBCOMMANDS[args.distill_kind][1](args)
