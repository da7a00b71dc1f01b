"""The block drafter in the speculative engine: lossless greedy output, bookkeeping, windows (the sampling law is
tested for both drafter kinds in test_spec.py)."""

import pytest
import torch
from conftest import target_greedy

from specquant.decode.sampling import SamplingConfig
from specquant.spec_decode.engine import generate
from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine

VOCAB = 96


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512)
    target = Transformer(cfg).eval()
    with torch.no_grad():
        for p in target.parameters():
            p.mul_(3.0)  # peaky distributions, so greedy ties are rare and sampling has a few likely tokens
    dcfg = BlockDraftConfig.for_target(cfg, num_hidden_layers=1, block_size=6, target_layer_ids=[1, 3],
                                       mask_token_id=5)
    draft = BlockDraftModel(dcfg).eval()
    with torch.no_grad():  # a drafter that leans on the last target layer's features: it agrees sometimes
        for p in draft.parameters():
            p.mul_(0.3)
        draft.norm.weight.copy_(target.model.norm.weight)
    return target, draft


PROMPTS = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (1, 9, 70)]


def engine(target, draft, **kw):
    cfg = SpecConfig(**kw)
    return SpecEngine(target, BlockDrafter(draft, target, cfg), cfg)


@pytest.mark.parametrize("k", [1, 3, 5, 9])
@pytest.mark.parametrize("window", [None, 16])
def test_greedy_block_speculation_equals_target_greedy(pair, k, window):
    target, draft = pair
    eng = engine(target, draft, draft_len=k, draft_window=window)
    for prompt in PROMPTS:  # a 1-token prompt, and a 70-token one longer than the window
        ref = target_greedy(target, prompt, 40)
        out = eng.generate(prompt, 40, stop_on_eos=False)
        assert out.token_ids[0] == ref
        s = out.stats
        assert s["new_tokens"] == 1 + s["num_accepted_tokens"] + (s["target_forwards"] - 1)
        assert s["num_draft_tokens"] <= s["num_drafts"] * min(k, 5)  # k beyond block_size - 1 is cut to 5


def test_bundled_block_drafter_is_lossless_and_accepts():
    """The trained pair: output equal to target-only greedy, and the trained drafter's tokens do get accepted
    (its measured acceptance: docs/BLOCK_DRAFT.md)."""
    from specquant.drafter_loader import load_block_draft
    from specquant.loader import load_model
    from specquant.model.checkpoint import load_tokenizer

    target = load_model("tiny-target")
    draft = load_block_draft("tiny-block-draft")
    tok = load_tokenizer("tiny-target")
    prompt = torch.tensor([tok.encode("The meaning of the word")])
    ref = generate(target, prompt, 48, stop_on_eos=False).token_ids[0]
    out = engine(target, draft, draft_len=7).generate(prompt, 48, stop_on_eos=False)
    assert out.token_ids[0] == ref
    assert out.spec.num_accepted_tokens > 0


def test_context_holds_exactly_the_verified_prefix(pair):
    """After a request, the drafter's context K/V equal those of a teacher-forced target pass over the committed
    tokens the target processed: only accepted positions were appended, each once, in order."""
    target, draft = pair
    eng = engine(target, draft, draft_len=4)
    prompt = PROMPTS[2]
    out = eng.generate(prompt, 30, stop_on_eos=False).token_ids[0]
    assert eng.drafter.context_len == prompt.shape[1] + len(out) - 1
    eng.drafter.flush()  # the last steps' features are pending until a propose (drafters/block.py)
    n = draft.context_len
    assert n == prompt.shape[1] + len(out) - 1  # every committed position but the last emitted token
    seq = torch.cat([prompt, torch.tensor([out])], 1)[:, :n]
    target.clear_cache()
    with torch.no_grad():
        _, hidden = target(seq, hidden_layers=tuple(draft.config.target_layer_ids))  # [1, n, taps, hidden]
        attn = draft.layers[0].self_attn
        pos = torch.arange(n)
        cos, sin = draft._rope(pos, torch.float32, "cpu")
        k_ref, v_ref = attn.kv(draft.project_context(hidden.flatten(2)), cos, sin)
    k, v = attn.context_cache.read(0, n)
    torch.testing.assert_close(k, k_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(v, v_ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("window", [None, 16])
def test_lazy_context_equals_projecting_every_accept(pair, window):
    """BlockDrafter projects accepted features at the next propose, in one batch (the fast path). Driven through
    the same prefill / accept / rollback / propose calls, its proposals and context K/V equal those of the plain
    path, which appends every accept's features to the model as they come. Steps are skipped between proposes
    (as the hybrid drafter's undrafted and suffix steps do) and rolled back across pending and projected ones."""
    target, draft = pair
    cfg = SpecConfig(draft_len=5, draft_window=window)
    seq = torch.randint(0, VOCAB, (1, 120), generator=torch.Generator().manual_seed(7))
    target.clear_cache()
    with torch.no_grad():
        _, hidden = target(seq, hidden_layers=tuple(draft.config.target_layer_ids))  # [1, 120, taps, hidden]
    feats = hidden.flatten(2)
    lazy = BlockDrafter(draft, target, cfg)
    lazy.setup(1, 256)
    # (accepted length after the step, rollback to before it or None, propose before it?)
    plan = [(12, None, True), (15, None, False), (19, None, False), (23, 21, False), (30, None, True),
            (34, None, False), (33 + 60, None, False), (96, 94, True), (100, None, True), (104, 99, False),
            (110, None, True)]
    got, want = [], []
    with torch.no_grad():
        lazy.prefill(seq[:, :10], hidden[:, :10])
        n = 10
        for end, back, propose in plan:
            if propose:
                got.append(lazy.propose(seq[:, : n + 1], 5, SamplingConfig(), None).tokens)
            lazy.accept(end, hidden[:, n:end])
            if back is not None:
                lazy.rollback(back)
                end = back
            n = end
        lazy.flush()
        k_lazy, v_lazy = draft.layers[0].self_attn.context_cache.read(max(0, n - 16) if window else 0, n)
        k_lazy, v_lazy = k_lazy.clone(), v_lazy.clone()
        draft.setup_cache(256, window=window)  # the plain path, on the same model afresh: append as features come
        draft.append_context(feats[:, :10])
        n = 10
        for end, back, propose in plan:
            if propose:
                logits = draft.propose(seq[0, n], 5)
                want.append(logits.argmax(-1)[None])
            draft.append_context(feats[:, n:end])
            if back is not None:
                draft.rollback(back)
                end = back
            n = end
        k_ref, v_ref = draft.layers[0].self_attn.context_cache.read(max(0, n - 16) if window else 0, n)
    assert lazy.context_len == draft.context_len == n
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    torch.testing.assert_close(k_lazy, k_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v_lazy, v_ref, rtol=1e-5, atol=1e-5)
