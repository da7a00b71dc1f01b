"""GGUF export of the block drafter in the layout of llama.cpp's `dflash` architecture (`--spec-type draft-dflash`).

Reference: the llama.cpp that export/llama_cpp_build.py builds (llama-cpp-python 0.3.36's vendored tree):
`conversion/qwen.py` (DFlashModel, its converter for `DFlashDraftModel`), `src/models/dflash.cpp` (the loader and
graph) and `common/speculative.cpp` (the draft loop). What it reads, and how ours maps onto it:

  tensors   fc.weight [taps·hidden -> hidden]  = our fc          enc.output_norm.weight = our hidden_norm
            blk.N.* as a Qwen3 layer (attn_norm, attn_q/k/v/output, attn_q_norm/k_norm, ffn_norm, ffn_gate/up/down)
            output_norm.weight = our norm; no token_embd / output: both are taken from the target's context, as our
            drafter borrows the target's embed_tokens and lm_head (`attach_target`)
  metadata  dflash.target_layers = [l + 1 for l in target_layer_ids]: llama.cpp taps the *input* of target layer
            l + 1, which is the output of layer l (our hidden_states[l + 1]); so the target's last layer cannot be
            tapped (qwen3's graph has no input of a layer past the last) and is refused
            dflash.block_size, dflash.attention.causal = false (the block attends to itself both ways),
            tokenizer.ggml.mask_token_id, the target's tokenizer (llama.cpp checks both vocabularies agree),
            optional dflash.attention.sliding_window with every layer windowed (our serve-time window: a query at p
            sees keys at p - W < pos, the same rule as llama.cpp's standard SWA)

The draft loop matches ours when it runs the whole trained block: llama.cpp decodes [anchor, MASK x n_max] at
positions n .. n + n_max over the injected context positions < n, so `--spec-draft-n-max` must be block_size - 1
(`spec_draft_n_max`); a shorter block is a different bidirectional computation than the one trained.

Why not the vendored converter itself: it needs the target's HF directory with a tokenizer its pre-tokenizer table
knows (ours is refused, see export/gguf.py) and it reads dense weights only. The gguf package on PyPI (0.19.0, the
version we pin) predates MODEL_ARCH.DFLASH, so the arch name, its few keys and the two DFlash-only tensor names are
written here as data; the Qwen3 layer names come from gguf's own tensor map.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from specquant.errors import SpecquantError
from specquant.export.gguf import (DENSE_TYPES, FILE_TYPES, GRID_TENSORS, Source, TensorRow, _dense_array,
                                   _grid_weight, add_tokenizer, dequantize_blocks, encode, file_report, main_kind,
                                   refuse_inexact, rope_freqs_rows, write_file)
from specquant.export.gguf_arch import _gguf, add_hparams
from specquant.model.block_draft import BlockDraftConfig, is_block_draft_config
from specquant.model.checkpoint import load_tensors, read_hf_config, resolve
from specquant.model.config import ModelConfig

ARCH = "dflash"
# keys as llama-arch.cpp / the vendored gguf-py name them (LLM_KV_TARGET_LAYERS, LLM_KV_DFLASH_BLOCK_SIZE, ...)
KEY_TARGET_LAYERS = f"{ARCH}.target_layers"
KEY_BLOCK_SIZE = f"{ARCH}.block_size"
# our checkpoint name -> GGUF name for the tensors a Qwen3 layer stack does not have
DFLASH_TENSORS = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight"}


def spec_draft_n_max(cfg: BlockDraftConfig) -> int:
    """The `--spec-draft-n-max` that makes llama.cpp decode the whole trained block (anchor + block_size - 1)."""
    return cfg.block_size - 1


def extract_layers(cfg: BlockDraftConfig) -> list[int]:
    """dflash.target_layers: llama.cpp's layer-input indices for our 0-based output taps."""
    last = [i for i in cfg.target_layer_ids if i >= cfg.num_target_layers - 1]
    if last:
        raise SpecquantError(f"target_layer_ids {last} tap the target's last layer ({cfg.num_target_layers - 1}), "
                             "whose output llama.cpp's dflash drafting cannot read (it taps layer inputs); use a "
                             "drafter trained on earlier layers")
    return [i + 1 for i in cfg.target_layer_ids]


def _gguf_name(key: str, tmap) -> str:
    if key in DFLASH_TENSORS:
        return DFLASH_TENSORS[key]
    # our drafter keys are a Qwen3 model's without the "model." prefix (layers.N..., norm)
    name = tmap.get_name("model." + key, try_suffixes=(".weight", ".bias"))
    if name is None:
        raise SpecquantError(f"block drafter tensor {key!r} has no place in llama.cpp's dflash layout")
    return name


def plan_tensors(tensors: dict, cfg: BlockDraftConfig, dense_dtype: str = "f32", inexact: str = "error"):
    """[(gguf name, array, GGUF type, TensorRow)]: packed Linears as Q4_0/Q4_1/Q8_0 from our codes, matrices as
    dense_dtype, norms F32 (export/gguf.py's rules)."""
    gguf = _gguf()
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, cfg.num_hidden_layers)
    packed = {k[: -len(".weight_packed")] for k in tensors if k.endswith(".weight_packed")}
    out, bad = [], []
    for name in sorted(packed):
        w = _grid_weight(name, tensors)
        data, kind, inexact_mask = encode(name, w)
        err, nbad = 0.0, int(inexact_mask.sum())
        if nbad:
            err = float(np.abs(dequantize_blocks(data, kind) - w.values().numpy()).max())
            bad.append(f"{name}: {nbad} of {inexact_mask.size} blocks, max |error| {err:.3g}")
        row = TensorRow(_gguf_name(name + ".weight", tmap), name + ".weight", kind, list(w.codes.shape), err, nbad)
        out.append((row.name, data, kind, row))
    dense_kind = DENSE_TYPES[dense_dtype][0]
    for key, t in tensors.items():
        base, _, leaf = key.rpartition(".")
        if base in packed and leaf in GRID_TENSORS:
            continue
        if not t.is_floating_point():
            raise SpecquantError(f"block drafter tensor {key!r} has dtype {t.dtype}; only floating tensors and "
                                 "packed Linears export")
        kind = dense_kind if t.dim() == 2 else "F32"
        arr, err = _dense_array(t, kind)
        row = TensorRow(_gguf_name(key, tmap), key, kind, list(t.shape), err)
        out.append((row.name, arr, kind, row))
    out += rope_freqs_rows(cfg.layer_config())  # dflash.cpp ropes with layers[0].rope_freqs, the one such tensor
    out.sort(key=lambda item: _order(item[0]))
    refuse_inexact(bad, inexact, "quantized drafter tensors")
    return out, bad


def _order(name: str) -> tuple:
    """fc and the encoder norm first, then layer by layer, then output_norm (the converter's order)."""
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (2 if parts[0] == "output_norm" else 0, 0, name)


def write_dflash_gguf(draft, target, out_path, dense_dtype: str = "f32", inexact: str = "error") -> dict:
    """Write the block drafter `draft` (checkpoint dir or bundled name, dense or W4/W8) for the target `target` as
    one dflash GGUF, atomically. Returns a report dict shaped like export.gguf.write_gguf's."""
    import logging

    gguf = _gguf()
    draft_path, target_path = resolve(draft), resolve(target)
    draft_hf, target_hf = read_hf_config(draft_path), read_hf_config(target_path)
    if not is_block_draft_config(draft_hf):
        raise SpecquantError(f"{draft_path} is not a block drafter (config.json architectures "
                             f"{draft_hf.get('architectures')}); the dflash GGUF is for DFlashDraftModel checkpoints")
    cfg = BlockDraftConfig.from_hf(draft_hf)
    cfg.check_target(ModelConfig.from_hf(target_hf))
    layers = extract_layers(cfg)
    planned, bad = plan_tensors(load_tensors(draft_path), cfg, dense_dtype, inexact)
    for b in bad:
        logging.getLogger(__name__).warning("inexact GGUF export: %s", b)
    kinds = [k for _, _, k, row in planned if len(row.shape) == 2]
    main = main_kind(kinds)
    # the vocabulary is the target's (llama.cpp compares the two token by token); ours are one tokenizer
    vocab_src = Source(target_hf, {}, target_path, name=target_path.name)

    def metadata(writer):
        writer.add_name(draft_path.name)
        add_hparams(writer, cfg.layer_config(), int(gguf.LlamaFileType[FILE_TYPES[main]]))
        writer.add_array(KEY_TARGET_LAYERS, layers)
        writer.add_uint32(KEY_BLOCK_SIZE, cfg.block_size)
        writer.add_causal_attention(False)
        if cfg.sliding_window is not None:
            writer.add_sliding_window(cfg.sliding_window)
            writer.add_sliding_window_pattern([True] * cfg.num_hidden_layers)
        vocab = add_tokenizer(writer, vocab_src)
        writer.add_mask_token_id(cfg.mask_token_id)
        return vocab

    out_path = Path(out_path)
    vocab = write_file(out_path, ARCH, planned, metadata)
    return file_report(out_path, ARCH, main, planned, vocab, target_layers=layers, block_size=cfg.block_size,
                       mask_token_id=cfg.mask_token_id)
