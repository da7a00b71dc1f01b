"""GGUF export: every tensor, dequantized by the gguf package's own reference dequantizer, equals our weights.

No llama.cpp binary is needed here (tests/test_export_llama_cpp.py runs the engine itself)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import random_model
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.checkpoint import BUNDLED_DIR
from specquant.quant.checkpoint import save_quantized
from specquant.quant.config import QuantConfig
from specquant.quant.grid import dequantize
from specquant.quant.linear import QuantLinear
from specquant.quant.pipeline import quantize

gguf = pytest.importorskip("gguf")

from specquant.export.gguf import source_from_checkpoint, source_from_model, write_gguf  # noqa: E402
from specquant.export.gguf_arch import _llama_permute  # noqa: E402  (after the importorskip)

TOKENIZER = BUNDLED_DIR / "tiny-target"
VOCAB = 8192  # the bundled tokenizer's


def _quantized_checkpoint(tmp_path, model_type="qwen3", scale_dtype=torch.bfloat16, **quant) -> tuple:
    """A random model (bundled vocabulary) RTN-quantized and saved as compressed-tensors; (dir, loaded model)."""
    model = random_model(model_type, vocab_size=VOCAB, hidden_size=128, head_dim=32, intermediate_size=256,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=0)
    cfg = QuantConfig(method="rtn", **quant)
    quantize(model, cfg, scale_dtype=scale_dtype)
    model.to(scale_dtype)
    out = save_quantized(model, tmp_path / "ckpt", tokenizer_from=TOKENIZER, cfg=cfg)
    return out, load_model(out, dtype=scale_dtype)


def _read(path) -> dict[str, np.ndarray]:
    """{GGUF name: float32 array in numpy [rows, cols] order} via gguf.quants.dequantize (the reference)."""
    reader = gguf.GGUFReader(path)
    out = {}
    for t in reader.tensors:
        deq = gguf.quants.dequantize(t.data, t.tensor_type)
        out[t.name] = (deq, t.tensor_type.name)
    return out


def _expected(model, model_type: str) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """{GGUF name: (exact grid values in fp32, our dequantized weight in the model dtype | None)}."""
    tmap = gguf.get_tensor_name_map(getattr(gguf.MODEL_ARCH, model_type.upper()), model.config.num_hidden_layers)
    cfg = model.config
    exp = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            exact = dequantize(m.codes(), m.weight_scale.float(), m.zero_point())
            ours = m.dequantized_weight()
            if cfg.model_type == "llama" and name.endswith(("q_proj", "k_proj")):
                heads = cfg.num_attention_heads if name.endswith("q_proj") else cfg.num_key_value_heads
                exact, ours = _llama_permute(exact, heads), _llama_permute(ours, heads)
            exp[tmap.get_name(name + ".weight", try_suffixes=(".weight",))] = (exact, ours)
    for key, t in model.state_dict().items():
        if key.endswith(".bias") or key.endswith(".weight") and not isinstance(
                model.get_submodule(key.rpartition(".")[0]), QuantLinear):
            if key == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            exp[tmap.get_name(key, try_suffixes=(".weight", ".bias"))] = (t.float(), None)
    return exp


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)


@pytest.mark.parametrize("quant,kind", [
    (dict(group_size=32), "Q4_0"),
    (dict(group_size=128), "Q4_0"),
    (dict(group_size=-1), "Q4_0"),
    (dict(group_size=64, bits=8), "Q8_0"),
])
def test_gguf_export_is_lossless_against_reference_dequantizer(tmp_path, quant, kind):
    """The lossless-export test: each GGUF tensor dequantized by gguf.quants is bit-identical to our grid values
    (c - z)·s, and rounding it to the model dtype gives exactly QuantLinear.dequantized_weight()."""
    ckpt, model = _quantized_checkpoint(tmp_path, **quant)
    report = write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf")
    assert report["file_type"] == kind and report["inexact_tensors"] == 0
    got, expected = _read(tmp_path / "m.gguf"), _expected(model, "qwen3")
    assert set(got) == set(expected)
    n_quant = 0
    for name, (exact, ours) in expected.items():
        deq, tname = got[name]
        deq = deq.reshape(exact.shape)
        assert np.array_equal(_bits(deq), _bits(exact.numpy())), name
        if ours is not None:
            n_quant += 1
            assert tname == kind
            assert torch.equal(torch.from_numpy(deq).to(ours.dtype), ours), name
    assert n_quant == 7 * model.config.num_hidden_layers


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gguf_export_lossless_other_families(tmp_path, model_type):
    """Llama (q/k rows permuted for llama.cpp's RoPE layout) and Qwen2 (q/k/v biases) export the same grid."""
    ckpt, model = _quantized_checkpoint(tmp_path, model_type, group_size=64)
    write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf")
    got, expected = _read(tmp_path / "m.gguf"), _expected(model, model_type)
    assert set(got) == set(expected)
    for name, (exact, _) in expected.items():
        assert np.array_equal(_bits(got[name][0].reshape(exact.shape)), _bits(exact.numpy())), name
    if model_type == "qwen2":
        assert "blk.0.attn_q.bias" in got


def test_model_and_checkpoint_sources_write_the_same_tensors(tmp_path):
    ckpt, model = _quantized_checkpoint(tmp_path, group_size=32)
    write_gguf(source_from_checkpoint(ckpt), tmp_path / "a.gguf")
    write_gguf(source_from_model(model, TOKENIZER, name="ckpt"), tmp_path / "b.gguf")
    a, b = gguf.GGUFReader(tmp_path / "a.gguf"), gguf.GGUFReader(tmp_path / "b.gguf")
    assert [t.name for t in a.tensors] == [t.name for t in b.tensors]
    for ta, tb in zip(a.tensors, b.tensors):
        assert ta.tensor_type == tb.tensor_type and np.array_equal(ta.data, tb.data), ta.name


def test_inexact_scales_fail_or_warn_with_the_measured_error(tmp_path, caplog):
    """float32 scales are not fp16 numbers: refused by default; with inexact='warn' the reported error is the
    true max |difference| and only flagged tensors differ."""
    ckpt, model = _quantized_checkpoint(tmp_path, scale_dtype=torch.float32, group_size=32)
    with pytest.raises(SpecquantError, match="fp16 cannot hold exactly"):
        write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists() and not list(tmp_path.glob(".m.gguf*"))
    report = write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf", inexact="warn")
    assert report["inexact_tensors"] > 0 and "inexact GGUF export" in caplog.text
    got, expected = _read(tmp_path / "m.gguf"), _expected(model, "qwen3")
    worst = max(float(np.abs(got[n][0].reshape(e.shape) - e.numpy()).max()) for n, (e, o) in expected.items()
                if o is not None)
    assert worst > 0 and report["max_abs_error_quantized"] == pytest.approx(worst, rel=0, abs=0)


def test_asymmetric_exports_as_q4_1_exact_where_fp16_holds_the_offset(tmp_path):
    """Q4_1 stores m = -s·(z + 8) in fp16: exact blocks are bit-identical, the others are flagged and bounded."""
    ckpt, model = _quantized_checkpoint(tmp_path, scale_dtype=torch.float16, group_size=32, symmetric=False)
    try:
        report = write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf")
    except SpecquantError as e:
        assert "fp16 cannot hold exactly" in str(e)
        report = write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf", inexact="warn")
    assert report["file_type"] == "Q4_1"
    got, expected = _read(tmp_path / "m.gguf"), _expected(model, "qwen3")
    rows = {r["name"]: r for r in report["rows"]}
    for name, (exact, ours) in expected.items():
        deq = got[name][0].reshape(exact.shape)
        err = float(np.abs(deq - exact.numpy()).max())
        assert err == rows[name]["max_abs_error"], name
        if rows[name]["inexact_blocks"] == 0:
            assert np.array_equal(_bits(deq), _bits(exact.numpy())), name
        else:  # one fp16 rounding of m: at most half an fp16 ulp of |m| <= 15·s
            assert err <= 15 * float(model.get_submodule(rows[name]["source"][:-7]).weight_scale.max()) * 2 ** -11


def test_dense_export_f32_exact_and_dense_dtype_choice(tmp_path):
    """The bundled bf16 draft written as F32 is exact; BF16 too; norms stay F32 whatever the choice."""
    r32 = write_gguf(source_from_checkpoint("tiny-draft"), tmp_path / "f32.gguf")
    rbf = write_gguf(source_from_checkpoint("tiny-draft"), tmp_path / "bf16.gguf", dense_dtype="bf16")
    assert r32["file_type"] == "F32" and rbf["file_type"] == "BF16"
    assert r32["max_abs_error_dense"] == 0.0 and rbf["max_abs_error_dense"] == 0.0
    model = load_model("tiny-draft")
    got, expected = _read(tmp_path / "bf16.gguf"), _expected(model, "qwen3")
    assert "output.weight" not in got  # tied embeddings: llama.cpp reads token_embd
    for name, (exact, _) in expected.items():
        deq, tname = got[name]
        assert tname == ("F32" if exact.dim() == 1 else "BF16")
        assert np.array_equal(_bits(deq.reshape(exact.shape)), _bits(exact.numpy())), name


def test_tokenizer_metadata(tmp_path):
    write_gguf(source_from_checkpoint("tiny-draft"), tmp_path / "m.gguf")
    reader = gguf.GGUFReader(tmp_path / "m.gguf")

    def field(key):
        f = reader.fields[key]
        return f.contents()

    assert field("tokenizer.ggml.model") == "gpt2" and field("tokenizer.ggml.pre") == "gpt-2"
    tokens = field("tokenizer.ggml.tokens")
    assert len(tokens) == VOCAB and tokens[0] == "<|endoftext|>"
    assert field("tokenizer.ggml.eos_token_id") == 0 and field("tokenizer.ggml.add_bos_token") is False
    assert field("qwen3.attention.head_count_kv") == 2 and field("qwen3.rope.freq_base") == 10000.0


# --- Qwen3.5 hybrids (llama.cpp's qwen35) -----------------------------------------------------------------------

# DeltaNet heads of 32 so every value-head block is whole GGUF blocks; 2 key heads for 4 value heads so the
# converter's value-head reorder is exercised; one full-attention layer of four
HYBRID = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, linear_key_head_dim=32, linear_value_head_dim=32,
              head_dim=32, eos_token_id=0, bos_token_id=None)


def hybrid_checkpoint(path, seed: int = 0, **over):
    """A random Qwen3_5ForCausalLM (transformers' own, bundled tokenizer) saved as safetensors at `path`."""
    from _qwen35_models import hf_model

    from specquant.model.checkpoint import copy_tokenizer

    hf_model("gva", 4, seed=seed, **{**HYBRID, **over}).save_pretrained(path, safe_serialization=True)
    copy_tokenizer(TOKENIZER, path)
    return path


def hybrid_w4(dense, out, **quant):
    """RTN W4 of a hybrid checkpoint with bf16 scales, saved as compressed-tensors; (dir, loaded model)."""
    model = load_model(dense, dtype=torch.float32)
    cfg = QuantConfig(method="rtn", **quant)
    quantize(model, cfg, scale_dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    path = save_quantized(model, out, tokenizer_from=dense, cfg=cfg)
    return path, load_model(path, dtype=torch.bfloat16)


def _tiled(x: torch.Tensor, dim: int, nk: int, nv: int, d: int) -> torch.Tensor:
    """The converter's value-head reorder along `dim` (conversion/qwen.py, _reorder_v_heads): grouped by key head
    [nk, nv/nk, d] -> tiled [nv/nk, nk, d]."""
    shape = list(x.shape)
    x = x.reshape(*shape[:dim], nk, nv // nk, d, *shape[dim + 1:])
    return x.transpose(dim, dim + 1).reshape(shape)


def _qwen35_reference(key: str, t: torch.Tensor, cfg) -> tuple[str, torch.Tensor]:
    """(checkpoint name llama.cpp's tensor map knows, the values it must read) for one tensor, as the converter
    (Qwen3_5TextModel) rewrites it; written from the converter's semantics, not from export/gguf.py."""
    nk, nv, d = cfg.linear_num_key_heads, cfg.linear_num_value_heads, cfg.linear_value_head_dim
    qk = 2 * nk * cfg.linear_key_head_dim
    t = t.float()
    if ".linear_attn." in key:
        if key.endswith("in_proj_qkv.weight") or key.endswith("conv1d.weight"):
            t = t.squeeze()
            t = torch.cat([t[:qk], _tiled(t[qk:], 0, nk, nv, d)])
        elif key.endswith("in_proj_z.weight"):
            t = _tiled(t, 0, nk, nv, d)
        elif key.endswith(("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias")):
            t = _tiled(t, 0, nk, nv, 1)
        elif key.endswith("out_proj.weight"):
            t = _tiled(t, 1, nk, nv, d)
        if key.endswith("A_log"):
            t = -t.exp()
        if key.endswith("dt_bias"):
            key = key.replace("dt_bias", "dt_proj.bias")
    elif key.endswith("norm.weight"):
        t = t + 1
    return key, t


def _check_qwen35(path, model, kind: str | None):
    """Every tensor of the GGUF at `path`, dequantized by gguf.quants, is bit-identical to the converter's rewrite of
    our tensor (quantized Linears: of their exact grid values); returns {GGUF name: type name}."""
    cfg = model.config
    tmap = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN35, cfg.num_hidden_layers)
    got = _read(path)
    expected = {}
    for name, m in model.named_modules():
        if isinstance(m, QuantLinear):
            key, exact = _qwen35_reference(name + ".weight", dequantize(m.codes(), m.weight_scale.float(),
                                                                         m.zero_point()), cfg)
            expected[tmap.get_name(key, try_suffixes=(".weight",))] = (exact, kind)
    for key, t in model.state_dict().items():
        owner = model.get_submodule(key.rpartition(".")[0]) if "." in key else None
        if isinstance(owner, QuantLinear) or key == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        key, ref = _qwen35_reference(key, t, cfg)
        expected[tmap.get_name(key, try_suffixes=(".weight", ".bias"))] = (ref, None)
    assert set(got) == set(expected)
    for name, (ref, k) in expected.items():
        deq, tname = got[name]
        assert np.array_equal(_bits(deq.reshape(ref.shape)), _bits(ref.numpy())), name
        if k is not None:
            assert tname == k, name
    return {n: t for n, (_, t) in got.items()}


@pytest.fixture(scope="module")
def hybrid_dense(tmp_path_factory):
    return hybrid_checkpoint(tmp_path_factory.mktemp("hybrid") / "dense")


@pytest.mark.parametrize("quant,kind", [
    (dict(group_size=32), "Q4_0"),
    (dict(group_size=-1), "Q4_0"),  # one scale over out_proj's four value heads, carried to every moved block
    (dict(group_size=64, bits=8), "Q8_0"),
])
def test_qwen35_export_is_exact_against_the_converters_layout(tmp_path, hybrid_dense, quant, kind):
    """A W4 (or W8) hybrid as qwen35: every quantized Linear the checkpoint holds keeps our codes and scales bit for
    bit after the value-head reorder (rows of in_proj_qkv's v part, in_proj_z, in_proj_a/b; 32-column blocks of
    out_proj), and every dense tensor is the converter's rewrite (norms + 1, A_log -> -e^A, dt_bias, conv1d)."""
    ckpt, model = hybrid_w4(hybrid_dense, tmp_path / "w4", **quant)
    report = write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf", dense_dtype="bf16")
    assert report["file_type"] == kind and report["inexact_tensors"] == 0
    types = _check_qwen35(tmp_path / "m.gguf", model, kind)
    quantized = {n for n, t in types.items() if t == kind}
    for leaf in ("attn_qkv", "attn_gate", "ssm_out", "ffn_gate", "ffn_up", "ffn_down"):
        assert f"blk.0.{leaf}.weight" in quantized, leaf
    for leaf in ("attn_q", "attn_k", "attn_v", "attn_output"):
        assert f"blk.3.{leaf}.weight" in quantized, leaf
    assert types["blk.0.ssm_conv1d.weight"] == "F32" and types["blk.0.ssm_a"] == "F32"


def test_qwen35_dense_export_and_metadata(tmp_path, hybrid_dense):
    """The F32 export of the dense hybrid carries the keys llama.cpp's qwen35 loader reads, as the converter names
    them, and the rewritten tensors; the untied lm_head is written as output.weight."""
    write_gguf(source_from_checkpoint(hybrid_dense), tmp_path / "m.gguf")
    model = load_model(hybrid_dense, dtype=torch.float32)
    types = _check_qwen35(tmp_path / "m.gguf", model, None)
    assert "output.weight" in types and set(types.values()) == {"F32"}
    fields = gguf.GGUFReader(tmp_path / "m.gguf").fields

    def field(key):
        return fields[key].contents()

    cfg = model.config
    assert field("general.architecture") == "qwen35"
    assert field("qwen35.ssm.conv_kernel") == 4 and field("qwen35.ssm.state_size") == 32
    assert field("qwen35.ssm.group_count") == 2 and field("qwen35.ssm.time_step_rank") == 4
    assert field("qwen35.ssm.inner_size") == 4 * 32
    assert field("qwen35.attention.recurrent_layers") == [True, True, True, False]
    assert field("qwen35.rope.dimension_count") == cfg.rotary_dim == 8
    assert field("qwen35.attention.key_length") == 32 and field("qwen35.block_count") == 4


def test_mrope_sections_are_one_d_for_text():
    """At the 4B shape the converter's default [11, 11, 10, 0] is written; a small head gets sections that keep every
    rotary pair on the first three (equal) position axes and fit ggml's sum <= head_dim assertion."""
    from specquant.export.gguf_arch import mrope_sections
    from specquant.model.config import ModelConfig

    big = ModelConfig(model_type="qwen3_5_text", head_dim=256, partial_rotary_factor=0.25)
    assert mrope_sections(big) == [11, 11, 10, 0]
    for head_dim, factor in ((32, 0.25), (24, 0.25), (20, 0.5), (64, 1.0)):
        cfg = ModelConfig(model_type="qwen3_5_text", head_dim=head_dim, partial_rotary_factor=factor)
        sec = mrope_sections(cfg)
        assert sum(sec) <= head_dim and sec[3] == 0
        assert all(p < 3 * sec[p % 3] for p in range(cfg.rotary_dim // 2))


def test_qwen35_refusals_name_the_value(tmp_path):
    """Key and value head sizes differ (llama.cpp's qwen35 has one), or a quantized out_proj whose value heads are
    not whole 32-column blocks: one-line errors, no file left behind."""
    uneven = hybrid_checkpoint(tmp_path / "uneven", linear_value_head_dim=16)
    with pytest.raises(SpecquantError, match="linear_key_head_dim=32 != linear_value_head_dim=16"):
        write_gguf(source_from_checkpoint(uneven), tmp_path / "a.gguf")
    small = hybrid_checkpoint(tmp_path / "small", linear_key_head_dim=16, linear_value_head_dim=16,
                              intermediate_size=64)
    ckpt, _ = hybrid_w4(small, tmp_path / "w4", group_size=32, ignore=["lm_head", "embed_tokens", "in_proj_*"])
    with pytest.raises(SpecquantError, match="out_proj: llama.cpp's layout moves its input columns"):
        write_gguf(source_from_checkpoint(ckpt), tmp_path / "b.gguf")
    assert not list(tmp_path.glob("*.gguf")) and not list(tmp_path.glob(".*.gguf*"))


def qwen_tokenizer_dir(dst, family: str = "qwen3_5"):
    """The bundled vocabulary and merges behind Qwen's pre-tokenizer (transformers' own regex for `family`, split
    isolated, then byte-level without regex) and NFC normalizer, as Qwen2 / Qwen3.5 tokenizer.json files have."""
    import importlib

    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers

    from specquant.model.checkpoint import copy_tokenizer

    regex = importlib.import_module(f"transformers.models.{family}.tokenization_{family}").PRETOKENIZE_REGEX
    dst.mkdir(parents=True, exist_ok=True)
    copy_tokenizer(TOKENIZER, dst)
    tok = Tokenizer.from_file(str(dst / "tokenizer.json"))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.save(str(dst / "tokenizer.json"))
    return dst


def test_pre_tokenizer_names_and_refusals(tmp_path):
    """GPT-2's ByteLevel and Qwen2's / Qwen3.5's Split + ByteLevel map to llama.cpp's gpt-2 / qwen2 / qwen35; a
    different regex, split behaviour or normalizer is refused (llama.cpp would split the text differently)."""
    import json

    from specquant.export.gguf import pre_tokenizer_name

    assert pre_tokenizer_name(json.loads((TOKENIZER / "tokenizer.json").read_text())) == "gpt-2"
    for family, name in (("qwen3_5", "qwen35"), ("qwen2", "qwen2")):
        tok = json.loads((qwen_tokenizer_dir(tmp_path / family, family) / "tokenizer.json").read_text())
        assert pre_tokenizer_name(tok) == name
        assert pre_tokenizer_name({**tok, "normalizer": None}) == name
        assert pre_tokenizer_name({**tok, "normalizer": {"type": "NFKC"}}) is None
        split, last = tok["pre_tokenizer"]["pretokenizers"]
        for bad in ({**split, "behavior": "Removed"}, {**split, "pattern": {"Regex": split["pattern"]["Regex"][1:]}}):
            assert pre_tokenizer_name({**tok, "pre_tokenizer": {"type": "Sequence", "pretokenizers": [bad, last]}}) \
                is None
    ckpt = hybrid_checkpoint(tmp_path / "model")
    (ckpt / "tokenizer.json").write_text(json.dumps({**tok, "normalizer": {"type": "NFKC"}}))
    with pytest.raises(SpecquantError, match="not a byte-level BPE llama.cpp splits the same way"):
        write_gguf(source_from_checkpoint(ckpt), tmp_path / "m.gguf")
