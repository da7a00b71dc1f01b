"""Folded few-query attention (model/decoder.py Attention.fold) against the reference path (SDPA with enable_gqa).

Verify steps of 1..16 queries on a live cache, with rollbacks between them (as speculative decoding does), full and
ring (sliding-window) caches, GQA groups of 2 and 3, batch 2, fp32 and bf16. The same model runs the same steps
with fold_enabled on and off; the folded run must actually fold (checked), and the two must agree.
"""

from __future__ import annotations

import pytest
import torch
from conftest import VOCAB, random_model

from specquant.model.attention import Attention
from specquant.model.decoder import FOLD_MAX_ROWS, FOLD_MIN_ROWS, Transformer, attention_mask

STEPS = [(1, 1), (2, 1), (4, 3), (8, 2), (16, 16), (5, 0), (3, 3), (1, 1)]  # (queries, of which accepted)


def set_fold(model: Transformer, on: bool):
    for layer in model.model.layers:
        layer.self_attn.fold_enabled = on


@torch.no_grad()
def verify_run(model: Transformer, ids: torch.Tensor, prompt: int, window, max_block: int) -> list[torch.Tensor]:
    """Prefill `prompt` tokens, then one forward per STEPS entry at the current length, keeping `accepted`."""
    model.setup_cache(ids.shape[0], ids.shape[1], max_block=max_block, window=window)
    outs, pos = [model(ids[:, :prompt], 0)], prompt
    for t, accepted in STEPS:
        outs.append(model(ids[:, pos : pos + t], pos))
        pos += accepted
        model.rollback(pos)
    model.clear_cache()
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads", [4, 6], ids=["group2", "group3"])
@pytest.mark.parametrize("window", [None, 6], ids=["full-cache", "ring-cache"])
def test_folded_matches_reference(window, heads, dtype):
    model = random_model("qwen3", seed=3, num_attention_heads=heads, sliding_window=window).to(dtype)
    ids = torch.randint(0, VOCAB, (2, 64), generator=torch.Generator().manual_seed(4))
    attn = model.model.layers[0].self_attn
    model.setup_cache(2, 64, max_block=16, window=window)
    assert attn.n_heads // attn.n_kv == heads // 2
    cpu, first = torch.device("cpu"), FOLD_MIN_ROWS[dtype]
    assert all(attn.plan(20, t, dtype, cpu)[1] for t in range(first, FOLD_MAX_ROWS + 1))  # it does fold
    set_fold(model, False)
    assert not attn.plan(20, 4, dtype, cpu)[1]
    reference = verify_run(model, ids, 11, window, 16)
    set_fold(model, True)
    folded = verify_run(model, ids, 11, window, 16)
    for ref, got in zip(reference, folded):
        diff = (ref.float() - got.float()).abs()
        if dtype == torch.float32:
            assert diff.max().item() <= 1e-5
        else:  # bf16: the two paths round differently; logits here are O(1..10)
            assert diff.max().item() <= 0.1 and diff.mean().item() <= 5e-3
            assert torch.equal(ref.argmax(-1), got.argmax(-1)) or diff.max().item() <= 0.05


@torch.no_grad()
def test_one_layer_switched_off_takes_the_reference_path(monkeypatch):
    """The step's plan comes from layer 0; a layer with fold_enabled = False must still run the reference path.
    (SDPA steps: the native kernel, which takes every verify width where it built, is switched off here.)"""
    from specquant.model import attention

    monkeypatch.setattr(attention, "NATIVE_MAX_ROWS", 0)
    model = random_model("qwen3", seed=3, num_hidden_layers=3)
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(5))
    set_fold(model, False)
    reference = verify_run(model, ids, 11, None, 16)
    set_fold(model, True)
    model.model.layers[1].self_attn.fold_enabled = False
    calls = []
    attend = model.model.layers[1].self_attn.attend
    model.model.layers[1].self_attn.attend = lambda *a, **k: calls.append(a[4]) or attend(*a, **k)
    mixed = verify_run(model, ids, 11, None, 16)
    assert calls and not any(calls)  # layer 1 never folded
    for ref, got in zip(reference, mixed):
        assert (ref - got).abs().max().item() <= 1e-5


def test_folded_mask_rows_are_group_major():
    plain = attention_mask(10, 4, 3, 11, 6, "cpu")
    folded = attention_mask(10, 4, 3, 11, 6, "cpu", groups=3)
    assert torch.equal(folded, plain.repeat(3, 1))
    assert not torch.equal(plain[0], plain[-1])  # rows differ (causal, windowed), so a wrong row order would show


def test_no_fold_outside_its_measured_range():
    model = random_model("qwen3", seed=3)
    attn = model.model.layers[0].self_attn
    cpu = torch.device("cpu")
    f32, bf16 = torch.float32, torch.bfloat16
    assert not attn.plan(0, 4, f32, cpu)[1]  # no cache: training / scoring keeps SDPA's causal path
    model.setup_cache(1, 64)
    assert attn.plan(0, FOLD_MAX_ROWS, f32, cpu)[1] and not attn.plan(0, FOLD_MAX_ROWS + 1, f32, cpu)[1]
    assert attn.plan(0, 1, f32, cpu)[1] and not attn.plan(0, 1, bf16, cpu)[1] and attn.plan(0, 2, bf16, cpu)[1]
    assert not attn.fold(4, torch.float16, cpu) and not attn.fold(4, f32, torch.device("cuda"))
    mha = random_model("qwen3", seed=3, num_key_value_heads=4)  # no GQA group to fold
    mha.setup_cache(1, 64)
    assert not mha.model.layers[0].self_attn.plan(0, 4, f32, cpu)[1]


@torch.no_grad()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("window", [None, 40, 12], ids=["full", "ring-above-block", "ring-below-block"])
def test_a_first_block_runs_is_causal_with_the_boolean_masks_outputs(monkeypatch, window, dtype):
    """Attention.plan hands SDPA is_causal (mask None) when the keys are exactly the step's own positions: a
    prompt's first block on a cache (window at least the block), or a cache-free forward. Its outputs must equal
    the boolean mask's, which the plan built before and still builds for every other step."""
    from specquant.model import attention

    monkeypatch.setattr(attention, "NATIVE_MAX_ROWS", 0)  # SDPA for every block, the path under test
    model = random_model("qwen3", seed=6, num_attention_heads=4, num_hidden_layers=2, sliding_window=window)
    model = model.to(dtype)
    ids = torch.randint(0, VOCAB, (2, 60), generator=torch.Generator().manual_seed(7))
    attn, cpu = model.model.layers[0].self_attn, torch.device("cpu")
    causal_first = window is None or window >= 30
    original = Attention.plan

    def run(masked: bool) -> list[torch.Tensor]:
        calls = []

        def plan(self, start_pos, t, dt, device):
            mask, folded = original(self, start_pos, t, dt, device)
            calls.append(mask is None and t > 1)
            if masked and mask is None and t > 1:
                mask = attention_mask(start_pos, t, start_pos, t, self.window, device)
            return mask, folded

        monkeypatch.setattr(Attention, "plan", plan)
        model.setup_cache(2, 60, window=window)
        outs = [model(ids[:, :30], 0), model(ids[:, 30:50], 30), model(ids[:, 50:55], 50)]
        model.clear_cache()
        outs.append(model(ids))  # cache-free: the whole sequence in one call
        assert calls == [causal_first, False, False, window is None or window >= 60]
        return outs

    for masked, causal in zip(run(True), run(False)):
        assert torch.equal(masked, causal)
    assert (attn.plan(0, 30, dtype, cpu)[0] is None) == causal_first  # no cache: causal where the window allows
