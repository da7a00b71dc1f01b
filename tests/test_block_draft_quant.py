"""GPTQ W4 of the block drafter: calibrated on target features, saved as compressed-tensors, loaded back exactly."""

import json

import torch

from specquant.drafter_loader import load_block_draft
from specquant.model.checkpoint import save_block_drafter
from specquant.spec_decode.drafters import kind_of_checkpoint
from specquant.quant.block_draft_gptq import drafter_hessians, gptq_block_drafter
from specquant.quant.config import QuantConfig
from specquant.quant.grid import compute_qparams, dequantize
from specquant.quant.linear import QuantLinear
from test_block_draft import make_pair, serve_logits


def test_gptq_w4_drafter_round_trips_and_beats_rtn(tmp_path):
    target, draft = make_pair()
    torch.manual_seed(1)
    calib = torch.randint(4, 64, (4, 40))
    feats, tokens = torch.randn(1, 30, 96), torch.randint(4, 64, (1, 30))
    with torch.no_grad():
        dense = serve_logits(draft, feats, tokens, 20)
    hessians, _ = drafter_hessians(draft, target, calib)
    weights = {n: m.weight.detach().clone() for n, m in draft.named_modules() if isinstance(m, torch.nn.Linear)}
    cfg = QuantConfig(method="gptq", bits=4, group_size=32)
    report = gptq_block_drafter(draft, target, calib, cfg)
    assert report["quantized_linears"] == len(weights) == 1 + 7 * 2  # fc + 7 per layer
    assert all(isinstance(m, QuantLinear) for n, m in draft.named_modules() if n in weights)
    # GPTQ's output error on the calibration inputs is below round-to-nearest's (H-weighted error, summed)
    gptq_err = rtn_err = 0.0
    for name, w in weights.items():
        q = draft.get_submodule(name)
        w_gptq = q.dequantized_weight().float()
        s, z = compute_qparams(w, 4, 32, True, torch.float32)
        w_rtn = dequantize(torch.clamp(torch.round(w / s.repeat_interleave(32, 1)), -8, 7).to(torch.int8), s, z)
        h = hessians[name]
        gptq_err += float(((w_gptq - w) @ h * (w_gptq - w)).sum())
        rtn_err += float(((w_rtn - w) @ h * (w_rtn - w)).sum())
    assert gptq_err < rtn_err
    with torch.no_grad():
        quant = serve_logits(draft, feats, tokens, 20)
    rel = (quant - dense).norm() / dense.norm()
    assert 0 < rel < 0.2  # quantized, and still close to the dense drafter
    # compressed-tensors on disk, read back to the same logits
    from specquant.quant.checkpoint import quantization_config

    save_block_drafter(draft, tmp_path / "w4", extra_config={"quantization_config": quantization_config(draft, cfg)})
    hf = json.loads((tmp_path / "w4" / "config.json").read_text())
    assert hf["quantization_config"]["format"] == "pack-quantized" and hf["architectures"] == ["DFlashDraftModel"]
    assert kind_of_checkpoint(tmp_path / "w4").name == "block"
    loaded = load_block_draft(tmp_path / "w4").attach_target(target)
    with torch.no_grad():
        torch.testing.assert_close(serve_logits(loaded, feats, tokens, 20), quant, rtol=1e-4, atol=1e-4)
