"""`specquant quantize`: end to end through the CLI, flag defaults from QuantConfig, bad input leaves no output."""

import argparse
import json

import pytest
import torch
from _quant_models import TINY_TARGET, small_config

from specquant.model.checkpoint import save_model
from specquant.loader import load_model
from specquant.model.decoder import Transformer
from specquant.quant import GPTQConfig, QuantConfig, QuantLinear
from specquant.cli import main
from specquant.quant.cli import add_parser, quant_config


def _model_dir(tmp_path, name="m", **kw):
    """A one-layer model sized for the bundled tokenizer (vocab 8192), saved with its tokenizer files."""
    torch.manual_seed(0)
    base = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1)
    cfg = small_config(**{**base, **kw})
    return save_model(Transformer(cfg), tmp_path / name, tokenizer_from=TINY_TARGET)


def test_flag_defaults_come_from_quant_config():
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["quantize", "--model", "x", "--out", "y"])
    assert quant_config(args) == QuantConfig()
    args = parser.parse_args(["quantize", "--model", "x", "--out", "y", "--asymmetric", "--ignore", "lm_head",
                              "mlp.*", "--no-awq-clip", "--group-size", "-1"])
    cfg = quant_config(args)
    assert (cfg.symmetric, cfg.ignore, cfg.method.clip, cfg.group_size) == (False, ["lm_head", "mlp.*"], False, -1)
    args = parser.parse_args(["quantize", "--model", "x", "--out", "y", "--method", "gptq", "--gptq-damp", "0.1"])
    assert quant_config(args).method == GPTQConfig(damp=0.1)


def test_cli_awq_end_to_end_json(tmp_path, capsys):
    src = _model_dir(tmp_path)
    out = tmp_path / "q"
    rc = main(["quantize", "--model", str(src), "--out", str(out), "--method", "awq", "--group-size", "32",
               "--calib-samples", "4", "--seq-len", "64", "--awq-grid", "4", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert report["method"] == "awq" and report["quantized_linears"] == 7
    assert report["bytes_after"] < report["bytes_before"]
    assert all(r["output_sqnr_db"] > 10 for r in report["layers"])
    hf = json.loads((out / "config.json").read_text())
    assert hf["quantization_config"]["specquant"]["method"] == "awq" and hf["torch_dtype"] == "float32"
    assert (out / "tokenizer.json").exists()
    model = load_model(out)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == 7


def test_cli_table_output(tmp_path, capsys):
    src = _model_dir(tmp_path)
    assert main(["quantize", "--model", str(src), "--out", str(tmp_path / "q"), "--method", "rtn",
                 "--group-size", "64", "--dtype", "bfloat16"]) == 0
    text = capsys.readouterr().out
    assert "model.layers.0.mlp.down_proj" in text and "bytes:" in text
    assert load_model(tmp_path / "q").model.layers[0].mlp.up_proj.weight_scale.dtype == torch.float32  # load dtype
    hf = json.loads((tmp_path / "q" / "config.json").read_text())
    assert hf["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("argv,model_kw,message", [
    (["--group-size", "48"], {}, "invalid choice: 48"),  # argparse choices: exit 2 before anything runs
    (["--method", "hqq"], {}, "invalid choice: 'hqq'"),
    (["--bits", "3"], {}, "invalid choice: 3"),
    (["--method", "awq", "--calib", "/nonexistent/calib.txt"], {}, "'/nonexistent/calib.txt' does not exist"),
    (["--method", "rtn", "--group-size", "64"], {"intermediate_size": 96},
     "group_size=64 does not divide model.layers.0.mlp.down_proj.in_features=96"),
])
def test_bad_arguments_exit_nonzero_and_leave_no_output(tmp_path, capsys, argv, model_kw, message):
    src = _model_dir(tmp_path, **model_kw)
    out = tmp_path / "out" / "q"
    try:
        rc = main(["quantize", "--model", str(src), "--out", str(out), *argv])
    except SystemExit as e:
        rc = e.code
    assert rc != 0
    assert not out.exists()
    assert not out.parent.exists() or not list(out.parent.iterdir())  # no temp dir left behind
    assert message in capsys.readouterr().err
