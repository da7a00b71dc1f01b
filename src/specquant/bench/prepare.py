"""Inputs of a bench run, checked and prepared before anything is measured: the checkpoints (resolved, the W4 ones
quantized into out/cache when not given, reused when their source and QuantConfig are unchanged), the prompts
file, the config and the output directory. Nothing is written before every check has passed.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

from specquant.bench.config import BenchConfig
from specquant.bench.prompts import read_jsonl
from specquant.bench.stages import StageTimes
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import load_tokenizer, read_config, read_hf_config, resolve
from specquant.quant import QuantConfig, quantize, save_quantized
from specquant.spec_decode.drafter import check_vocab
from specquant.util.device import check_device
from specquant.util.dtypes import DTYPES
from specquant.util.files import atomic_write, check_out_dir
from specquant.util.progress import BAR_ONLY  # bench logs each preparing step's own line (bench/stages.py)


def fingerprint(path: Path) -> dict:
    """Identity of a checkpoint's contents: sha256 over config.json and its safetensors files."""
    h = hashlib.sha256()
    for f in [path / "config.json", *sorted(path.glob("*.safetensors"))]:
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return {"path": str(path.resolve()), "sha256": h.hexdigest()}


def quant_config_for(method: str, overrides: dict) -> QuantConfig:
    return QuantConfig.from_json({**overrides, "method": method}).validate()


def quantized_checkpoint(src: Path, role: str, method: str, overrides: dict, cache: Path) -> tuple[Path, dict]:
    """cache/role: src quantized with `method` (+ QuantConfig overrides), reused when its config.json records the
    same source contents and the same QuantConfig; otherwise produced again with quantize + save_quantized."""
    qcfg = quant_config_for(method, overrides)
    want_quant = json.loads(json.dumps(qcfg.to_json()))
    source = fingerprint(src)
    dest = cache / role
    if (dest / "config.json").exists():
        hf = read_hf_config(dest)
        if (hf.get("specquant_bench_source") == source
                and (hf.get("quantization_config") or {}).get("specquant") == want_quant):
            return dest, {"path": str(dest), "method": method, "produced": False, "config": want_quant}
    dtype_name = read_hf_config(src).get("torch_dtype") or "float32"
    scale_dtype = DTYPES.get(dtype_name, torch.float32)
    t0 = time.perf_counter()
    model = load_model(src, torch.float32)  # calibrate in fp32 (as `specquant quantize` does), store scales as src
    report = quantize(model, qcfg, load_tokenizer(src), scale_dtype=scale_dtype, progress=BAR_ONLY)
    model.to(scale_dtype)
    save_quantized(model, dest, tokenizer_from=src, cfg=qcfg)
    # record the source in the checkpoint itself (not in its name); a crash before this line only costs a re-run
    hf = read_hf_config(dest)
    hf["specquant_bench_source"] = source
    atomic_write(dest / "config.json", json.dumps(hf, indent=2, sort_keys=True) + "\n")
    return dest, {"path": str(dest), "method": method, "produced": True, "config": want_quant,
                  "seconds": round(time.perf_counter() - t0, 1), "bytes_before": report["bytes_before"],
                  "bytes_after": report["bytes_after"]}


def check_inputs(target, draft, quantized_target=None, quantized_draft=None, qad_target=None) -> dict[str, Path]:
    """Resolve every checkpoint before anything is written; raises SpecquantError naming the bad one."""
    paths = {"target": resolve(target), "draft": resolve(draft)}
    for role in ("target", "draft"):
        if read_hf_config(paths[role]).get("quantization_config"):
            raise SpecquantError(f"--{role} {str(paths[role])!r} is already quantized; pass the high-precision "
                                 f"checkpoint as --{role} and the quantized one as --quantized-{role}")
    for role, given in (("quantized_target", quantized_target), ("quantized_draft", quantized_draft),
                        ("qad_target", qad_target)):
        if given is None:
            continue
        path = resolve(given)
        if not read_hf_config(path).get("quantization_config"):
            raise SpecquantError(f"--{role.replace('_', '-')} {str(path)!r} has no quantization_config in its "
                                 "config.json; pass a compressed-tensors checkpoint or omit the flag to quantize")
        paths[role] = path
    # every row is compared with the unpruned baseline on one tokenization ("same tokens as", speedups); a
    # vocabulary-pruned target (specquant/quant/prune_vocab.py) has other tokens, so it runs only as its own lossy row
    from specquant.quant.prune_vocab import refuse_pruned

    for role in ("target", "quantized_target", "qad_target"):
        if role in paths:
            refuse_pruned(paths[role], f"--{role.replace('_', '-')} rows are compared with the unpruned target",
                          "pass the unpruned checkpoint (and the pruned one as --pruned-target for its lossy row)")
    check_vocab(read_config(paths["target"]).vocab_size, read_config(paths["draft"]).vocab_size)
    return paths


def check_pruned_target(paths: dict[str, Path], given) -> Path:
    """Row (v)'s checkpoint: vocabulary-pruned (specquant/quant/prune_vocab.py) from the --target's vocabulary."""
    from specquant.quant.prune_vocab import full_vocab_size

    path = resolve(given)
    full = full_vocab_size(read_hf_config(path))
    if full is None:
        raise SpecquantError(f"--pruned-target {str(path)!r} has no pruned_vocab map in its config.json; make one with "
                             "specquant quantize --prune-vocab N")
    if full != read_config(paths["target"]).vocab_size:
        raise SpecquantError(f"--pruned-target {str(path)!r} was pruned from a {full}-token vocabulary, --target has "
                             f"{read_config(paths['target']).vocab_size}; prune the bench's own target")
    return path


def check_block_inputs(paths: dict[str, Path], block_draft, quantized_block_draft=None):
    """Add the block drafter (and its W4) to `paths` after checking that they are block drafters for this target."""
    from specquant.model.block_draft import BlockDraftConfig, is_block_draft_config

    target_cfg = read_config(paths["target"])
    for role, given, quantized in (("block_draft", block_draft, False),
                                   ("quantized_block_draft", quantized_block_draft, True)):
        if given is None:
            continue
        flag = "--" + role.replace("_", "-")
        path = resolve(given)
        hf = read_hf_config(path)
        if not is_block_draft_config(hf):
            raise SpecquantError(f"{flag} {str(path)!r} is not a block drafter (config.json architectures "
                                 f"{hf.get('architectures')}); pass a DFlashDraftModel checkpoint")
        if bool(hf.get("quantization_config")) != quantized:
            raise SpecquantError(f"{flag} {str(path)!r} is {'not ' if quantized else ''}quantized; pass the "
                                 "high-precision block drafter as --block-draft and its W4 as --quantized-block-draft")
        BlockDraftConfig.from_hf(hf).check_target(target_cfg)
        paths[role] = path


def validate(cfg: BenchConfig, target, draft, quantized_target=None, quantized_draft=None, device="cpu",
             qad_target=None, block_draft=None, quantized_block_draft=None):
    """Every check that needs no model run; raises SpecquantError. Returns the resolved checkpoint paths."""
    cfg.validate()
    check_device(device)
    paths = check_inputs(target, draft, quantized_target, quantized_draft, qad_target if cfg.qad else None)
    if quantized_block_draft is not None and block_draft is None:
        raise SpecquantError("--quantized-block-draft needs --block-draft (its high-precision version)")
    check_block_inputs(paths, block_draft, quantized_block_draft)
    if cfg.prompts:
        read_jsonl(Path(cfg.prompts).expanduser())
    if quantized_target is None:
        quant_config_for(cfg.target_method, cfg.quant_overrides_for("target"))
    if quantized_draft is None:
        quant_config_for(cfg.draft_method, cfg.quant_overrides_for("draft"))
    check_out_dir(cfg.out, cfg.overwrite)
    return paths


def prepare_quantized(cfg: BenchConfig, paths: dict[str, Path], log=print, times: StageTimes | None = None) -> dict:
    """Fill paths["quantized_target"/"quantized_draft"], quantizing into out/cache what was not given; times:
    where given, each step's wall time is recorded there."""
    info = {}
    times = times if times is not None else StageTimes()
    cache = Path(cfg.out) / "cache"
    for role, method in (("target", cfg.target_method), ("draft", cfg.draft_method)):
        key = f"quantized_{role}"
        if key in paths:
            info[key] = str(paths[key])
            continue
        with times(f"W4 {role}: {method.upper()}"):
            paths[key], info[key] = quantized_checkpoint(paths[role], role, method, cfg.quant_overrides_for(role),
                                                         cache)
        how = f"quantized in {info[key]['seconds']:.1f} s" if info[key]["produced"] else "reused: same source, config"
        log(f"W4 {role}: {method.upper()} -> {cache / role} ({how})")
    if cfg.qad and "qad_target" not in paths:
        from specquant.train.recipe import qad_target

        log(f"W4 + QAD target: regen + distill target ({cfg.qad_steps} steps) -> {cache}")
        t0, cpu0 = time.perf_counter(), time.process_time()
        paths["qad_target"], info["qad_target"] = qad_target(paths["target"], paths["quantized_target"], cache,
                                                              cfg.qad_recipe(), log)
        seconds, cpu, q = time.perf_counter() - t0, time.process_time() - cpu0, info["qad_target"]
        if q["produced"] and "regen_cpu_seconds" in q:
            times.add(f"regen: {cfg.qad_prompts} prompts x {cfg.qad_new_tokens} tokens", q["regen_seconds"],
                      q["regen_cpu_seconds"])
            times.add(f"QAD: {cfg.qad_steps} steps", seconds - q["regen_seconds"], cpu - q["regen_cpu_seconds"])
        else:
            times.add("W4 + QAD target (reused)", seconds, cpu)
    elif "qad_target" in paths:
        info["qad_target"] = str(paths["qad_target"])
    if "block_draft" in paths and "quantized_block_draft" not in paths:
        calib_target = paths.get("qad_target", paths["quantized_target"])  # the target the block rows run against
        with times("W4 block drafter: GPTQ"):
            paths["quantized_block_draft"], info["quantized_block_draft"] = quantized_block_drafter(
                paths["block_draft"], calib_target, cfg.block_draft_quant, cache)
        how = (f"quantized in {info['quantized_block_draft']['seconds']:.1f} s"
               if info["quantized_block_draft"]["produced"] else "reused: same source, target, config")
        log(f"W4 block drafter: GPTQ on the features of {calib_target} -> {cache / 'block_draft'} ({how})")
    elif "quantized_block_draft" in paths:
        info["quantized_block_draft"] = str(paths["quantized_block_draft"])
    return info


def quantized_block_drafter(src: Path, target_path: Path, overrides: dict, cache: Path) -> tuple[Path, dict]:
    """cache/block_draft: GPTQ W4 of the block drafter `src`, calibrated on the features of `target_path` (the
    target its rows run against); reused when the drafter, the target and the QuantConfig are unchanged."""
    from specquant.drafter_loader import load_block_draft
    from specquant.model.checkpoint import save_block_drafter
    from specquant.quant.block_draft_gptq import gptq_block_drafter
    from specquant.quant.calib import calibration_tokens
    from specquant.quant.checkpoint import quantization_config

    qcfg = QuantConfig.from_json(json.loads(json.dumps(overrides))).validate()  # from_json fills its argument
    want_quant = json.loads(json.dumps(qcfg.to_json()))
    source = {"drafter": fingerprint(src), "target": fingerprint(target_path)}
    dest = cache / "block_draft"
    if (dest / "config.json").exists():
        hf = read_hf_config(dest)
        if hf.get("specquant_bench_source") == source and hf.get("specquant_bench_quant") == want_quant:
            return dest, {"path": str(dest), "method": qcfg.method.name, "produced": False, "config": want_quant}
    t0 = time.perf_counter()
    target = load_model(target_path, torch.float32)
    drafter = load_block_draft(src, torch.float32)
    tokens = calibration_tokens(load_tokenizer(target_path), qcfg.calib_path(), qcfg.calib_samples, qcfg.seq_len)
    report = gptq_block_drafter(drafter, target, tokens, qcfg, progress=BAR_ONLY)
    save_block_drafter(drafter, dest, tokenizer_from=src, extra_config={
        "quantization_config": quantization_config(drafter, qcfg), "specquant_bench_source": source,
        "specquant_bench_quant": want_quant})
    return dest, {"path": str(dest), "method": qcfg.method.name, "produced": True, "config": want_quant,
                  "seconds": round(time.perf_counter() - t0, 1), "bytes_before": report["bytes_before"],
                  "bytes_after": report["bytes_after"]}


def target_prompts(cfg: BenchConfig, target: Path):
    """(the target's tokenizer, the bench prompts in its tokens, lengths fitted to its context): what an outside
    engine's rows run on (bench/llama_cpp.py, bench/engines.py). The ablation fits them to the draft's context too."""
    from specquant.bench.prompts import fit_lengths, load_prompts

    tokenizer = load_tokenizer(target)
    lengths = fit_lengths(cfg.lengths, read_config(target).max_position_embeddings, cfg.max_new_tokens)
    return tokenizer, load_prompts(tokenizer, lengths, cfg.content_sets, cfg.prompts_per_length, cfg.prompts_per_set,
                                   cfg.content_max_tokens, cfg.prompts)
