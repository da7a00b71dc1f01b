"""serve's prefix cache: outputs with it equal outputs without it, on a dense pair and on a random Qwen3.5 hybrid
target (DeltaNet state restored at block boundaries), over repeated, extended, diverging and shortened prompts;
the cache snapshot / restore protocol on each cache kind; the LRU bounds."""

from __future__ import annotations

import pytest
import torch
from _qwen35_models import VOCAB, hf_model
from conftest import peaky_pair, small_block_draft

from specquant.decode.sampling import SamplingConfig
from specquant.model.block_draft import BlockDraftModel
from specquant.model.cache import KVCache
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.serve.prefix import PrefixCache
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafters.block import BlockDrafter
from specquant.spec_decode.engine import SpecEngine

BLOCK = 8  # small, so the prompts below cross several boundaries and diverge between them


def ours(theirs) -> Transformer:
    model = Transformer(ModelConfig.from_hf(theirs.config.to_dict()))
    model.load_state_dict(theirs.state_dict(), strict=False)
    return model.eval()


@pytest.fixture(scope="module")
def hybrid():
    target = ours(hf_model("gva", 4, seed=11, scale=0.35))
    draft = ours(hf_model("mha", 2, seed=12, scale=0.35))  # a hybrid LM drafter: its DeltaNet layers are cached too
    block = small_block_draft(target, block_size=8, target_layer_ids=(1, 3), seed=13, copy_norm=False)
    return target, {"lm": draft, "block": block, "none": None, "suffix": "suffix"}


def make_engine(target, draft, graphs=False, **kw):
    cfg = SpecConfig(draft_len=3, **kw)
    if isinstance(draft, BlockDraftModel):
        draft = BlockDrafter(draft, target, cfg)
    elif draft == "suffix":
        from specquant.spec_decode.drafters import KINDS

        draft = KINDS["suffix"].build(None, target, cfg)
    return SpecEngine(target, draft, cfg, graphs=graphs)


def prompts(vocab: int) -> list[torch.Tensor]:
    """A prompt, itself again, an extension, one diverging mid-block, one diverging on a boundary, a prefix of the
    first, a short one, and the first again."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, vocab, (1, 30), generator=g)
    other = torch.randint(0, vocab, (1, 40), generator=g)
    return [base, base, torch.cat([base, other[:, :11]], 1), torch.cat([base[:, :13], other[:, :20]], 1),
            torch.cat([base[:, :16], other[:, 20:29]], 1), base[:, :21], other[:, :3], base]


def run(engine, prompt, prefill=None, sampling=None):
    steps = engine.stream(prompt, 12, sampling, stop_on_eos=False, prefill=prefill)
    return [t for step in steps for t in step.token_ids[0]]


def check_equal(target, draft, vocab, sampling=None, **kw):
    plain, cached = make_engine(target, draft, **kw), make_engine(target, draft, **kw)
    cache = PrefixCache(target, max_entries=8, max_bytes=1 << 30, block=BLOCK)
    restored, draft = [], []
    for prompt in prompts(vocab):
        assert run(cached, prompt, cache.prefill, sampling) == run(plain, prompt, None, sampling)
        restored.append(cache.last[1])
        draft.append(cache.last_restored.get("draft"))
    return restored, draft  # positions the target / the LM drafter resumed from (draft None: not cached)


@pytest.mark.parametrize("kind", ["lm", "block", "none", "suffix"])
def test_hybrid_target_outputs_equal_without_the_cache(hybrid, kind):
    target, drafts = hybrid
    restored, draft = check_equal(target, drafts[kind], VOCAB)
    if kind == "lm":  # a hybrid drafter: its DeltaNet state resumes at boundaries (or an earlier prompt's end)
        assert draft == [0, 29, 29, 8, 16, 16, 0, 29]
    # the repeat restores all 30 tokens; the extension the whole first prompt (its end is a snapshot); the
    # divergences at 13 and 16 resume from boundary 8 and 16; the prefix of 21 tokens from boundary 16 of
    # the extension; the unrelated prompt nothing
    assert restored == [0, 30, 30, 8, 16, 16, 0, 30]


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("window,prefill", [(None, "window"), (6, "window"), (6, "full")])
def test_dense_pair_outputs_equal_without_the_cache(window, prefill, graphs):
    """A windowed LM drafter prefilled in full has ring caches: snapshotted at block boundaries, as DeltaNet.
    graphs: CUDA-graph steps (their eager stand-in on CPU) over static caches, restored in place."""
    target, draft = peaky_pair()
    restored, drafted = check_equal(target, draft, 96, draft_window=window, draft_prefill=prefill, graphs=graphs)
    assert {c.static for m in (target, draft) for c in m.caches()} == {graphs}
    # a K/V cache is cut at any shared length (a prompt keeps one token to run, unless it repeats exactly)
    assert restored == [0, 30, 30, 13, 16, 20, 0, 30]
    # the drafter prefills all but the last token; a ring resumes at block boundaries or an earlier prompt's end;
    # a window-only prefill shifts positions, so that drafter prefills as usual
    assert drafted == {(None, "window"): [0, 29, 29, 13, 16, 20, 0, 29], (6, "window"): [None] * 8,
                       (6, "full"): [0, 29, 29, 8, 16, 16, 0, 29]}[window, prefill]


def test_sampling_outputs_equal_without_the_cache(hybrid):
    target, drafts = hybrid
    check_equal(target, drafts["lm"], VOCAB, SamplingConfig(temperature=0.8, seed=3))


def test_lru_bounds_entries_and_bytes():
    target, draft = peaky_pair()
    engine = make_engine(target, draft)
    g = torch.Generator().manual_seed(1)
    many = [torch.randint(0, 96, (1, 20), generator=g) for _ in range(5)]
    cache = PrefixCache(target, max_entries=3, max_bytes=1 << 30, block=BLOCK)
    for p in many:
        run(engine, p, cache.prefill)
    assert len(cache.entries) == 3 and cache.bytes == sum(e.nbytes for e in cache.entries.values())
    run(engine, many[0], cache.prefill)  # evicted first: a miss
    assert cache.last == (20, 0)
    run(engine, many[4], cache.prefill)
    assert cache.last == (20, 20)
    one = next(iter(cache.entries.values())).nbytes
    small = PrefixCache(target, max_entries=8, max_bytes=2 * one, block=BLOCK)
    for p in many:
        run(engine, p, small.prefill)
    assert len(small.entries) == 2 and small.bytes <= 2 * one
    tiny = PrefixCache(target, max_entries=8, max_bytes=one - 1, block=BLOCK)
    run(engine, many[0], tiny.prefill)
    assert not tiny.entries and tiny.bytes == 0  # an entry over the whole budget is not kept


@pytest.mark.parametrize("window,static", [(None, False), (None, True), (6, False), (6, True)])
def test_kv_snapshot_restores_the_state(window, static):
    cap = 6 + 4 if window else 16
    cache = KVCache(1, 2, cap, 4, torch.float32, "cpu", window, static)
    fill = torch.randn(1, 2, 9, 4)
    if static:
        cache.update_static(torch.arange(9), fill, fill * 2)
    else:
        cache.update(0, fill[:, :, :5], fill[:, :, :5] * 2)
        cache.update(5, fill[:, :, 5:], fill[:, :, 5:] * 2)
        cache.length = 9
    snap = cache.snapshot(9)
    k, v = cache.k.clone(), cache.v.clone()
    pos = cache.slot_pos.clone() if static else None
    assert snap.cuttable == (window is None) and snap.length == 9
    cache.reset()
    cache.k.zero_()
    cache.v.zero_()
    cache.restore(snap)
    if window is None:
        assert torch.equal(cache.k[:, :, :9], k[:, :, :9]) and torch.equal(cache.v[:, :, :9], v[:, :, :9])
        cache.restore(snap, 4)
        assert cache.length == 4
        if static:
            assert cache.slot_pos[:4].tolist() == [0, 1, 2, 3] and (cache.slot_pos[4:] == -1).all()
    else:
        assert torch.equal(cache.k, k) and torch.equal(cache.v, v) and cache.length == 9
        if static:
            assert torch.equal(cache.slot_pos, pos)
        with pytest.raises(ValueError, match="restores length 9, not 4"):
            cache.restore(snap, 4)


def test_deltanet_restore_then_rollback_is_exact(hybrid):
    """After a restore, a verify-like forward and a rollback into it land on the state an uncached run has."""
    target, _ = hybrid
    g = torch.Generator().manual_seed(5)
    prompt, block = torch.randint(0, VOCAB, (1, 20), generator=g), torch.randint(0, VOCAB, (1, 5), generator=g)
    with torch.no_grad():
        target.setup_cache(1, 64)
        target(prompt, 0)
        snaps = [c.snapshot() if c is not None else None for c in target.caches()]
        target(block, 20)
        target.rollback(22)
        ref = target(block[:, 2:3], 22)
        target.reset_cache()
        for c, s in zip(target.caches(), snaps):
            if c is not None:
                c.restore(s)
        target(block, 20)
        target.rollback(22)
        assert torch.allclose(target(block[:, 2:3], 22), ref, atol=1e-5)
        kinds = {c.kind: c.snapshot_cuttable for c in target.caches() if c is not None}
        assert kinds == {"deltanet": False, "kv": True}
        delta = next(c for c in target.caches() if c is not None and c.kind == "deltanet")
        with pytest.raises(ValueError, match="restores length 20, not 10"):
            delta.restore(snaps[0], 10)
    target.clear_cache()
