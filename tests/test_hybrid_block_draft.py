"""The block drafter against a Qwen3.5 hybrid target: DFlash's tap rule, `distill draft --kind block` training it,
lossless speculation with the trained drafter, and its GPTQ W4 calibrated on the hybrid's features."""

from __future__ import annotations

import json
import math

import pytest
import torch

from specquant.cli import main
from specquant.drafter_loader import load_block_draft
from specquant.errors import SpecquantError
from specquant.loader import load_model
from specquant.model.block_draft import (BlockDraftConfig, BlockDraftModel, default_target_layer_ids,
                                         dflash_target_layer_ids)
from specquant.model.checkpoint import BUNDLED_DIR, save_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.engine import SpecEngine, generate

LAYERS = 8  # two 3:1 groups: taps [1..5], the last two layers (6: DeltaNet, 7: full attention) untapped
FAST = ["--steps", "4", "--seq-len", "48", "--batch", "2", "--eval-samples", "2", "--eval-seq-len", "48",
        "--save-every", "4", "--eval-every", "0", "--no-progress", "--num-anchors", "4", "--lr", "1e-2",
        "--warmup", "1"]


def hybrid_hf(layers: int = LAYERS, **over) -> dict:
    return dict(model_type="qwen3_5_text", vocab_size=8192, hidden_size=64, intermediate_size=128,
                num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
                linear_conv_kernel_dim=4, tie_word_embeddings=True, eos_token_id=0, max_position_embeddings=512,
                **over)


def random_hybrid(seed: int = 0) -> Transformer:
    """A random hybrid over the bundled vocabulary at trained-model scale (peaked logits), norms away from zero so a
    missing `1 +` of the zero-centred norms shows."""
    torch.manual_seed(seed)
    model = Transformer(ModelConfig.from_hf(hybrid_hf())).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 1.0 if "embed" in name else 1 / math.sqrt(p.shape[1]))
            elif name.endswith("layernorm.weight") or name == "model.norm.weight":
                p.normal_(0, 0.3)
    return model


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("hyb") / "target"
    save_model(random_hybrid(), path, tokenizer_from=BUNDLED_DIR / "tiny-target")
    return path


@pytest.fixture(scope="module")
def trained(hybrid_dir, tmp_path_factory):
    """`distill draft --kind block` against the hybrid: (its result JSON, the run directory)."""
    out = tmp_path_factory.mktemp("run") / "run"
    import io
    from contextlib import redirect_stdout

    buf = io.StringIO()
    with redirect_stdout(buf):
        assert main(["distill", "draft", "--kind", "block", "--target", str(hybrid_dir), "--out", str(out),
                     "--layers", "1", "--block-size", "4", "--json", *FAST]) == 0
    return json.loads(buf.getvalue().strip().splitlines()[-1]), out


def test_dflash_tap_rule():
    assert dflash_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]  # DFlash's Qwen3.5 drafters
    assert dflash_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # the general formula: 1 .. N-3, rounded
    assert dflash_target_layer_ids(8, 5) == [1, 2, 3, 4, 5]
    assert dflash_target_layer_ids(28, 3) == [1, 13, 25]
    assert dflash_target_layer_ids(5, 5) == [1, 2]  # too shallow for 5 distinct taps: fewer, never repeated
    assert dflash_target_layer_ids(4, 5) == [2] == dflash_target_layer_ids(4, 1)  # one tap: the middle layer
    with pytest.raises(SpecquantError, match="at least one"):
        dflash_target_layer_ids(0, 5)


def test_default_taps_follow_the_architecture():
    assert default_target_layer_ids(ModelConfig.from_hf(hybrid_hf(32))) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(ModelConfig.from_hf(hybrid_hf())) == [1, 2, 3, 4, 5]
    assert default_target_layer_ids(ModelConfig(num_hidden_layers=8)) == [1, 3, 4, 6]  # dense: unchanged


def test_fresh_drafter_speaks_through_the_hybrids_zero_centred_norm():
    """The drafter's plain RMSNorm starts as the target's final norm: 1 + w of the zero-centred one, not w."""
    from specquant.train.draft import init_block_drafter

    target = random_hybrid()
    drafter = BlockDraftModel(BlockDraftConfig.for_target(target.config, num_hidden_layers=1, block_size=4,
                                                          target_layer_ids=[1, 2], mask_token_id=3))
    init_block_drafter(drafter, target, seed=0)
    torch.testing.assert_close(drafter.norm.weight, 1 + target.model.norm.weight)
    x = torch.randn(3, 64)
    torch.testing.assert_close(drafter.norm(x), target.model.norm(x))


def test_distill_block_trains_against_a_hybrid(trained):
    result, out = trained
    st = result["stages"][0]
    assert st["best_eval"]["loss"] < st["start_eval"]["loss"], "training did not lower the held-out loss"
    drafter = load_block_draft(out / "model")
    assert drafter.config.target_layer_ids == [1, 2, 3, 4, 5]
    assert drafter.config.num_target_layers == LAYERS


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_speculation_with_the_trained_drafter_equals_target_greedy(hybrid_dir, trained, k):
    target = load_model(hybrid_dir)
    drafter = load_block_draft(trained[1] / "model").attach_target(target).eval()
    cfg = SpecConfig(draft_len=k)
    eng = SpecEngine(target, BlockDrafter(drafter, target, cfg), cfg)
    for n in (1, 70):  # 70: longer than the DeltaNet rollback record's max_block
        prompt = torch.randint(4, 8192, (1, n), generator=torch.Generator().manual_seed(n))
        ref = generate(target, prompt, 24, stop_on_eos=False).token_ids[0]
        assert eng.generate(prompt, 24, stop_on_eos=False).token_ids[0] == ref


def test_gptq_of_the_drafter_on_hybrid_features(hybrid_dir, trained):
    from specquant.quant.block_draft_gptq import drafter_hessians, gptq_block_drafter
    from specquant.quant.config import QuantConfig
    from specquant.quant.grid import compute_qparams, dequantize
    from specquant.quant.linear import QuantLinear

    target = load_model(hybrid_dir)
    drafter = load_block_draft(trained[1] / "model").attach_target(target).eval()
    calib = torch.randint(4, 8192, (4, 40), generator=torch.Generator().manual_seed(5))
    hessians, _ = drafter_hessians(drafter, target, calib)
    # the fc's inputs are the hybrid's five tapped layers, concatenated
    assert hessians["fc"].shape == (5 * 64, 5 * 64) and hessians["fc"].abs().sum() > 0
    weights = {n: m.weight.detach().clone() for n, m in drafter.named_modules() if isinstance(m, torch.nn.Linear)}
    report = gptq_block_drafter(drafter, target, calib, QuantConfig(method="gptq", bits=4, group_size=32))
    assert report["quantized_linears"] == len(weights) == 1 + 7
    assert all(isinstance(m, QuantLinear) for n, m in drafter.named_modules() if n in weights)
    gptq_err = rtn_err = 0.0
    for name, w in weights.items():
        w_gptq = drafter.get_submodule(name).dequantized_weight().float()
        s, z = compute_qparams(w, 4, 32, True, torch.float32)
        w_rtn = dequantize(torch.clamp(torch.round(w / s.repeat_interleave(32, 1)), -8, 7).to(torch.int8), s, z)
        h = hessians[name]
        gptq_err += float(((w_gptq - w) @ h * (w_gptq - w)).sum())
        rtn_err += float(((w_rtn - w) @ h * (w_rtn - w)).sum())
    assert gptq_err < rtn_err
    cfg = SpecConfig(draft_len=3)  # the W4 drafter stays lossless
    eng = SpecEngine(target, BlockDrafter(drafter, target, cfg), cfg)
    prompt = torch.randint(4, 8192, (1, 9), generator=torch.Generator().manual_seed(9))
    assert eng.generate(prompt, 24, stop_on_eos=False).token_ids[0] == \
        generate(target, prompt, 24, stop_on_eos=False).token_ids[0]
