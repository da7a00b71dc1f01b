"""`specquant export`: vLLM layout + speculative config (checked against vLLM's SpeculativeConfig fields), the
llama.cpp command lines, drafter-kind detection and the --out safety rules."""

from __future__ import annotations

import json
import shlex

import pytest
import torch

from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.export.config import REPORT, ExportConfig
from specquant.export.vllm import drafter_kind, speculative_config, tp_notes
from specquant.loader import load_model
from specquant.model.checkpoint import BUNDLED_DIR, read_hf_config

# The fields of vLLM's SpeculativeConfig that we write, with their types and allowed values. Read from vLLM's
# vllm/config/speculative.py (vllm-project/vllm at commit 002e77c, the v0.1x line): `num_speculative_tokens`
# (int, gt=0), `model` (str), `method` (SpeculativeMethod literal; "draft_model" for a separate LM, "dflash" for a
# DFlash block drafter), `draft_tensor_parallel_size` (int, ge=1; 1 or the target's TP), `quantization`
# (QuantizationMethods name, e.g. "compressed-tensors").
VLLM_SPEC_SCHEMA = {
    "num_speculative_tokens": (int, lambda v: v > 0),
    "model": (str, lambda v: len(v) > 0),
    "method": (str, lambda v: v in {"ngram", "medusa", "mlp_speculator", "draft_model", "suffix", "eagle", "eagle3",
                                    "dflash"}),
    "draft_tensor_parallel_size": (int, lambda v: v >= 1),
    "quantization": (str, lambda v: v in {"compressed-tensors", "awq", "gptq", "fp8"}),
}


def check_vllm_spec(spec: dict):
    unknown = set(spec) - set(VLLM_SPEC_SCHEMA)
    assert not unknown, f"fields vLLM's SpeculativeConfig lacks: {unknown}"
    for key, value in spec.items():
        kind, ok = VLLM_SPEC_SCHEMA[key]
        assert isinstance(value, kind) and ok(value), (key, value)


@pytest.fixture(scope="module")
def w4_draft(tmp_path_factory):
    from specquant.quant.checkpoint import save_quantized
    from specquant.quant.config import QuantConfig
    from specquant.quant.pipeline import quantize

    model = load_model("tiny-draft", torch.float32)
    cfg = QuantConfig(method="rtn", group_size=32)
    quantize(model, cfg, scale_dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    return save_quantized(model, tmp_path_factory.mktemp("w4") / "draft", tokenizer_from="tiny-draft", cfg=cfg)


def test_vllm_export_command_line_and_spec_config(tmp_path, w4_draft, capsys):
    out = tmp_path / "vllm"
    assert main(["export", "--target", "tiny-target", "--draft", str(w4_draft), "--out", str(out), "--for", "vllm",
                 "--num-speculative-tokens", "4", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    spec = report["speculative_config"]
    check_vllm_spec(spec)
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 4
    assert spec["quantization"] == "compressed-tensors" and spec["model"] == str((out / "draft").resolve())
    argv = shlex.split(report["command"])
    assert argv[:3] == ["vllm", "serve", str((out / "target").resolve())]
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == spec
    assert "--quantization" not in argv  # the bundled target is dense
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # copied as is: vLLM reads our format
        assert (out / "draft" / name).read_bytes() == (w4_draft / name).read_bytes()
        assert (out / "target" / name).read_bytes() == (BUNDLED_DIR / "tiny-target" / name).read_bytes()
    assert (out / "serve.sh").read_text().splitlines()[1] == report["command"]
    assert json.loads((out / REPORT).read_text())["command"] == report["command"]


def test_vllm_tensor_parallel_divisibility():
    target, draft = read_hf_config(BUNDLED_DIR / "tiny-target"), read_hf_config(BUNDLED_DIR / "tiny-draft")
    notes = tp_notes(target, draft, 2)
    assert any("6 heads, 2 KV heads" in n for n in notes)
    with pytest.raises(SpecquantError, match="does not divide the target's 6 heads / 2 KV heads"):
        tp_notes(target, draft, 4)


def test_block_drafter_detected_or_named_missing():
    dflash = {"architectures": ["DFlashDraftModel"], "block_size": 16,
              "dflash_config": {"target_layer_ids": [1, 4, 7], "mask_token_id": 3}, "model_type": "qwen3"}
    assert drafter_kind(dflash).name == "block" and drafter_kind(dflash).vllm_method == "dflash"
    spec = speculative_config(BUNDLED_DIR, dflash, ExportConfig())
    check_vllm_spec(spec)
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 15
    with pytest.raises(SpecquantError, match="lacks dflash_config.target_layer_ids, dflash_config.mask_token_id"):
        drafter_kind({"architectures": ["DFlashDraftModel"], "block_size": 16})
    with pytest.raises(SpecquantError, match="none of the drafter kinds block, lm"):
        drafter_kind({"model_type": "gpt2"})
    assert drafter_kind(read_hf_config(BUNDLED_DIR / "tiny-draft")).name == "lm"


def test_llama_cpp_export_prints_speculative_command(tmp_path, w4_draft, capsys):
    out = tmp_path / "gguf"
    assert main(["export", "--target", str(w4_draft), "--draft", "tiny-draft", "--out", str(out), "--for",
                 "llama.cpp", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["files"]["target"]["file_type"] == "Q4_0" and report["files"]["draft"]["file_type"] == "F32"
    spec = shlex.split(report["commands"]["llama-speculative-simple"])
    assert spec[spec.index("-md") + 1] == str((out / "draft.gguf").resolve())
    assert spec[spec.index("--spec-draft-n-max") + 1] == str(ExportConfig().num_speculative_tokens)
    assert "llama-server" in report["commands"] and (out / "target.gguf").exists()


def test_out_rules(tmp_path, capsys):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("not ours")
    argv = ["export", "--target", "tiny-draft", "--for", "vllm"]
    assert main(argv + ["--out", str(foreign)]) == 2
    assert main(argv + ["--out", str(foreign), "--overwrite"]) == 2  # not made by export: never replaced
    assert (foreign / "keep.txt").read_text() == "not ours"
    ours = tmp_path / "ours"
    assert main(argv + ["--out", str(ours)]) == 0
    assert main(argv + ["--out", str(ours)]) == 2
    assert main(argv + ["--out", str(ours), "--overwrite"]) == 0
    err = capsys.readouterr().err
    assert "was not written by `specquant export`" in err and "pass --overwrite" in err
    with pytest.raises(SystemExit):
        main(["export", "--target", "tiny-draft", "--for", "onnx", "--out", str(tmp_path / "x")])
    assert main(["export", "--target", "tiny-draft", "--for", "vllm", "--tensor-parallel-size", "0",
                 "--out", str(tmp_path / "x")]) == 2
    assert not (tmp_path / "x").exists()
