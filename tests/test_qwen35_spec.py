"""Speculation on a Qwen3.5 hybrid target is lossless: the recurrent state rolls back exactly after every verify.

Targets are random hybrids (transformers' weights layout, copied into specquant's Transformer); drafters are a
noised copy of the target (the LM drafter, rolling back over several one-token forwards), a small dense model, and a random
block drafter reading the hybrid's hidden states.
"""

from __future__ import annotations


import pytest
import torch
from _qwen35_models import VOCAB, hf_model
from conftest import assert_follows_target_law, small_block_draft, target_greedy, target_law

from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine


def ours(theirs) -> Transformer:
    model = Transformer(ModelConfig.from_hf(theirs.config.to_dict()))
    model.load_state_dict(theirs.state_dict(), strict=False)  # lm_head is tied in neither; rope buffers are ours
    return model.eval()


@pytest.fixture(scope="module")
def target():
    return ours(hf_model("gva", 4, seed=11, scale=0.35))  # peaky: greedy ties are rare


@pytest.fixture(scope="module")
def drafters(target):
    hybrid = ours(hf_model("gva", 4, seed=11, scale=0.35))  # a noised copy of the target: agrees often, not always
    with torch.no_grad():
        torch.manual_seed(12)
        for p in hybrid.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    dense = Transformer(ModelConfig(vocab_size=VOCAB, hidden_size=40, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=10,
                                    tie_word_embeddings=False)).eval()
    with torch.no_grad():  # share the target's embedding and head, so drafts agree sometimes
        for d in (dense,):
            d.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
            d.lm_head.weight.copy_(target.lm_head.weight)
    block = small_block_draft(target, block_size=16, target_layer_ids=(1, 3), seed=13, copy_norm=False)
    return {"lm-hybrid": hybrid, "lm-dense": dense, "block": block}


def engine(target, drafters, kind, **kw):
    cfg = SpecConfig(**kw)
    draft = drafters[kind]
    return SpecEngine(target, BlockDrafter(draft, target, cfg) if kind == "block" else draft, cfg)


PROMPTS = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (1, 9, 70)]


@pytest.mark.parametrize("window", [None, 16])
@pytest.mark.parametrize("k", [1, 3, 7, 15])
@pytest.mark.parametrize("kind", ["lm-hybrid", "lm-dense", "block"])
def test_greedy_speculation_on_a_hybrid_equals_target_greedy(target, drafters, kind, k, window):
    eng = engine(target, drafters, kind, draft_len=k, draft_window=window)
    accepted = 0
    for prompt in PROMPTS:  # a 1-token prompt, and a 70-token one longer than the window and max_block
        ref = target_greedy(target, prompt, 40)
        out = eng.generate(prompt, 40, stop_on_eos=False)
        assert out.token_ids[0] == ref
        s = out.stats
        assert s["new_tokens"] == 1 + s["num_accepted_tokens"] + (s["target_forwards"] - 1)
        accepted += s["num_accepted_tokens"]
    if kind == "lm-hybrid":  # drafts are accepted, so rollbacks land inside verified blocks (and the drafter's
        assert accepted > 0  # own several forwards), not only at their starts


@pytest.mark.parametrize("native", [True, False])
def test_a_verify_is_one_rule_call_per_layer(target, monkeypatch, native):
    """A verify forward of 2..16 tokens runs the rule once per DeltaNet layer, never a Python token loop: natively
    (V a multiple of 16) the block's steps in one kernels.ops.delta_step call, which keeps each row and the
    rolled-back state bit-equal to a token-by-token decode; else the chunked rule."""
    from specquant.kernels import ops
    from specquant.model import gated_delta

    model = ours(hf_model("gva", 4, seed=11, scale=0.35, linear_value_head_dim=32)) if native else target
    if native and ops.LIBRARY.library() is None:
        pytest.skip("the native ops library is not loaded here (SPECQUANT_NATIVE)")
    calls = []
    real_chunk, real_recurrent, real_step = gated_delta.chunk_rule, gated_delta.recurrent_rule, ops.delta_step
    monkeypatch.setattr(gated_delta, "chunk_rule", lambda *a, **kw: calls.append(a[0].shape[1]) or real_chunk(*a, **kw))
    monkeypatch.setattr(gated_delta, "recurrent_rule",
                        lambda *a, **kw: calls.append(-a[0].shape[1]) or real_recurrent(*a, **kw))
    monkeypatch.setattr(ops, "delta_step", lambda *a, **kw: calls.append(("native", a[0].shape[1]))
                        or real_step(*a, **kw))
    n_delta = model.config.layer_types.count("linear_attention")
    with torch.no_grad():
        model.setup_cache(1, 64)
        model(PROMPTS[1], 0)
        for t in (2, 4, 8, 16):
            calls.clear()
            model(torch.randint(0, VOCAB, (1, t)), 9)
            model.rollback(9)
            assert calls == [("native", t) if native else t] * n_delta
    model.clear_cache()


def test_a_prefill_runs_the_native_rule_and_matches_a_token_by_token_decode(monkeypatch):
    """A prefill longer than the cache's max_block (no deltas kept) runs the rule natively too (ops.delta_step,
    never chunk_rule), so its recurrent state and logits follow a token-by-token decode of the same prompt."""
    from specquant.kernels import ops
    from specquant.model import gated_delta

    if ops.LIBRARY.library() is None:
        pytest.skip("the native ops library is not loaded here (SPECQUANT_NATIVE)")
    model = ours(hf_model("gva", 4, seed=11, scale=0.35, linear_value_head_dim=32))
    ids = torch.randint(0, VOCAB, (1, 40), generator=torch.Generator().manual_seed(3))
    chunked = []
    real_chunk = gated_delta.chunk_rule
    monkeypatch.setattr(gated_delta, "chunk_rule",
                        lambda *a, **kw: chunked.append(a[0].shape[1]) or real_chunk(*a, **kw))
    deltanets = [layer.mixer for layer in model.model.layers if layer.layer_type == "linear_attention"]
    with torch.no_grad():
        model.setup_cache(1, 48, max_block=8)
        prefill = model(ids, 0)
        states = [m.cache.state.clone() for m in deltanets]
        model.setup_cache(1, 48, max_block=8)
        decode = torch.cat([model(ids[:, i : i + 1], i) for i in range(ids.shape[1])], 1)
        stepped = [m.cache.state.clone() for m in deltanets]
    model.clear_cache()
    assert not chunked
    for a, b in zip(states, stepped):
        torch.testing.assert_close(a, b, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(prefill, decode, atol=2e-5, rtol=1e-5)
    assert torch.equal(prefill.argmax(-1), decode.argmax(-1))


@pytest.mark.parametrize("kind", ["lm-hybrid", "block"])
def test_speculative_sampling_on_a_hybrid_follows_the_target_law(target, drafters, kind):
    """As tests/test_spec.py's law test: the first token (target prefill) and the second (the first verified
    draft position, after a rollback of the recurrent state) follow the target's sampling law."""
    prompt = PROMPTS[1]
    law = target_law(target, prompt)
    assert float(law[3].max()) < 0.95  # the second position has spread too
    eng = engine(target, drafters, kind, draft_len=3)
    assert_follows_target_law(eng, prompt, law, n=400, tv_bound=0.45)
