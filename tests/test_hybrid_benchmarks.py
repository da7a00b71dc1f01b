"""benchmarks/shapes.py's Qwen3.5 rows and benchmarks/shapes_gguf.py, run at a tiny hybrid shape with one repetition
(what they print is checked, not how fast anything is: times are noise here), plus the floor's byte formula at the
real 4B shape, which needs no model. The shapes and their models are specquant.bench.shapes'."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_benchmark, native_switch

from specquant.bench.shapes import hybrid, random_model
from specquant.kernels import ops, w4a8


@pytest.fixture()
def bench(monkeypatch):
    """benchmarks/shapes.py imported, with a tiny hybrid beside a tiny dense model registered in the package's
    SHAPES (the dict the script reads)."""
    from specquant.model.config import ModelConfig

    shapes = load_benchmark("shapes.py")
    monkeypatch.setitem(shapes.SHAPES, "qwen3.5-tiny", lambda: hybrid(
        4, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        linear_num_key_heads=2, linear_num_value_heads=4, vocab_size=300))
    monkeypatch.setitem(shapes.SHAPES, "qwen3-tiny", lambda: ModelConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, vocab_size=300))
    monkeypatch.setitem(shapes.BESIDE, "qwen3.5-tiny", "qwen3-tiny")
    return shapes


def _run(module, argv, monkeypatch, capsys) -> tuple[str, dict]:
    monkeypatch.setattr(sys, "argv", [module.__name__ + ".py", *argv])
    module.main()
    out = capsys.readouterr().out
    return out, json.loads(out.strip().splitlines()[-1])


def test_shapes_runs_hybrid_rows_beside_dense(bench, monkeypatch, capsys):
    """Every mode's rows, the hybrid beside its dense shape; w4a8 where its kernel is built (SPECQUANT_NATIVE=off
    leaves it out, and asking for it there is refused before any row runs: the next test)."""
    shapes = bench
    modes = ("fp32", "bf16", "w4", "w4a8") if w4a8.FAMILY.library() is not None else ("fp32", "bf16", "w4")
    out, res = _run(shapes, ["--shapes", "qwen3.5-tiny,qwen3-tiny", "--modes", ",".join(modes), "--reps", "1",
                             "--context", "8", "--rows", "1,2,16", "--threads", "1"], monkeypatch, capsys)
    rows = {(r["shape"], r["mode"]) for r in res["results"]}
    assert rows == {(s, m) for s in ("qwen3.5-tiny", "qwen3-tiny") for m in modes}
    hybrid = next(r for r in res["results"] if r["shape"] == "qwen3.5-tiny" and r["mode"] == "fp32")
    assert hybrid["beside"] == "qwen3-tiny" and set(hybrid["verify_steps"]) == {"2", "16"}
    assert hybrid["per_rows"]["1"]["rule_ms"] > 0  # the DeltaNet rule is timed apart
    assert {(c["shape"], c["mode"]) for c in res["beside"]} == {("qwen3.5-tiny", m) for m in modes}
    assert "beside qwen3-tiny: step time x" in out
    for mode in modes[2:]:  # the W4 hybrid rows have the same breakdown, the DeltaNet rule included
        w4 = next(r for r in res["results"] if r["shape"] == "qwen3.5-tiny" and r["mode"] == mode)
        assert w4["per_rows"]["1"]["rule_ms"] > 0 and w4["per_rows"]["1"]["linears_ms"] > 0
        assert w4["llama_cpp_gguf"] is None and 0 < w4["weight_bytes"] < hybrid["weight_bytes"]
    dense_w4 = next(r for r in res["results"] if r["shape"] == "qwen3-tiny" and r["mode"] == "w4")
    assert dense_w4["dense_layer_linears"] == []


def test_shapes_refuses_what_it_cannot_run(bench, monkeypatch, capsys):
    """An unknown mode, and w4a8 without its kernel, end in one line naming the mode, before any row is built."""
    shapes = bench
    with pytest.raises(SystemExit, match="unknown mode 'w5'; known: fp32, bf16, w4, w4a8"):
        _run(shapes, ["--shapes", "qwen3-tiny", "--modes", "fp32,w5"], monkeypatch, capsys)
    with native_switch(monkeypatch, "off"):
        with pytest.raises(SystemExit, match="mode w4a8 needs the native W4A8 kernel.*SPECQUANT_NATIVE=off"):
            _run(shapes, ["--shapes", "qwen3-tiny", "--modes", "w4,w4a8"], monkeypatch, capsys)
        assert "streamed read bandwidth" not in capsys.readouterr().out  # refused before anything ran


def test_w4_hybrid_quantizes_what_specquant_quantize_would(bench):
    """The W4 row's dense layer Linears are exactly the ones the quantizer's own selection leaves (DENSE_BY_KIND:
    in_proj_a / in_proj_b of every DeltaNet layer), every other layer Linear is a QuantLinear with bf16 scales, the
    dense Linears and the head are stored bf16 as the engines load them, and the rest of the model is float32."""
    from specquant.quant.config import QuantConfig
    from specquant.quant.linear import QuantLinear
    from specquant.quant.pipeline import kept_dense, target_linears

    shapes = bench
    cfg = shapes.SHAPES["qwen3.5-tiny"]()
    fresh = random_model(cfg, torch.bfloat16)
    kept = kept_dense(fresh)
    assert kept == {f"model.layers.{i}.linear_attn.in_proj_{ab}" for i in (0, 1, 2) for ab in "ab"}
    quantized = set(target_linears(fresh, QuantConfig(group_size=32)))
    assert not quantized & kept and "lm_head" not in quantized
    model = shapes.build(cfg, "w4", "dense")
    assert set(shapes.dense_layer_linears(model)) == kept
    n_quant = sum(isinstance(m, QuantLinear) for m in model.modules())
    # fused after quantizing: gate/up -> one module in each of the 4 layers, q/k/v -> one in the attention layer
    assert n_quant == len(quantized) - 4 * 1 - 1 * 2
    assert all(m.weight_scale.dtype == torch.bfloat16 for m in model.modules() if isinstance(m, QuantLinear))
    # as the engines load it (model/bf16_store.py): the dense Linears, the head's own copy of the tied embedding
    # among them, hold bf16 values and are stored bf16, the same values; everything else is float32
    # (only where the native library runs: without it nothing is stored and the head stays tied)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    stored = {n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
              and not isinstance(m, QuantLinear) and m.weight.dtype == torch.bfloat16}
    if ops.LIBRARY.library() is None:
        assert head is embed and not stored
    else:
        assert head.dtype == torch.bfloat16 and torch.equal(head.float(), embed) and stored == kept | {"lm_head"}
    assert embed.dtype == torch.float32
    assert {p.dtype for n, p in model.named_parameters()
            if n.removesuffix(".weight") not in stored} == {torch.float32}
    # the quantized weights are RTN of the bf16 model's weights, which the bf16 row runs (and the bf16 GGUF holds)
    name = "model.layers.0.linear_attn.out_proj"
    ref = fresh.get_submodule(name).weight.float()
    deq = model.get_submodule(name).dequantized_weight().float()
    assert (deq - ref).abs().max() <= ref.abs().max() / 7 / 2 * 1.01


def test_shapes_preset_and_floor_bytes_at_the_4b_shape(bench):
    """`--shapes hybrid` is each Qwen3.5 shape beside its Qwen3; a 4B step moves every weight once, the K/V of the
    8 attention layers and the 24 DeltaNet states twice (read, write): 2 MiB each in fp32."""
    shapes = bench
    assert shapes.PRESETS["hybrid"] == ["qwen3.5-0.8b", "qwen3-0.6b", "qwen3.5-2b", "qwen3-1.7b", "qwen3.5-4b",
                                        "qwen3-4b"]
    with torch.device("meta"):
        from specquant.model.decoder import Transformer

        model = Transformer(shapes.SHAPES["qwen3.5-4b"]()).to(torch.bfloat16)
    cfg = model.config
    assert cfg.layer_types.count("linear_attention") == 24 and len(shapes.attention_mixers(model)) == 8
    weights = sum(shapes.module_bytes(m) for m in shapes.layer_linears(model)) + shapes.module_bytes(model.lm_head)
    kv = 2 * 8 * 4 * (128 + 1) * 256 * 2  # layers x KV heads x positions x head_dim x bf16
    assert shapes.step_bytes(model, 128, 1) == weights + kv + 24 * 2 * (2 << 20)
    assert 4.1e9 < model.num_parameters() < 4.3e9


def test_shapes_gguf_writes_a_qwen35_file_llama_cpp_runs(bench, monkeypatch, tmp_path, capsys):
    """shapes_gguf.py at a tiny hybrid: the bf16 and f32 sources and llama.cpp's Q4_0 of the bf16 one, which
    llama-bench (through shapes.py's own llama.cpp column) loads and runs, with the tensors Q4_0 left in other types
    reported; shapes.py then prints both sides' weight bytes per step. The binaries are absent only when their
    build was skipped deliberately (SPECQUANT_SKIP_LLAMA_CPP=1, as tests/test_export_llama_cpp.py)."""
    import os

    pytest.importorskip("gguf")
    from specquant.export.llama_cpp import default_bin_dir

    base = default_bin_dir()
    missing = [t for t in ("llama-bench", "llama-quantize") if not os.access(base / t, os.X_OK)]
    if missing:
        if os.environ.get("SPECQUANT_SKIP_LLAMA_CPP") == "1":
            pytest.skip(f"llama.cpp build skipped deliberately (SPECQUANT_SKIP_LLAMA_CPP=1); {missing} not in {base}")
        pytest.fail(f"llama.cpp tools {missing} missing from {base}: run `bash scripts/setup.sh --test`, or set "
                    "SPECQUANT_SKIP_LLAMA_CPP=1 to skip these tests deliberately")
    shapes = bench
    shapes_gguf = load_benchmark("shapes_gguf.py")

    # the bundled tokenizer's 8192 ids need that vocabulary; head size 32 keeps each head one Q4_0 block
    monkeypatch.setitem(shapes.SHAPES, "qwen3.5-gguf-tiny", lambda: hybrid(
        4, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        vocab_size=8192))
    root = tmp_path / "llama"
    root.mkdir()
    (root / "bin").symlink_to(base)
    _, res = _run(shapes_gguf, [str(root), "--shapes", "qwen3.5-gguf-tiny", "--threads", "1"], monkeypatch, capsys)
    names = sorted(Path(f).name for f in res["files"])
    assert names == [f"qwen3.5-gguf-tiny-{k}.gguf" for k in ("bf16", "f32", "q4_0")]
    q4 = res["q4_0"]["qwen3.5-gguf-tiny"]
    assert q4["main_type"] == "Q4_0" and q4["types"]["Q4_0"]["tensors"] > 0
    # the tied embedding/output in llama.cpp's output type, the conv kernel as written (F32), the rest Q4_0
    assert set(q4["other_types"]) == {"token_embd.weight", "blk.*.ssm_conv1d.weight"}, q4["other_types"]
    assert q4["other_types"]["token_embd.weight"] != "Q4_0" and q4["vector_types"] == ["F32"]
    assert q4["weight_bytes"] == sum(t["bytes"] for t in q4["types"].values())  # tied: token_embd is the head
    assert (root / "shapes" / "qwen3.5-gguf-tiny-q4_0.log").read_text().strip()
    out, res = _run(shapes, ["--shapes", "qwen3.5-gguf-tiny", "--modes", "bf16,w4", "--reps", "1", "--context", "8",
                             "--rows", "1,2", "--threads", "1", "--llama-cpp", str(root)], monkeypatch, capsys)
    for row in res["results"]:
        assert set(row["llama_cpp"]) == {"tg", "pp2"} and row["llama_cpp"]["tg"] > 0, row["llama_cpp"]
        assert row["llama_cpp_gguf"]["weight_bytes"] > 0
    w4 = next(r for r in res["results"] if r["mode"] == "w4")
    assert w4["llama_cpp_gguf"]["file"] == "qwen3.5-gguf-tiny-q4_0.gguf"
    assert "weights per step: ours" in out
