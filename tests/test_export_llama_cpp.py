"""llama.cpp itself on our exports: its tokenizer gives our ids, its greedy decoding our tokens, its tools our rows.

The binaries come from export/llama_cpp_build.py (`scripts/setup.sh --test` runs it, so CI has them). A missing build
is a failure; it is a skip only when SPECQUANT_SKIP_LLAMA_CPP=1 says the build was skipped deliberately.
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest
import torch

gguf = pytest.importorskip("gguf")

from specquant.bench.llama_cpp import ROWS, generate, run_rows, run_tool  # noqa: E402
from specquant.export.gguf import source_from_checkpoint, write_gguf  # noqa: E402
from specquant.export.llama_cpp import default_bin_dir  # noqa: E402
from specquant.loader import load_model  # noqa: E402
from specquant.model.checkpoint import load_tokenizer  # noqa: E402

TOOLS = ("llama-completion", "llama-speculative-simple", "llama-tokenize", "llama-quantize", "llama-perplexity")
TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "def f(x):\n    return x ** 2  # squares\n\n\tindent  and   spaces   ",
    "Numbers 1234567 and 3.14159, URLs http://example.com/a?b=c&d=e, e-mail a.b@c.de",
    "Unicode: café naïve — “quotes” 日本語 😀 Ünïcödé",
    "I'm sure they'll say it's fine, we've seen you'd",
]


@pytest.fixture(scope="module")
def bin_dir() -> Path:
    base = default_bin_dir()
    missing = [t for t in TOOLS if not os.access(base / t, os.X_OK)]
    if missing:
        if os.environ.get("SPECQUANT_SKIP_LLAMA_CPP") == "1":
            pytest.skip(f"llama.cpp build skipped deliberately (SPECQUANT_SKIP_LLAMA_CPP=1); {missing} not in {base}")
        pytest.fail(f"llama.cpp tools {missing} missing from {base}: run `bash scripts/setup.sh --test` (or "
                    "`python -m specquant.export.llama_cpp_build`), or set SPECQUANT_SKIP_LLAMA_CPP=1 to skip these "
                    "tests deliberately")
    return base


@pytest.fixture(scope="module")
def draft_gguf(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "draft-f32.gguf"
    write_gguf(source_from_checkpoint("tiny-draft"), path)
    return path


def test_llama_tokenize_gives_our_token_ids(bin_dir, draft_gguf, tmp_path):
    """The "gpt-2" pre-tokenizer and our byte-level BPE vocabulary/merges tokenize every text identically."""
    tok = load_tokenizer("tiny-draft")
    heldout = (Path(__file__).resolve().parent.parent / "src/specquant/data/heldout.txt").read_text()[:3000]
    for i, text in enumerate(TEXTS + [heldout]):
        f = tmp_path / f"t{i}.txt"
        f.write_text(text, encoding="utf-8")
        proc = run_tool([bin_dir / "llama-tokenize", "-m", draft_gguf, "-f", f, "--ids", "--log-disable",
                         "--no-bos"])
        ids = ast.literal_eval(proc.stdout.strip().splitlines()[-1])
        assert ids == tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, text[:40]


def _ours_greedy(name: str, prompt_ids: list[int], n: int) -> list[int]:
    from specquant.spec_decode.engine import generate as ours

    model = load_model(name, torch.float32)
    res = ours(model, torch.tensor([prompt_ids]), n, stop_on_eos=False)
    return res.token_ids[0]


def test_llama_cpp_greedy_equals_ours_on_f32_export(bin_dir, draft_gguf, tmp_path):
    """The architecture mapping (q/k norms, tied embeddings, rope) is right: llama.cpp's greedy continuation of the
    F32 export is our engine's, token for token."""
    tok = load_tokenizer("tiny-draft")
    text = "Once upon a time, in a small village by the sea, there lived"
    prompt = tmp_path / "p.txt"
    prompt.write_text(text)
    n = 24
    g = generate(bin_dir, draft_gguf, prompt, n, threads=1, ctx=256)
    ours = _ours_greedy("tiny-draft", tok.backend_tokenizer.encode(text, add_special_tokens=False).ids, n)
    assert len(ours) == n and g.text.startswith(tok.decode(ours))  # llama-completion may print one token more
    assert g.tokens_per_s > 0


def test_bench_rows_inside_llama_cpp(bin_dir, tmp_path):
    """run_rows on a W4 draft pair: every row runs, speculative rows report acceptance, and greedy speculative
    decoding reproduces its target alone (llama.cpp's batched verify is numerically close to one-token decode on
    the CPU; a divergence would show as match < 1 and is reported, so the bound here is loose: half the tokens)."""
    from specquant.quant.checkpoint import save_quantized
    from specquant.quant.config import QuantConfig
    from specquant.quant.pipeline import quantize

    model = load_model("tiny-draft", torch.float32)
    cfg = QuantConfig(method="rtn", group_size=32)
    quantize(model, cfg, scale_dtype=torch.bfloat16)
    model.to(torch.bfloat16)
    w4 = save_quantized(model, tmp_path / "w4", tokenizer_from="tiny-draft", cfg=cfg)
    files = {"target-f32": tmp_path / "f32.gguf", "target-w4": tmp_path / "w4.gguf"}
    write_gguf(source_from_checkpoint("tiny-draft"), files["target-f32"])
    write_gguf(source_from_checkpoint(w4), files["target-w4"])
    files["draft-f32"], files["draft-w4"] = files["target-f32"], files["target-w4"]
    from specquant.bench.llama_cpp import llama_quantize

    files["target-q4_0-llama"] = llama_quantize(files["target-f32"], tmp_path / "q.gguf", bin_dir=bin_dir)
    tok = load_tokenizer("tiny-draft")
    result = run_rows(files, [("p", TEXTS[0])], lambda t: tok.backend_tokenizer.encode(t).ids, bin_dir=bin_dir,
                      max_new_tokens=16, runs=1, warmup=0, threads=1, ctx=256, log=lambda *_: None)
    rows = {r["id"]: r for r in result["rows"]}
    assert list(rows) == [r.id for r in ROWS]
    assert rows["f32"]["match_vs_f32"] == 1.0 and rows["f32"]["speedup_vs_f32"] == 1.0
    for rid in ("w4+draft", "w4+w4draft"):
        assert 0 < rows[rid]["n_drafted"] and 0 <= rows[rid]["acceptance"] <= 1
        assert rows[rid]["match_vs_target_alone"] >= 0.5
    # the W4 target drafting for itself: every draft token is the target's own greedy choice
    assert rows["w4+w4draft"]["acceptance"] > 0.8


def test_parse_kl_reads_llama_perplexity_summary():
    """The summary lines as tools/perplexity/perplexity.cpp prints them (format strings copied from its LOG calls)."""
    from specquant.bench.llama_cpp_quality import parse_kl

    text = ("Mean PPL(Q)                   :  24.153412 ±   0.412000\n"
            "Mean PPL(base)                :  23.901100 ±   0.405000\n"
            "Mean    KLD:   0.012345 ±   0.000210\n"
            "99.0%   KLD:   0.081000\n"
            "Same top p: 96.512 ± 0.123 %\n")
    r = parse_kl(text)
    assert r == {"ppl": 24.153412, "ppl_err": 0.412, "ppl_base": 23.9011, "kld": 0.012345, "kld_err": 0.00021,
                 "kld_99": 0.081, "same_top_p": 96.512, "same_top_p_err": 0.123}
    with pytest.raises(Exception, match="lacks its 'kld' line"):
        parse_kl(text.replace("Mean    KLD", "Mean KL"))
