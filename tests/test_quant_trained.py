"""AWQ < RTN and GPTQ < RTN on the trained bundled tiny-target (skipped until its weights exist).

Kept apart from test_quant_methods.py because it quantizes an 8-layer model three times (~1 min on 2 cores).
"""

import copy

import pytest
import torch
from _quant_models import HAS_TINY_TARGET, TINY_TARGET

from specquant.quant import QuantConfig, quantize
from specquant.quant.quality import compare


def trained_model_ordering(path, calib_samples=16, heldout_samples=8) -> dict:
    """AWQ and GPTQ vs RTN at 4-bit g128 on a trained checkpoint, scored on real held-out text.

    KL(fp ‖ quant) must be strictly lower than RTN's. Perplexity: the 4-bit methods differ by about the
    sampling noise of a few thousand held-out tokens, so a strict ordering would be close to a coin flip on a
    retrained model. We assert instead that each method's perplexity is not significantly above RTN's: mean
    paired per-token NLL difference < 2 standard errors (false-failure odds ≈2.3% if the methods were truly
    equal, less when the method is better, as its lower KL says).
    Measured on the bundled tiny-target (700 steps, 16×256 calibration, 8×256 held-out tokens): KL rtn 4.61e-4,
    awq 2.87e-4, gptq 1.04e-4; ppl fp 179.82, rtn 180.06, awq 180.00, gptq 179.72 (paired NLL differences
    vs RTN: awq −0.0004 ± 0.0008, gptq −0.0019 ± 0.0007), so the strict ppl ordering holds too, but AWQ's
    margin is only 0.5 standard errors.
    """
    from specquant.model.checkpoint import load_tokenizer
    from specquant.loader import load_model
    from specquant.quant.config import BUNDLED_CALIB
    from specquant.quant.quality import heldout_tokens, logprobs

    fp = load_model(path, dtype=torch.float32)
    tok = load_tokenizer(path)
    heldout = heldout_tokens(tok, BUNDLED_CALIB.with_name("heldout.txt"), heldout_samples, 256)
    reference = logprobs(fp, heldout)
    results = {}
    for method in ("rtn", "awq", "gptq"):
        m = copy.deepcopy(fp)
        # RTN needs no calibration; without a tokenizer it skips the capture passes (they only feed its report).
        quantize(m, QuantConfig(method=method, calib_samples=calib_samples, seq_len=256),
                 None if method == "rtn" else tok)
        results[method] = compare(reference, m, heldout)
    for method in ("awq", "gptq"):
        assert results[method]["kl"] < results["rtn"]["kl"], (method, results)
        diff = results[method]["nll_tokens"] - results["rtn"]["nll_tokens"]
        assert float(diff.mean()) < 2 * float(diff.std()) / len(diff) ** 0.5, (method, results)
    return results


@pytest.mark.skipif(not HAS_TINY_TARGET, reason="bundled tiny-target weights not trained yet (no model.safetensors)")
def test_tiny_target_awq_and_gptq_beat_rtn_on_heldout_text():
    trained_model_ordering(TINY_TARGET)
