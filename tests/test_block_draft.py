"""Block drafter model: the cached serving path equals the many-blocks training forward; window, rollback, I/O."""

import json

import pytest
import torch

from specquant.errors import SpecquantError
from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel, training_block_mask
from specquant.model.checkpoint import load_block_draft_dense, save_block_drafter
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.train.block_draft import block_loss, position_weights

TARGET = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=8, max_position_embeddings=256)


def make_pair(block_size=5, seed=0):
    torch.manual_seed(seed)
    target = Transformer(TARGET).eval()
    cfg = BlockDraftConfig.for_target(TARGET, num_hidden_layers=2, block_size=block_size, target_layer_ids=[0, 2, 3],
                                      mask_token_id=3)
    draft = BlockDraftModel(cfg).attach_target(target).eval()
    with torch.no_grad():  # non-trivial norms, so a mix-up of hidden_norm / norm / q,k norms shows
        for n, p in draft.named_parameters():
            if n.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return target, draft


def serve_logits(draft, feats, tokens, anchor, window=None):
    draft.setup_cache(feats.shape[1] + 8, window=window)
    draft.append_context(feats[:, :anchor])
    return draft.propose(tokens[0, anchor])


@torch.no_grad()
def test_serving_path_equals_training_forward():
    target, draft = make_pair()
    L = 24
    feats = torch.randn(1, L, 3 * TARGET.hidden_size)
    tokens = torch.randint(4, 64, (1, L))
    anchors = torch.tensor([[1, 6, 7, 15, 22]])
    train = draft.block_logits(feats, tokens, anchors)  # [1, 5, B-1, vocab]
    for i, a in enumerate(anchors[0].tolist()):
        torch.testing.assert_close(serve_logits(draft, feats, tokens, a), train[0, i], rtol=1e-4, atol=1e-4)


@torch.no_grad()
def test_training_mask_blocks_do_not_see_each_other():
    m = training_block_mask(torch.tensor([[2, 4]]), context_len=6, block_size=3)[0, 0]
    assert m.shape == (6, 12)
    assert m[:3, :6].tolist() == [[True, True, False, False, False, False]] * 3  # block 0: context < 2
    assert m[3:, :6].tolist() == [[True] * 4 + [False] * 2] * 3
    assert m[:3, 6:9].all() and not m[:3, 9:].any() and m[3:, 9:].all() and not m[3:, 6:9].any()


@torch.no_grad()
def test_window_matches_masked_reference_and_bounds_the_cache():
    _, draft = make_pair()
    L, W, n = 120, 8, 110
    feats = torch.randn(1, L, 3 * TARGET.hidden_size)
    tokens = torch.randint(4, 64, (1, L))
    got = serve_logits(draft, feats, tokens, n, window=W)
    assert draft.layers[0].self_attn.context_cache.capacity < L  # ring: memory bounded by W, not the context length
    # reference: full cache, the same visibility written as an explicit mask over all 35 context positions
    draft.setup_cache(L + 8, window=None)
    draft.append_context(feats[:, :n])
    x = draft.block_embeddings(tokens[0, n].reshape(1))
    pos = torch.arange(n, n + draft.config.block_size)
    cos, sin = draft._rope(pos, x.dtype, x.device)
    vis = torch.arange(n)[None, :] > pos[:, None] - W
    mask = torch.cat((vis, torch.ones(len(pos), len(pos), dtype=torch.bool)), 1)
    for layer in draft.layers:
        x = layer(x, cos, sin, *layer.self_attn.context_cache.read(0, n), mask)
    ref = draft.lm_head(draft.norm(x[0, 1:]))
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(got, serve_logits(draft, feats, tokens, n, window=None), atol=1e-3)


@torch.no_grad()
def test_rollback_then_append_equals_fresh_context():
    _, draft = make_pair()
    feats = torch.randn(1, 20, 3 * TARGET.hidden_size)
    other = torch.randn(1, 5, 3 * TARGET.hidden_size)
    tok = torch.tensor(9)
    for window in (None, 6):
        draft.setup_cache(40, window=window)
        draft.append_context(feats[:, :12])
        draft.append_context(other)  # e.g. positions the target then rejected
        draft.rollback(12)
        draft.append_context(feats[:, 12:])
        got = draft.propose(tok, 3)
        assert got.shape == (3, TARGET.vocab_size)
        fresh = serve_logits(draft, feats, torch.full((1, 21), 9), 20, window=window)[:3]
        torch.testing.assert_close(got, fresh, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_in_dflash_layout(tmp_path):
    target, draft = make_pair()
    save_block_drafter(draft, tmp_path / "d")
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["DFlashDraftModel"] and hf["block_size"] == 5 and hf["num_target_layers"] == 4
    assert hf["dflash_config"] == {"mask_token_id": 3, "target_layer_ids": [0, 2, 3], "block_size": 5}
    from safetensors.torch import load_file

    names = set(load_file(tmp_path / "d" / "model.safetensors"))
    assert "fc.weight" in names and "hidden_norm.weight" in names and "layers.1.self_attn.k_norm.weight" in names
    assert not any("embed" in n or "lm_head" in n for n in names)  # reused from the target, not copied
    loaded = load_block_draft_dense(tmp_path / "d", hf).attach_target(target)
    feats, tokens = torch.randn(1, 10, 96), torch.randint(4, 64, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(serve_logits(loaded, feats, tokens, 7), serve_logits(draft, feats, tokens, 7))


def test_config_validation_names_the_value():
    with pytest.raises(SpecquantError, match="target_layer_ids"):
        BlockDraftConfig.for_target(TARGET, target_layer_ids=[1, 9])
    cfg = BlockDraftConfig.for_target(TARGET, target_layer_ids=[1])
    with pytest.raises(SpecquantError, match="hidden_size"):
        cfg.check_target(ModelConfig(hidden_size=48, vocab_size=64, num_hidden_layers=4))
    with pytest.raises(SpecquantError, match="not a block drafter"):
        BlockDraftConfig.from_hf({"architectures": ["Qwen3ForCausalLM"]})


def test_block_loss_weights_positions_and_skips_outside():
    V, L = 7, 6
    logits = torch.randn(1, 2, 3, V)
    labels = torch.randint(0, V, (1, L))
    anchors = torch.tensor([[1, 4]])  # the second block runs past the end after one position
    loss, stats = block_loss(logits, labels, anchors, gamma=2.0)
    w = position_weights(4, 2.0)
    ce = torch.nn.functional.cross_entropy
    terms = [(w[j], ce(logits[0, 0, j][None], labels[0, 2 + j][None])) for j in range(3)]
    terms.append((w[0], ce(logits[0, 1, 0][None], labels[0, 5][None])))
    ref = sum(a * b for a, b in terms) / sum(a for a, _ in terms)
    torch.testing.assert_close(loss, ref)
    assert len(stats["acc_per_pos"]) == 3


@torch.no_grad()
def test_propose_past_a_full_cache_is_refused():
    """Pending rows beyond a full (unwindowed) cache fail loudly rather than wrapping over earlier positions."""
    _, draft = make_pair()
    feats = torch.randn(1, 20, 3 * TARGET.hidden_size)
    draft.setup_cache(16, window=None)
    draft.append_context(feats[:, :14])
    with pytest.raises(ValueError, match="holds 16 positions"):
        draft.propose(torch.tensor(5), 2, feats[:, 14:18])
