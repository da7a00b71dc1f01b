"""`specquant quantize`: flags are generated from QuantConfig's fields, so defaults live only there."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.quant.config import METHOD_CONFIGS, METHODS, QuantConfig
from specquant.util.dtypes import DTYPES
from specquant.util.flags import add_config_flags, config_from_args


def quant_config(args: argparse.Namespace) -> QuantConfig:
    """The QuantConfig the flags describe: the chosen method's settings from its own --<method>-* flags."""
    method = config_from_args(METHOD_CONFIGS[args.method], args, prefix=f"{args.method}.")
    return config_from_args(QuantConfig, args, method=method)


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser("quantize", help="quantize a checkpoint's Linears to INT4/INT8 (compressed-tensors)",
                              description="Weight-only RTN / AWQ / GPTQ quantization to a compressed-tensors "
                                          "pack-quantized checkpoint that vLLM and transformers load.")
    p.add_argument("--model", required=True, help="checkpoint directory or bundled name (tiny-target, tiny-draft)")
    p.add_argument("--out", required=True, help="output directory (written atomically)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace --out even when it is a non-empty directory specquant did not create (its files "
                        "are deleted)")
    p.add_argument("--dtype", default=None, choices=list(DTYPES),
                   help="dtype of scales and dense weights in the output (default: the checkpoint's torch_dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--method", choices=METHODS, default=QuantConfig().method_name,
                   help=f"algorithm (default: {QuantConfig().method_name}); its settings: the --<method>-* flags")
    add_config_flags(p, QuantConfig)
    for name, settings in METHOD_CONFIGS.items():
        add_config_flags(p, settings, prefix=f"{name}.")
    p.set_defaults(func=run)
    return p


def _table(report: dict) -> str:
    lines = [f"{'layer':<36} {'shape':>11} {'W SQNR dB':>10} {'out SQNR dB':>12} {'out rel MSE':>12}"]
    for r in report["layers"]:
        shape = "x".join(str(v) for v in r["shape"])
        out = r.get("output_sqnr_db")
        rel = r.get("output_rel_mse")
        lines.append(f"{r['name']:<36} {shape:>11} {r['weight_sqnr_db']:>10.2f} "
                     f"{'-' if out is None else f'{out:.2f}':>12} {'-' if rel is None else f'{rel:.2e}':>12}")
    if report["method"] == "rtn" and all(r.get("output_sqnr_db") is None for r in report["layers"]):
        lines.append("output errors not measured (RTN reads no text): --report-samples 1 runs one calibration "
                     "sequence for them")
    if report.get("pruned_vocab"):
        pv = report["pruned_vocab"]
        lines.append(f"vocabulary pruned (LOSSY: gate it with specquant gate --tasks kl): {pv['kept']:,} of "
                     f"{pv['vocab_size']:,} ids kept (ids < {pv['keep_below']:,} and the special tokens)")
    if report.get("kept_dense"):
        kinds = sorted({n.rsplit(".", 1)[-1] for n in report["kept_dense"]})
        lines.append(f"kept dense by the layer kind's recipe: {len(report['kept_dense'])} Linears "
                     f"({', '.join(kinds)})")
    b0, b1 = report["bytes_before"], report["bytes_after"]
    lines.append(f"bytes: {b0:,} -> {b1:,} ({b1 / b0:.1%}); {report['quantized_linears']} Linears, "
                 f"{report['method']}, {report['seconds']} s")
    return "\n".join(lines)


def run(args) -> int:
    import torch

    from specquant.model.checkpoint import load_dense, load_tokenizer, read_hf_config, resolve
    from specquant.quant.checkpoint import save_quantized
    from specquant.quant.pipeline import quantize, tensor_bytes
    from specquant.util.files import check_out_dir

    cfg = quant_config(args).validate()
    src = resolve(args.model)
    out = Path(args.out).expanduser()
    if out.resolve() == src.resolve() or out.resolve() in src.resolve().parents:
        raise SpecquantError(f"--out {str(out)!r} is (or holds) the input checkpoint; choose a new directory")
    check_out_dir(out, args.overwrite)  # before the minutes of quantizing, not after
    hf = read_hf_config(src)
    if hf.get("quantization_config"):
        raise SpecquantError(f"{src} is already quantized; quantize the unquantized checkpoint")
    dtype_name = args.dtype or hf.get("torch_dtype") or hf.get("dtype") or "float32"
    if dtype_name not in DTYPES:
        raise SpecquantError(f"checkpoint torch_dtype {dtype_name!r} is not supported; pass --dtype float32|bfloat16")
    dtype = DTYPES[dtype_name]
    kept = None
    if cfg.prune_vocab:  # every refusal of the pruning before the minutes of quantizing
        from specquant.quant.prune_vocab import check_prunable

        kept = check_prunable(src, hf, cfg.prune_vocab)
    # Calibrate in float32 (bf16 GEMMs are slow on many CPUs) but round scales to the output dtype first.
    model = load_dense(src, dtype=torch.float32)
    calibrates = cfg.method_name != "rtn" or cfg.report_samples > 0
    # RTN without an error report reads no text: skip the tokenizer (and the seconds of importing transformers)
    tokenizer = load_tokenizer(src) if calibrates else None
    bytes_before = tensor_bytes(model) * dtype.itemsize // 4  # every tensor of the fp32 copy, at the output dtype
    report = quantize(model, cfg, tokenizer, scale_dtype=dtype, progress=not args.json)
    model.to(dtype)
    if kept is not None:  # after quantizing: calibration reads the full tokenizer's ids (see _save_pruned)
        from specquant.quant.prune_vocab import prune_model

        prune_model(model, kept, cfg.prune_vocab)
    report["bytes_before"], report["bytes_after"] = bytes_before, tensor_bytes(model)
    if kept is None:
        save_quantized(model, out, tokenizer_from=src, cfg=cfg, overwrite=args.overwrite)
    else:
        _save_pruned(model, out, src, cfg, kept, args.overwrite)
        report["pruned_vocab"] = {"kept": int(kept.numel()), "keep_below": cfg.prune_vocab,
                                  "vocab_size": model.vocab_map_entry["full_vocab_size"]}
    report["out"] = str(out)
    report["dtype"] = dtype_name
    print(json.dumps(report) if args.json else _table(report))
    return 0


def _save_pruned(model, out, src, cfg: QuantConfig, kept, overwrite: bool):
    """A model quantized first (calibration reads the full tokenizer's ids), then cut to the kept ids (the
    transformer layers are the same either way; the head's rows are cut from whatever precision it was given),
    saved with its cut tokenizer and the map."""
    import tempfile

    from specquant.quant.prune_vocab import CONFIG_KEY, write_pruned_tokenizer
    from specquant.quant.checkpoint import save_quantized

    with tempfile.TemporaryDirectory() as tmp:
        write_pruned_tokenizer(src, Path(tmp), kept)
        save_quantized(model, out, tokenizer_from=tmp, cfg=cfg, overwrite=overwrite,
                       extra_config={CONFIG_KEY: model.vocab_map_entry})
