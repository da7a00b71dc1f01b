"""The block drafter as llama.cpp's dflash GGUF (export/gguf_dflash.py): the layout its loader reads, our weights
bit for bit, and the refusals. Running it inside llama.cpp is tested in test_export_llama_cpp.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from specquant.errors import SpecquantError  # noqa: E402
from specquant.export.config import ExportConfig  # noqa: E402
from specquant.export.gguf import _grid_weight  # noqa: E402
from specquant.export.gguf_dflash import extract_layers, write_dflash_gguf  # noqa: E402
from specquant.export.llama_cpp import export_llama_cpp  # noqa: E402
from specquant.model.block_draft import BlockDraftConfig  # noqa: E402
from specquant.model.checkpoint import BUNDLED_DIR, load_tensors, read_hf_config  # noqa: E402

# what src/models/dflash.cpp creates for a plain (not DFlash2 / DSpark) drafter without its own embeddings or head
LAYER_TENSORS = ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "attn_q_norm", "attn_k_norm", "ffn_norm",
                 "ffn_gate", "ffn_up", "ffn_down")


def _fields(reader) -> dict:
    out = {}
    for name, f in reader.fields.items():
        if f.types and f.types[0] == gguf.GGUFValueType.ARRAY:
            if f.types[-1] == gguf.GGUFValueType.STRING:
                continue
            out[name] = [int(f.parts[i][0]) for i in f.data]
        elif f.types and f.types[0] == gguf.GGUFValueType.STRING:
            out[name] = bytes(f.parts[-1]).decode()
        elif f.types:
            out[name] = f.parts[-1][0].item()
    return out


def test_f32_export_has_dflash_layout_and_our_weights(tmp_path):
    path = tmp_path / "draft.gguf"
    report = write_dflash_gguf("tiny-block-draft", "tiny-target", path)
    cfg = BlockDraftConfig.from_hf(read_hf_config(BUNDLED_DIR / "tiny-block-draft"))
    reader = gguf.GGUFReader(path)
    kv = _fields(reader)
    assert kv["general.architecture"] == "dflash"
    # llama.cpp taps layer inputs: the input of layer l + 1 is our output of layer l
    assert kv["dflash.target_layers"] == [i + 1 for i in cfg.target_layer_ids] == report["target_layers"]
    assert kv["dflash.block_size"] == cfg.block_size == 16
    assert kv["dflash.attention.causal"] is False
    assert kv["tokenizer.ggml.mask_token_id"] == cfg.mask_token_id == 3
    assert kv["dflash.embedding_length"] == cfg.hidden_size and kv["dflash.block_count"] == cfg.num_hidden_layers
    assert kv["dflash.attention.head_count_kv"] == cfg.num_key_value_heads
    assert "dflash.attention.sliding_window" not in kv
    names = {t.name for t in reader.tensors}
    # no token_embd / output: the target's are shared through the draft context's ctx_other
    assert names == {"fc.weight", "enc.output_norm.weight", "output_norm.weight"} | {
        f"blk.{i}.{t}.weight" for i in range(cfg.num_hidden_layers) for t in LAYER_TENSORS}
    ours = load_tensors(BUNDLED_DIR / "tiny-block-draft")
    by_name = {r["name"]: r["source"] for r in report["rows"]}
    assert by_name["fc.weight"] == "fc.weight" and by_name["enc.output_norm.weight"] == "hidden_norm.weight"
    assert by_name["output_norm.weight"] == "norm.weight"
    assert by_name["blk.1.attn_output.weight"] == "layers.1.self_attn.o_proj.weight"
    for t in reader.tensors:  # bf16 -> F32 is exact
        want = ours[by_name[t.name]].float().numpy()
        np.testing.assert_array_equal(np.asarray(t.data).reshape(want.shape), want)


def test_w4_export_is_our_codes_exactly(w4_block_draft, tmp_path):
    src = w4_block_draft
    path = tmp_path / "w4.gguf"
    report = write_dflash_gguf(src, "tiny-target", path, dense_dtype="bf16")
    assert report["file_type"] == "Q4_0" and report["max_abs_error_quantized"] == 0.0
    tensors = load_tensors(src)
    rows = {r["name"]: r for r in report["rows"]}
    reader = gguf.GGUFReader(path)
    quantized = [t for t in reader.tensors if t.tensor_type == gguf.GGMLQuantizationType.Q4_0]
    assert {t.name.split(".")[-2] for t in quantized} == {"fc", "attn_q", "attn_k", "attn_v", "attn_output",
                                                         "ffn_gate", "ffn_up", "ffn_down"}
    for t in quantized:
        ours = _grid_weight(rows[t.name]["source"].removesuffix(".weight"), tensors).values().numpy()
        got = gguf.quants.dequantize(np.asarray(t.data), gguf.GGMLQuantizationType.Q4_0).reshape(ours.shape)
        np.testing.assert_array_equal(got, ours)


def test_refusals():
    cfg = BlockDraftConfig(num_target_layers=8, target_layer_ids=[1, 7])
    with pytest.raises(SpecquantError, match=r"target_layer_ids \[7\] tap the target's last layer"):
        extract_layers(cfg)
    assert extract_layers(BlockDraftConfig(num_target_layers=8, target_layer_ids=[0, 6])) == [1, 7]
    with pytest.raises(SpecquantError, match="is not a block drafter"):
        write_dflash_gguf("tiny-draft", "tiny-target", "/nonexistent/x.gguf")


def test_refuses_a_drafter_for_another_target(tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(BUNDLED_DIR / "tiny-block-draft", other)
    hf = read_hf_config(other)
    hf["num_target_layers"] = 12
    (other / "config.json").write_text(json.dumps(hf))
    with pytest.raises(SpecquantError, match="num_target_layers=12 but the target has 8"):
        write_dflash_gguf(other, "tiny-target", tmp_path / "x.gguf")


def test_export_for_llama_cpp_writes_the_pair_and_a_dflash_command(tmp_path):
    out = tmp_path / "out"
    report = export_llama_cpp("tiny-target", "tiny-block-draft", out, ExportConfig())
    assert (out / "target.gguf").is_file() and (out / "draft.gguf").is_file()
    assert report["files"]["draft"]["arch"] == "dflash" and report["files"]["target"]["arch"] == "qwen3"
    for name in ("llama-server", "llama-speculative-simple"):
        cmd = report["commands"][name]
        # the whole trained block (anchor + 15), whatever --num-speculative-tokens says
        assert "--spec-type draft-dflash --spec-draft-n-max 15" in cmd and str(out / "draft.gguf") in cmd
    lm = export_llama_cpp("tiny-target", "tiny-draft", tmp_path / "lm", ExportConfig(num_speculative_tokens=4))
    assert "--spec-type draft-simple --spec-draft-n-max 4" in lm["commands"]["llama-server"]


def test_sliding_window_is_carried_on_every_layer(tmp_path):
    import shutil

    drafter = tmp_path / "drafter"
    shutil.copytree(BUNDLED_DIR / "tiny-block-draft", drafter)
    hf = read_hf_config(drafter)
    hf["specquant_sliding_window"] = 16
    (drafter / "config.json").write_text(json.dumps(hf))
    write_dflash_gguf(drafter, "tiny-target", tmp_path / "w.gguf")
    kv = _fields(gguf.GGUFReader(tmp_path / "w.gguf"))
    # llama.cpp's standard SWA (key at pos visible from p when p - pos < W) is our window rule
    assert kv["dflash.attention.sliding_window"] == 16
    assert kv["dflash.attention.sliding_window_pattern"] == [1, 1]
