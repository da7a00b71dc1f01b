"""vLLM export: the target and draft checkpoints as they are (compressed-tensors pack-quantized is vLLM's own W4A16
format, so nothing is converted), plus a `vllm serve` command line with its `--speculative-config` JSON.

Drafter kinds come from the draft's config.json through the drafter registry (spec_decode/drafters/; metadata
lives in the checkpoint, never in a file name); each kind names its vLLM method:
  lm     a Qwen3 / Qwen2 / Llama causal LM sharing the target's vocabulary -> method "draft_model"
  block  architectures ["DFlashDraftModel"] with a `dflash_config` (target_layer_ids, mask_token_id) and
         `block_size` -> method "dflash"; num_speculative_tokens is then the trained block size minus one
         (the block's first slot is the verified anchor token).
vLLM itself does not run on the CPU CI; tests check the JSON against the fields of vLLM's SpeculativeConfig.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.export.config import ExportConfig, check_out, write_marker
from specquant.model.checkpoint import read_hf_config, resolve
from specquant.util.files import atomic_dir
from specquant.model.config import ModelConfig
from specquant.spec_decode.drafter import DrafterKind
from specquant.spec_decode.drafters import kind_of

def drafter_kind(hf: dict) -> DrafterKind:
    """The kind of a draft from its config.json, complete enough to export; raises naming what is missing."""
    kind = kind_of(hf)
    missing = kind.missing(hf)
    if missing:
        raise SpecquantError(f"draft looks like a {kind.title} but its config.json lacks {', '.join(missing)}; "
                             f"vLLM's {kind.vllm_method} method and llama.cpp's converter need them")
    if kind.vllm_method is None:
        raise SpecquantError(f"vLLM has no speculative method for the {kind.title}; export the target alone")
    return kind


def quantization_of(hf: dict) -> str | None:
    """vLLM's --quantization name for a checkpoint ('compressed-tensors'), None when dense."""
    qc = hf.get("quantization_config")
    if not qc:
        return None
    method = qc.get("quant_method")
    if method != "compressed-tensors":
        raise SpecquantError(f"quantization_config.quant_method {method!r}: this export writes compressed-tensors "
                             "checkpoints only; re-quantize with `specquant quantize`")
    return method


def tp_notes(target: dict, draft: dict | None, tp: int) -> list[str]:
    """Tensor-parallel divisibility: vLLM shards attention heads and KV heads over TP ranks (KV heads may be
    replicated when tp > kv heads, but tp must then be a multiple of them); the draft runs at TP 1 or the target's."""
    notes, errors = [], []
    for role, hf in (("target", target), ("draft", draft)):
        if hf is None or hf.get("num_attention_heads") is None:
            continue
        heads, kv = hf["num_attention_heads"], hf.get("num_key_value_heads") or hf["num_attention_heads"]
        draft_tp = 1 if role == "draft" else tp
        ok_tp = [t for t in (1, 2, 4, 8) if heads % t == 0 and (kv % t == 0 or t % kv == 0)]
        notes.append(f"{role}: {heads} heads, {kv} KV heads -> tensor-parallel sizes that divide them: "
                     f"{', '.join(map(str, ok_tp))}")
        if role == "target" and tp not in ok_tp:
            errors.append(f"--tensor-parallel-size {tp} does not divide the target's {heads} heads / {kv} KV heads; "
                          f"use one of {', '.join(map(str, ok_tp))}")
        if role == "draft" and tp > 1:
            ok_draft = heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)
            notes.append(f"draft runs at draft_tensor_parallel_size 1 (allowed: 1 or the target's {tp}"
                         f"{'' if ok_draft else f'; {tp} does not divide its heads, so 1 is the only choice'})")
        for key in ("intermediate_size", "vocab_size"):
            if hf.get(key) and hf[key] % draft_tp:
                errors.append(f"{role} {key}={hf[key]} is not divisible by tensor-parallel size {draft_tp}")
    if errors:
        raise SpecquantError("; ".join(errors))
    return notes


def speculative_config(draft_dir: Path, draft_hf: dict, cfg: ExportConfig) -> dict:
    """The --speculative-config JSON for vLLM."""
    kind = drafter_kind(draft_hf)
    fixed = kind.fixed_draft_len(draft_hf)
    spec = {"model": str(draft_dir), "method": kind.vllm_method,
            "num_speculative_tokens": cfg.num_speculative_tokens if fixed is None else fixed,
            "draft_tensor_parallel_size": 1}
    quant = quantization_of(draft_hf)
    if quant:
        spec["quantization"] = quant
    return spec


def serve_command(target_dir: Path, spec: dict | None, target_hf: dict, cfg: ExportConfig) -> str:
    import json

    args = ["vllm", "serve", str(target_dir), "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    quant = quantization_of(target_hf)
    if quant:
        args += ["--quantization", quant]
    args += ["--max-model-len", str(cfg.ctx_size or target_hf.get("max_position_embeddings", 2048))]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return shlex.join(args)


def check_pair(target_hf: dict, draft_hf: dict):
    """A standalone drafter (an LM) must share the target's vocabulary size (vLLM verifies token ids, not
    strings)."""
    if drafter_kind(draft_hf).standalone:
        t, d = ModelConfig.from_hf(target_hf), ModelConfig.from_hf(draft_hf)
        if t.vocab_size != d.vocab_size:
            raise SpecquantError(f"draft vocab_size {d.vocab_size} differs from the target's {t.vocab_size}; "
                                 "an LM drafter must share the target's tokenizer")


def export_vllm(target, draft, out: Path, cfg: ExportConfig, overwrite: bool = False) -> dict:
    """Copy target (and draft) into out/target, out/draft and return the report with the serve command line."""
    check_out(out, overwrite)
    target_path = resolve(target)
    target_hf = read_hf_config(target_path)
    ModelConfig.from_hf(target_hf)
    quantization_of(target_hf)
    draft_path = resolve(draft) if draft else None
    draft_hf = read_hf_config(draft_path) if draft_path else None
    if draft_hf is not None:
        check_pair(target_hf, draft_hf)
    notes = tp_notes(target_hf, draft_hf if draft_hf and drafter_kind(draft_hf).standalone else None,
                     cfg.tensor_parallel_size)
    if draft_hf and draft_hf.get("specquant_sliding_window"):
        notes.append(f"draft sliding window {draft_hf['specquant_sliding_window']} is specquant's own; vLLM's "
                     "draft_model attends to the full context (still lossless, drafts may differ)")
    out_target, out_draft = out / "target", out / "draft"
    spec = speculative_config(out_draft.resolve(), draft_hf, cfg) if draft_hf is not None else None
    command = serve_command(out_target.resolve(), spec, target_hf, cfg)
    with atomic_dir(out, overwrite=True) as tmp:  # check_out above is the stricter rule
        shutil.copytree(target_path, tmp / "target")
        if draft_path is not None:
            shutil.copytree(draft_path, tmp / "draft")
        (tmp / "serve.sh").write_text("#!/usr/bin/env bash\n" + command + "\n")
        report = {"engine": "vllm", "out": str(out), "target": str(out_target),
                  "draft": str(out_draft) if draft else None, "speculative_config": spec, "command": command,
                  "notes": notes}
        write_marker(tmp, report)
    return report
