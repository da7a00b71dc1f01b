"""`specquant latency` against a real llama-server on our GGUF export of the bundled pair (skipped when llama.cpp's
build cache holds no llama-server): its model id, its context (a slot's n_ctx, not the training context), its
speculative counters under the llamacpp: prefix, and its prompt cache's reused tokens."""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("gguf")

from specquant import cli  # noqa: E402
from specquant.engines import Server  # noqa: E402
from specquant.engines.process import HOST, free_port, running  # noqa: E402
from specquant.export.config import ExportConfig  # noqa: E402
from specquant.export.llama_cpp import default_bin_dir, export_llama_cpp  # noqa: E402
from specquant.serve.latency import CONTEXT_MARGIN  # noqa: E402

CTX = 512  # below the export's 2048: the medium category must shrink to fit it


@pytest.fixture(scope="module")
def llama_server(tmp_path_factory):
    binary = default_bin_dir() / "llama-server"
    if not os.access(binary, os.X_OK):
        pytest.skip(f"llama-server is not built in {binary.parent} (python -m specquant.export.llama_cpp_build)")
    out = tmp_path_factory.mktemp("gguf") / "pair"
    report = export_llama_cpp("tiny-target", "tiny-draft", out, ExportConfig(engine="llama.cpp").validate())
    port = free_port()
    cmd = [str(binary), "-m", report["files"]["target"]["path"], "-md", report["files"]["draft"]["path"],
           "--spec-type", "draft-simple", "-c", str(CTX), "--host", HOST, "--port", str(port), "--metrics",
           "-t", "1"]
    with running(Server(cmd, label="llama-server"), port, out.parent / "llama-server.log", start_timeout_s=120) as url:
        yield url, report["files"]["target"]["path"]


def test_latency_against_llama_server(llama_server, capsys):
    url, gguf = llama_server
    capsys.readouterr()
    assert cli.main(["latency", "--server", url, "--categories", "medium", "--runs", "1", "--warmup", "1"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    result = json.loads(out[-1])
    assert out[0].startswith("context ") and "scaled" in out[0]
    # no --model: llama-server's one model, whose id is its GGUF path
    assert result["model"] == gguf
    # the slot's context from /props (llama-server pads -c to a multiple of 256), not n_ctx_train (2048)
    assert result["context"] == CTX
    assert result["prompt_scale"] == pytest.approx((CTX - 256 - CONTEXT_MARGIN) / 2048)
    row = result["categories"]["medium"]
    assert abs(row["prompt_tokens"] - round(2048 * result["prompt_scale"])) <= 2
    assert row["mean_new_tokens"] <= 256 and row["median_ms"] > 0
    # llamacpp:spec_decode_* counters (with --metrics): a real mean acceptance length
    assert 1.0 < row["mean_acceptance_length"] <= 1 + ExportConfig.num_speculative_tokens
    # its prompt cache reuses the repeated prompt (all but the last token)
    assert row["mean_cached_prompt_tokens"] >= row["prompt_tokens"] - 2
    assert any(line.startswith("note: medium: the server reused") for line in out)
