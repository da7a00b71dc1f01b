"""GGUF export for llama.cpp: our INT4 codes and scales written as Q4_0 / Q4_1 blocks, never re-quantized.

Why not llama.cpp's convert_hf_to_gguf.py: it refuses our tokenizer (unknown BPE pre-tokenizer hash) and it reads
dense weights only, so it would round our AWQ/GPTQ/QAD weights to its own Q4_0 grid. The container, the block
layouts, the tensor names and the reference dequantizer all come from the `gguf` package (gguf-py, the version
vendored in the llama.cpp we build); only the mapping from our tensors to GGUF blocks is written here.

The grid maps exactly (ggml block = 32 weights):
  symmetric 4-bit   w = s·c, c in [-8, 7]           -> Q4_0: d = s (fp16), q = c + 8, w = d·(q - 8)
  asymmetric 4-bit  w = s·(c - z), c, z in [-8, 7]  -> Q4_1: d = s, m = -s·(z + 8), q = c + 8, w = d·q + m
  symmetric 8-bit   w = s·c, c in [-128, 127]       -> Q8_0: d = s, q = c, w = d·q
A group of G (a multiple of 32; -1 = per channel) repeats its scale over G/32 blocks. Exact as long as d (and m) are
fp16 numbers: scales stored as float16 always are; bfloat16 scales are unless tiny (< 2^-14, fp16 subnormals); float32
scales generally are not. A group whose codes are all zero is exact whatever its scale. Anything inexact is refused
(inexact="error") or written with its measured error (inexact="warn"), never silently.

Our grid values are (c - z)·s evaluated exactly (fp32 holds every such product); llama.cpp computes the same
numbers, so a GGUF tensor dequantized by gguf.quants equals our dequantized weight bit for bit
(tests/test_export_gguf.py).

Architectures (tensor names, metadata keys, per-tensor rewrites such as Qwen3.5's value-head reorder) are rows of
export/gguf_arch.py's ARCHS; this file maps our tensors onto them and writes the file.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from specquant.errors import SpecquantError
from specquant.model.checkpoint import (load_tensors, read_hf_config, resolve, split_tensors,
                                         state_dict_for_save)
from specquant.export.gguf_arch import Rewrite, _gguf, _gguf_arch, add_hparams, gguf_arch, rope_factors
from specquant.model.config import ModelConfig
from specquant.quant.pack import unpack_codes

log = logging.getLogger(__name__)

QK = 32  # weights per ggml block for Q4_0 / Q4_1 / Q8_0
GRID_TENSORS = ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")  # compressed-tensors names


# --- our tensors -----------------------------------------------------------------------------------------------


@dataclass
class GridWeight:
    """One quantized Linear as stored: codes int8 [out, in], scale [out, groups], zero int8 [out, groups] | None."""

    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None
    bits: int

    @property
    def group_size(self) -> int:
        return self.codes.shape[1] // self.scale.shape[1]

    def values(self) -> torch.Tensor:
        """The grid values (c - z)·s in float32, exactly (a <= 9-bit integer times a <= 24-bit scale fits fp32)."""
        groups = self.scale.shape[1]
        c = self.codes.float().reshape(self.codes.shape[0], groups, -1)
        if self.zero is not None:
            c = c - self.zero.float().unsqueeze(-1)
        return (c * self.scale.float().unsqueeze(-1)).reshape(self.codes.shape)


@dataclass
class Source:
    """What a GGUF is written from: the HF config, checkpoint-named tensors, and the tokenizer's directory."""

    hf: dict
    tensors: dict[str, torch.Tensor]
    tokenizer_dir: Path | None
    name: str = "model"
    config: ModelConfig = field(init=False)

    def __post_init__(self):
        self.config = ModelConfig.from_hf(self.hf)

    def linears(self) -> tuple[dict[str, GridWeight], dict[str, torch.Tensor]]:
        """({Linear name: GridWeight} for packed Linears, {tensor name: tensor} for everything else)."""
        grid, dense = {}, {}
        packed = {k[: -len(".weight_packed")] for k in self.tensors if k.endswith(".weight_packed")}
        for name in sorted(packed):
            grid[name] = _grid_weight(name, self.tensors)
        for k, t in self.tensors.items():
            base, _, leaf = k.rpartition(".")
            if base not in packed or leaf not in GRID_TENSORS:  # a quantized Linear's bias stays a dense tensor
                dense[k] = t
        return grid, dense


def _grid_weight(name: str, tensors: dict[str, torch.Tensor]) -> GridWeight:
    packed, scale = tensors[f"{name}.weight_packed"], tensors.get(f"{name}.weight_scale")
    shape = tensors.get(f"{name}.weight_shape")
    if scale is None or shape is None:
        raise SpecquantError(f"{name} has weight_packed but no weight_scale/weight_shape; the checkpoint is damaged")
    out_f, in_f = (int(v) for v in shape.tolist())
    bits = 32 * packed.shape[1] // in_f
    if bits not in (4, 8) or packed.shape[1] * 32 != in_f * bits or packed.shape[0] != out_f:
        raise SpecquantError(f"{name}.weight_packed has shape {list(packed.shape)}, which is neither 4- nor 8-bit "
                             f"packing of a [{out_f}, {in_f}] weight")
    codes = unpack_codes(packed.to(torch.int32), bits, in_f)
    zp = tensors.get(f"{name}.weight_zero_point")
    zero = None if zp is None else unpack_codes(zp.to(torch.int32), bits, out_f, dim=0)
    return GridWeight(codes, scale, zero, bits)


def source_from_checkpoint(name_or_dir) -> Source:
    """A checkpoint directory (dense or compressed-tensors pack-quantized) or bundled name. A multimodal Qwen3.5
    checkpoint gives its text model (its names as the decoder's); the MTP head (mtp.*) is not written."""
    path = resolve(name_or_dir)
    tensors, kept = split_tensors(load_tensors(path))
    if kept:
        log.warning("%s: %d mtp.* tensors (the multi-token-prediction head) are not exported to GGUF", path.name,
                    len(kept))
    return Source(read_hf_config(path), tensors, path, name=path.name)


def source_from_model(model, tokenizer_dir=None, name: str = "model") -> Source:
    """A loaded specquant Transformer (dense or with QuantLinear modules, unfused); the tokenizer from
    tokenizer_dir (a checkpoint directory or bundled name)."""
    from specquant.model.fuse import check_unfused

    check_unfused(model, "export")
    return Source(model.config.to_hf(), state_dict_for_save(model),
                  resolve(tokenizer_dir) if tokenizer_dir is not None else None, name=name)


# --- blocks ----------------------------------------------------------------------------------------------------


def _repeat_per_block(x: np.ndarray, group_size: int, name: str) -> np.ndarray:
    """[out, groups] -> [out, in/32]: each group's value repeated over its blocks."""
    if group_size % QK:
        raise SpecquantError(f"{name}: group size {group_size} is not a multiple of GGUF's block of {QK} weights; "
                             "re-quantize with --group-size 32, 64 or 128")
    return np.repeat(x, group_size // QK, axis=1)


def _nibbles(u: np.ndarray) -> np.ndarray:
    """Unsigned 4-bit values [out, in] -> ggml's qs [out, in/32, 16]: element j low nibble, element j+16 high."""
    u = u.reshape(u.shape[0], -1, QK)
    return (u[..., : QK // 2] | (u[..., QK // 2:] << 4)).astype(np.uint8)


def _fp16_bytes(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16)).view(np.uint8).reshape(*x.shape, 2)


def encode(name: str, w: GridWeight) -> tuple[np.ndarray, str, np.ndarray]:
    """(block bytes uint8 [out, in/32·block_bytes], GGUF type name, inexact mask [out, in/32] of blocks whose fp16
    parameters differ from ours while the block holds a nonzero weight)."""
    out_f, in_f = w.codes.shape
    if in_f % QK:
        raise SpecquantError(f"{name}: in_features={in_f} is not a multiple of {QK}; GGUF cannot block it")
    codes = w.codes.numpy().astype(np.int16)
    scale64 = _repeat_per_block(w.scale.double().numpy(), w.group_size, name)  # [out, nb]
    d = scale64.astype(np.float16)
    inexact = d.astype(np.float64) != scale64
    if w.bits == 4 and w.zero is None:
        kind, parts = "Q4_0", [_fp16_bytes(d), _nibbles((codes + 8).astype(np.uint8))]
        shifted = codes
    elif w.bits == 4:
        zero = _repeat_per_block(w.zero.numpy().astype(np.float64), w.group_size, name)
        m64 = -(zero + 8) * scale64
        m = m64.astype(np.float16)
        inexact |= m.astype(np.float64) != m64
        kind, parts = "Q4_1", [_fp16_bytes(d), _fp16_bytes(m), _nibbles((codes + 8).astype(np.uint8))]
        shifted = codes - np.repeat(w.zero.numpy().astype(np.int16), w.group_size, axis=1)
    elif w.zero is None:
        kind = "Q8_0"
        parts = [_fp16_bytes(d), codes.astype(np.int8).view(np.uint8).reshape(out_f, -1, QK)]
        shifted = codes
    else:
        raise SpecquantError(f"{name}: asymmetric 8-bit has no exact GGUF type (Q8_1 is an activation format); "
                             "re-quantize with --bits 4 --asymmetric or symmetric --bits 8")
    # a block whose weights are all zero is exact whatever its stored scale (e.g. a bf16 scale of ~1e-38)
    inexact &= (shifted.reshape(out_f, -1, QK) != 0).any(-1)
    return np.concatenate(parts, axis=-1).reshape(out_f, -1), kind, inexact


def dequantize_blocks(data: np.ndarray, kind: str) -> np.ndarray:
    """The gguf package's reference dequantizer (gguf.quants) on our blocks -> float32 [out, in]."""
    gguf = _gguf()
    return gguf.quants.dequantize(data, gguf.GGMLQuantizationType[kind])


# --- tokenizer -------------------------------------------------------------------------------------------------


# The Split regexes of Qwen's byte-level BPE tokenizers (tokenizer.json, as transformers' Qwen2 / Qwen3.5 tokenizers
# write them) -> llama.cpp's pre-tokenizer that implements each (src/llama-vocab.cpp quotes the original beside its
# own spelling of it)
SPLIT_PRE_TOKENIZERS = {
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""":
        "qwen2",
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""":
        "qwen35",
}


def pre_tokenizer_name(tok: dict) -> str | None:
    """llama.cpp's tokenizer.ggml.pre for a tokenizer.json, None when none is known to split text the same way:
    "gpt-2" for ByteLevel(use_regex=True); "qwen2" / "qwen35" for Split(Qwen's regex, isolated) then
    ByteLevel(use_regex=False), with or without Qwen's NFC normalizer (llama.cpp does not normalize, as its own
    converter does not: text that is not NFC already may then tokenize differently)."""
    pre, norm = tok.get("pre_tokenizer") or {}, tok.get("normalizer")
    byte_level = {"type": "ByteLevel", "add_prefix_space": False}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space") \
            and not norm:
        return "gpt-2"
    steps = pre.get("pretokenizers") or []
    if pre.get("type") != "Sequence" or len(steps) != 2 or norm not in (None, {"type": "NFC"}):
        return None
    split, last = steps
    if split.get("type") != "Split" or split.get("behavior") != "Isolated" or split.get("invert") \
            or any(last.get(k) != v for k, v in byte_level.items()) or last.get("use_regex", True):
        return None
    return SPLIT_PRE_TOKENIZERS.get((split.get("pattern") or {}).get("Regex"))


def add_tokenizer(writer, src: Source) -> dict:
    """Byte-level BPE vocabulary, merges and special ids from tokenizer.json (+ tokenizer_config.json).

    The pre-tokenizer is one llama.cpp implements (pre_tokenizer_name: GPT-2's, Qwen2's or Qwen3.5's regex); the
    export refuses any other rather than guess (tests tokenize with llama-tokenize and compare ids)."""
    gguf = _gguf()
    if src.tokenizer_dir is None or not (src.tokenizer_dir / "tokenizer.json").is_file():
        raise SpecquantError(f"no tokenizer.json beside the checkpoint ({src.tokenizer_dir}); GGUF needs the "
                             "vocabulary: copy the base model's tokenizer files into the checkpoint directory")
    tok = json.loads((src.tokenizer_dir / "tokenizer.json").read_text())
    model, pre = tok.get("model") or {}, tok.get("pre_tokenizer") or {}
    pre_name = pre_tokenizer_name(tok)
    if model.get("type") != "BPE" or pre_name is None:
        raise SpecquantError(f"tokenizer in {src.tokenizer_dir} is not a byte-level BPE llama.cpp splits the same "
                             f"way (model {model.get('type')!r}, pre-tokenizer {pre.get('type')!r}, normalizer "
                             f"{(tok.get('normalizer') or {}).get('type')!r}); exported are GPT-2's and Qwen's "
                             "(pre-tokenizers gpt-2, qwen2, qwen35)")
    cfg_path = src.tokenizer_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
    vocab = dict(model["vocab"])
    added = {t["content"]: t for t in tok.get("added_tokens", [])}
    for content, t in added.items():
        vocab[content] = t["id"]
    n_vocab = src.config.vocab_size
    if max(vocab.values()) >= n_vocab:
        raise SpecquantError(f"tokenizer has token id {max(vocab.values())} but config.json vocab_size={n_vocab}")
    by_id = {i: s for s, i in vocab.items()}
    tokens, types = [], []
    for i in range(n_vocab):  # ids the tokenizer never produces become unused padding, as the HF converter does
        s = by_id.get(i)
        if s is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
        elif s in added:
            tokens.append(s)
            types.append(gguf.TokenType.CONTROL if added[s].get("special") else gguf.TokenType.USER_DEFINED)
        else:
            tokens.append(s)
            types.append(gguf.TokenType.NORMAL)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre_name)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    eos = src.config.eos_ids[0] if src.config.eos_ids else vocab.get(tok_cfg.get("eos_token") or "")
    if eos is None:
        raise SpecquantError("neither config.json eos_token_id nor tokenizer_config.json eos_token is set; "
                             "llama.cpp needs an end-of-sequence token")
    # GPT-2 convention: without a BOS token of its own the model's BOS is <|endoftext|>, never prepended
    bos = src.config.bos_token_id if src.config.bos_token_id is not None else eos
    writer.add_eos_token_id(int(eos))
    writer.add_bos_token_id(int(bos))
    writer.add_add_bos_token(src.config.bos_token_id is not None and bool(tok_cfg.get("add_bos_token", False)))
    pad = vocab.get(tok_cfg.get("pad_token") or "")
    if pad is not None:
        writer.add_pad_token_id(int(pad))
    if tok_cfg.get("chat_template"):
        writer.add_chat_template(tok_cfg["chat_template"])
    return {"tokens": len(tokens), "merges": len(merges), "eos": int(eos), "bos": int(bos), "pre": pre_name}


DENSE_TYPES = {"f32": ("F32", torch.float32), "f16": ("F16", torch.float16), "bf16": ("BF16", torch.bfloat16)}
FILE_TYPES = {"F32": "ALL_F32", "F16": "MOSTLY_F16", "BF16": "MOSTLY_BF16", "Q4_0": "MOSTLY_Q4_0",
              "Q4_1": "MOSTLY_Q4_1", "Q8_0": "MOSTLY_Q8_0"}


def _dense_array(t: torch.Tensor, kind: str) -> tuple[np.ndarray, float]:
    """(array for GGUFWriter, max |rounding error| against t) for a dense tensor written as kind."""
    target = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[kind]
    cast = t.detach().to(target)
    # already in that dtype: exact, and no fp32 copies to compare (GBs for a bf16 4B embedding)
    err = float((cast.float() - t.float()).abs().max()) if t.numel() and t.dtype != target else 0.0
    if kind == "BF16":  # numpy has no bfloat16: hand over the raw bytes with the GGML type
        return cast.view(torch.int16).numpy().view(np.uint8).reshape(*t.shape[:-1], -1), err
    return cast.numpy(), err


@dataclass
class TensorRow:
    name: str  # GGUF name
    source: str  # checkpoint name
    kind: str  # GGUF type
    shape: list[int]
    max_abs_error: float  # against our values (0.0 = exact)
    inexact_blocks: int = 0


def _tensor_order(name: str) -> tuple:
    """token_embd first, then layer by layer (numerically), then the output tensors: the converter's order."""
    parts = name.split(".")
    if parts[0] == "blk":
        return (1, int(parts[1]), name)
    return (0 if parts[0] in ("token_embd", "rope_freqs") else 2, 0, name)


def _rewrite_grid(name: str, w: GridWeight, rw: Rewrite) -> GridWeight:
    """Row and block-column permutations of a quantized Linear: codes, scales and zero points move together."""
    codes, scale, zero = w.codes, w.scale, w.zero
    if rw.rows is not None:
        codes, scale = codes[rw.rows], scale[rw.rows]
        zero = None if zero is None else zero[rw.rows]
    if rw.cols is not None:
        blocks = rw.cols.reshape(-1, QK)
        starts = blocks[:, 0]
        if (starts % QK).any() or not torch.equal(blocks, starts[:, None] + torch.arange(QK)):
            raise SpecquantError(f"{name}: llama.cpp's layout moves its input columns in pieces that are not whole "
                                 f"blocks of {QK} weights, so its quantized groups cannot be carried exactly; keep "
                                 "it dense when quantizing (--ignore), or quantize a model whose value head size "
                                 f"is a multiple of {QK}")
        if w.group_size % QK:
            raise SpecquantError(f"{name}: group size {w.group_size} is not a multiple of GGUF's block of {QK} "
                                 "weights; re-quantize with --group-size 32, 64 or 128")
        per_block = w.group_size // QK
        order = starts // QK  # new block b is old block order[b]; each block then carries its own scale
        codes = codes[:, rw.cols]
        scale = scale.repeat_interleave(per_block, dim=1)[:, order]
        zero = None if zero is None else zero.repeat_interleave(per_block, dim=1)[:, order]
    return GridWeight(codes, scale, zero, w.bits)


def _rewrite_dense(t: torch.Tensor, rw: Rewrite) -> torch.Tensor:
    if rw.squeeze:
        t = t.squeeze()
    if rw.rows is not None:
        t = t[rw.rows]
    if rw.cols is not None:
        t = t[:, rw.cols]
    if rw.value is not None:
        t = rw.value(t)
    return t



def rope_freqs_rows(cfg: ModelConfig) -> list:
    """The rope_freqs tensor llama.cpp reads for llama3 rope scaling, as a planned row ([] without that scaling)."""
    factors = rope_factors(cfg)
    if factors is None:
        return []
    name = _gguf().TENSOR_NAMES[_gguf().MODEL_TENSOR.ROPE_FREQS] + ".weight"
    return [(name, factors, "F32", TensorRow(name, "(rope_scaling llama3)", "F32", [len(factors)], 0.0))]


def refuse_inexact(bad: list[str], inexact: str, what: str = "quantized tensors") -> None:
    """With inexact == "error", quantized tensors whose scales fp16 cannot hold exactly are a one-line error."""
    if bad and inexact == "error":
        raise SpecquantError(f"{len(bad)} {what} have scales that fp16 cannot hold exactly (e.g. "
                             f"{bad[0]}); re-quantize with --dtype float16, or export with --inexact warn")

def plan_tensors(src: Source, dense_dtype: str = "f32", inexact: str = "error"):
    """[(gguf name, array, GGUF type, TensorRow)] for every tensor, after the exactness checks."""
    gguf = _gguf()
    cfg = src.config
    tmap = gguf.get_tensor_name_map(_gguf_arch(cfg), cfg.num_hidden_layers)
    rewrite = gguf_arch(cfg).rewrites(cfg)
    grid, dense = src.linears()

    def gname(key: str) -> str:
        name = tmap.get_name(key, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise SpecquantError(f"tensor {key!r} has no GGUF name for arch {cfg.model_type!r}")
        return name

    out, bad = [], []
    for name, w in grid.items():
        rw = rewrite(name + ".weight")
        if rw.value is not None or rw.squeeze:
            raise SpecquantError(f"{name} is quantized, but llama.cpp needs its values rewritten (not only "
                                 "reordered); keep it dense when quantizing (--ignore)")
        w = _rewrite_grid(name, w, rw)
        data, kind, inexact_mask = encode(name, w)
        err, nbad = 0.0, int(inexact_mask.sum())
        if nbad:
            err = float(np.abs(dequantize_blocks(data, kind) - w.values().numpy()).max())
            bad.append(f"{name}: {nbad} of {inexact_mask.size} blocks, max |error| {err:.3g}")
        row = TensorRow(gname(rw.name or name + ".weight"), name + ".weight", kind, list(w.codes.shape), err, nbad)
        out.append((row.name, data, kind, row))
    dense_kind = DENSE_TYPES[dense_dtype][0]
    for key, t in dense.items():
        if key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue  # tied: llama.cpp reads token_embd for the output
        if key.endswith("rotary_emb.inv_freq"):
            continue
        if not t.is_floating_point():
            raise SpecquantError(f"tensor {key!r} has dtype {t.dtype}; only floating tensors and packed Linears export")
        rw = rewrite(key)
        t = _rewrite_dense(t, rw)
        # norms, biases (1-D) stay F32 as in llama.cpp's own converter; matrices take the chosen dense type
        kind = dense_kind if t.dim() == 2 and not rw.squeeze else "F32"
        arr, err = _dense_array(t, kind)
        row = TensorRow(gname(rw.name or key), key, kind, list(t.shape), err)
        out.append((row.name, arr, kind, row))
    out += rope_freqs_rows(cfg)
    out.sort(key=lambda item: _tensor_order(item[0]))
    refuse_inexact(bad, inexact)
    for b in bad:
        log.warning("inexact GGUF export: %s", b)
    return out


def write_gguf(src: Source, out_path, dense_dtype: str = "f32", inexact: str = "error") -> dict:
    """Write src as one GGUF file atomically (temporary file, then rename). Returns a report dict."""
    gguf = _gguf()
    out_path = Path(out_path)
    cfg = src.config
    if cfg.sliding_window:
        log.warning("%s: sliding_window=%d is not carried by llama.cpp's %s arch; it will attend to the full "
                    "context (lossless as a drafter, but its drafts differ from ours)", src.name, cfg.sliding_window,
                    cfg.model_type)
    planned = plan_tensors(src, dense_dtype, inexact)
    kinds = [k for _, _, k, row in planned if row.source.endswith(".weight") and len(row.shape) == 2]
    main = main_kind(kinds)

    def metadata(writer):
        writer.add_name(src.name)
        add_hparams(writer, cfg, int(gguf.LlamaFileType[FILE_TYPES[main]]))
        return add_tokenizer(writer, src)

    vocab = write_file(out_path, gguf.MODEL_ARCH_NAMES[_gguf_arch(cfg)], planned, metadata)
    return file_report(out_path, cfg.model_type, main, planned, vocab)


def main_kind(kinds: list[str]) -> str:
    """The file type a GGUF declares: its most common quantized matrix kind (else its most common dense one)."""
    return max(set(kinds), key=lambda k: (k.startswith("Q"), kinds.count(k)))


def write_file(out_path: Path, arch_name: str, planned, metadata) -> dict:
    """Write one GGUF atomically (a temporary file in the same directory, then a rename; removed on any failure):
    metadata(writer) adds the keys and returns the tokenizer report, then planned's tensors follow as they are."""
    gguf = _gguf()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{out_path.name}.", suffix=".tmp", dir=out_path.parent)
    os.close(fd)
    try:
        writer = gguf.GGUFWriter(tmp, arch_name)
        vocab = metadata(writer)
        for name, arr, kind, _ in planned:
            raw = None if kind in ("F32", "F16") else gguf.GGMLQuantizationType[kind]
            writer.add_tensor(name, arr, raw_dtype=raw)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, out_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return vocab


def file_report(out_path: Path, arch: str, main: str, planned, vocab: dict, **extra) -> dict:
    """What write_gguf / write_dflash_gguf return: the file, its kinds and the worst error of each class."""
    rows = [row for *_, row in planned]
    return {"path": str(out_path), "arch": arch, "file_type": main, "bytes": out_path.stat().st_size,
            "tensors": len(rows), "inexact_tensors": sum(r.inexact_blocks > 0 for r in rows),
            "max_abs_error_quantized": max((r.max_abs_error for r in rows if r.kind.startswith("Q")), default=0.0),
            "max_abs_error_dense": max((r.max_abs_error for r in rows if not r.kind.startswith("Q")), default=0.0),
            "vocab": vocab, **extra, "rows": [r.__dict__ for r in rows]}
