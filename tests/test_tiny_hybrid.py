"""The bundled tiny-hybrid (scripts/train_tiny_hybrid.sh): a Qwen3.5-layout checkpoint that transformers and ours
read alike, with tiny-target's tokenizer, at least as good as tiny-target on held-out text."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import needs_bundled

from specquant.loader import load_model
from specquant.model.checkpoint import BUNDLED_DIR, load_tokenizer, resolve
from specquant.model.cli import describe

pytestmark = needs_bundled("tiny-hybrid")


def test_layout_is_qwen35_in_the_3_to_1_pattern():
    hf = json.loads((resolve("tiny-hybrid") / "config.json").read_text())
    assert hf["model_type"] == "qwen3_5_text" and hf["architectures"] == ["Qwen3_5ForCausalLM"]
    n = hf["num_hidden_layers"]
    assert n % 4 == 0 and hf["layer_types"] == ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                                                for i in range(n)]
    model = load_model("tiny-hybrid")
    # its MTP layer (trained afterwards by `distill draft --kind mtp`) is kept for the MTP drafter, under vLLM's names
    assert hf["mtp_num_hidden_layers"] == 1 and model.extra_tensors
    assert all(k.startswith("mtp.") for k in model.extra_tensors) and "mtp.fc.weight" in model.extra_tensors
    for f in ("tokenizer.json", "tokenizer_config.json"):
        assert (BUNDLED_DIR / "tiny-hybrid" / f).read_bytes() == (BUNDLED_DIR / "tiny-target" / f).read_bytes()
    row = next(r for r in describe() if r["name"] == "tiny-hybrid")
    assert row["available"] and row["parameters"] == model.num_parameters()
    assert "linear_attention" in row["architecture"]


def test_transformers_reads_it_as_we_do():
    transformers = pytest.importorskip("transformers")
    theirs = transformers.AutoModelForCausalLM.from_pretrained(resolve("tiny-hybrid"), dtype=torch.float32).eval()
    ours = load_model("tiny-hybrid").eval()
    tokens = torch.randint(4, 8192, (1, 80), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(tokens), theirs(tokens).logits, rtol=2e-3, atol=2e-3)


@needs_bundled("tiny-target")
def test_at_least_as_good_as_tiny_target_on_heldout_text():
    from specquant.quant.quality import compare, heldout_tokens
    from specquant.train.qad import BUNDLED_HELDOUT

    tokens = heldout_tokens(load_tokenizer(resolve("tiny-target")), BUNDLED_HELDOUT, 16, 256)
    with torch.no_grad():
        r = compare(load_model("tiny-target"), load_model("tiny-hybrid"), tokens)
    assert r["ppl"] <= r["ppl_ref"], {k: r[k] for k in ("ppl", "ppl_ref")}


@needs_bundled("tiny-hybrid-block-draft")
def test_its_block_drafter_reads_dflash_taps_and_speculates_losslessly():
    from specquant.drafter_loader import load_block_draft
    from specquant.spec_decode.config import SpecConfig
    from specquant.spec_decode.drafters.block import BlockDrafter
    from specquant.spec_decode.engine import SpecEngine, generate

    target = load_model("tiny-hybrid")
    drafter = load_block_draft("tiny-hybrid-block-draft").attach_target(target).eval()
    assert drafter.config.target_layer_ids == [1, 2, 3, 4, 5]  # DFlash's rule at 8 layers
    cfg = SpecConfig(draft_len=3)
    eng = SpecEngine(target, BlockDrafter(drafter, target, cfg), cfg)
    prompt = torch.tensor([load_tokenizer(resolve("tiny-hybrid")).encode("The function returns the")])
    ref = generate(target, prompt, 32, stop_on_eos=False).token_ids[0]
    out = eng.generate(prompt, 32, stop_on_eos=False)
    assert out.token_ids[0] == ref
    assert out.stats["num_accepted_tokens"] > 0  # a trained drafter: some drafts are accepted
