"""Qwen3.5's MTP layer (model/mtp.py) and the MTP drafter (spec_decode/drafters/mtp.py).

The target is a random hybrid built by transformers; its mtp.* tensors are random too, under vLLM's names, made
from transformers' own Qwen3.5 modules (transformers has no MTP module: the reference composes its RMSNorm and
full-attention decoder layer the way vLLM's Qwen3_5MultiTokenPredictor does).
"""

from __future__ import annotations

import pytest
import torch
from _qwen35_models import VOCAB, hf_config, hf_model, hf_qwen35, randomize
from conftest import assert_follows_target_law, target_greedy, target_law

from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.mtp import MTPModel, load_mtp_dense, mtp_from_tensors, save_mtp_drafter
from specquant.spec_decode.build import build_engine
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.drafters import KINDS, kind_of_checkpoint, parse_draft
from specquant.spec_decode.drafters.mtp import MTPDrafter
from specquant.spec_decode.engine import SpecEngine, generate

SHAPE, LAYERS = "gva", 4


class HFReferenceMTP(torch.nn.Module):
    """vLLM's MTP forward on transformers' modules: norm(layer(fc(cat[norm_e(embed), norm_h(h)]))), cache-free."""

    def __init__(self, cfg):
        super().__init__()
        h = cfg.hidden_size
        full = cfg.layer_types.index("full_attention")
        self.fc = torch.nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = hf_qwen35.Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = hf_qwen35.Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.layers = torch.nn.ModuleList([hf_qwen35.Qwen3_5DecoderLayer(cfg, full)])
        self.norm = hf_qwen35.Qwen3_5RMSNorm(h, cfg.rms_norm_eps)
        self.rotary_emb = hf_qwen35.Qwen3_5TextRotaryEmbedding(cfg)

    def forward(self, hidden, embeds):
        t = hidden.shape[1]
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(embeds), self.pre_fc_norm_hidden(hidden)], -1))
        pos = self.rotary_emb(x, torch.arange(t)[None])
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        return self.norm(self.layers[0](x, position_embeddings=pos, attention_mask=mask))


def ours(theirs) -> Transformer:
    model = Transformer(ModelConfig.from_hf(theirs.config.to_dict()))
    model.load_state_dict(theirs.state_dict(), strict=False)
    return model.eval()


def reference_mtp(seed: int = 21, scale: float = 0.35) -> HFReferenceMTP:
    cfg = hf_config(SHAPE, LAYERS)
    torch.manual_seed(seed)
    return randomize(HFReferenceMTP(cfg), scale).eval()


@pytest.fixture(scope="module")
def reference():
    return reference_mtp()


@pytest.fixture(scope="module")
def target(reference):
    model = ours(hf_model(SHAPE, LAYERS, seed=11, scale=0.35))
    model.extra_tensors = {f"mtp.{k}": v.detach().clone() for k, v in reference.state_dict().items()
                           if "rotary_emb" not in k}
    return model


PROMPTS = [torch.randint(0, VOCAB, (1, n), generator=torch.Generator().manual_seed(n)) for n in (1, 9, 70)]


def post_norm_hidden(target, tokens):
    target.clear_cache()
    with torch.no_grad():
        return target(tokens, hidden_only=True)  # [1, T, H], after the final norm


def test_vllm_names_are_the_layer_and_it_matches_the_reference(target, reference):
    assert {k for k in target.extra_tensors} >= {"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
                                                 "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
                                                 "mtp.layers.0.self_attn.q_proj.weight",
                                                 "mtp.layers.0.mlp.down_proj.weight"}
    mtp = mtp_from_tensors(target.config, target.extra_tensors)
    tokens = PROMPTS[2]
    h = post_norm_hidden(target, tokens)
    emb = target.model.embed_tokens(tokens)
    with torch.no_grad():
        ref = reference(h, emb)
        got = mtp(h, emb)
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)
        # the cached path, token by token and in blocks, is the cache-free one
        mtp.setup_cache(1, 80)
        parts = [mtp(h[:, :5], emb[:, :5], 0)] + [mtp(h[:, i : i + 1], emb[:, i : i + 1], i) for i in range(5, 70)]
        torch.testing.assert_close(torch.cat(parts, 1), ref, atol=2e-5, rtol=1e-4)
    # the fc reads the embedding first: swapping the halves changes the output
    swapped = dict(target.extra_tensors)
    w = swapped["mtp.fc.weight"]
    swapped["mtp.fc.weight"] = torch.cat([w[:, w.shape[1] // 2 :], w[:, : w.shape[1] // 2]], 1)
    with torch.no_grad():
        assert not torch.allclose(mtp_from_tensors(target.config, swapped)(h, emb), ref, atol=1e-3)


class OracleMTPDrafter(MTPDrafter):
    """The MTP drafter, with its first j drafts replaced by the target's greedy continuation (j cycling 0..k), so
    steps accept 0..k tokens and the catch-up forward runs over 1..k+1 positions; records, per step, the committed
    tokens and the logits its first draft came from."""

    def __init__(self, model, target, continuation, prompt_len):
        super().__init__(model, target)
        self.continuation, self.prompt_len, self.first_logits, self.first = continuation, prompt_len, [], None

    def _logits(self, g):
        logits = super()._logits(g)
        if self.first is not None:
            self.first_logits.append((logits.clone(), self.first))
            self.first = None
        return logits

    def propose(self, tokens, k, sampling, generator):
        self.first = tokens.clone()
        draft = super().propose(tokens, k, sampling, generator)
        n, j = tokens.shape[1], len(self.first_logits) % (k + 1)
        oracle = self.continuation[n - self.prompt_len : n - self.prompt_len + j]
        draft.tokens[0, : len(oracle)] = torch.tensor(oracle, dtype=torch.long)
        return draft


@pytest.mark.parametrize("k", [1, 3, 7])
def test_greedy_mtp_speculation_equals_target_greedy(target, k):
    mtp = mtp_from_tensors(target.config, target.extra_tensors)
    eng = SpecEngine(target, MTPDrafter(mtp, target), SpecConfig(draft_len=k))
    for prompt in PROMPTS:
        ref = target_greedy(target, prompt, 40)
        out = eng.generate(prompt, 40, stop_on_eos=False)
        assert out.token_ids[0] == ref
        s = out.stats
        assert s["new_tokens"] == 1 + s["num_accepted_tokens"] + (s["target_forwards"] - 1)


@pytest.mark.parametrize("k", [1, 3, 7])
def test_mtp_cache_holds_exactly_the_target_verified_entries(target, k):
    """Whatever was accepted, each step's first draft comes from logits equal to a cache-free MTP pass over the
    committed sequence (h_i from the target, x_{i+1}): chained entries never survive a verify."""
    mtp = mtp_from_tensors(target.config, target.extra_tensors)
    prompt = PROMPTS[1]
    cont = target_greedy(target, prompt, 40)
    drafter = OracleMTPDrafter(mtp, target, cont, prompt.shape[1])
    eng = SpecEngine(target, drafter, SpecConfig(draft_len=k))
    out = eng.generate(prompt, 40, stop_on_eos=False)
    assert out.token_ids[0] == cont
    assert out.stats["num_accepted_tokens"] > 0
    fresh = mtp_from_tensors(target.config, target.extra_tensors)
    for logits, tokens in drafter.first_logits:
        n = tokens.shape[1]
        h = post_norm_hidden(target, tokens[:, : n - 1])
        with torch.no_grad():
            g = fresh(h, target.model.embed_tokens(tokens[:, 1:n]))
            ref = target.lm_head(g[:, -1])[0]
            # fp32 noise of the target's chunked verify vs its cache-free pass is ~1e-4 here; a chained entry left
            # in the cache moves logits by O(0.1)
            torch.testing.assert_close(logits, ref, atol=2e-3, rtol=1e-3)
    assert len(drafter.first_logits) >= 40 // (k + 1)  # every step with a draft was checked


def test_mtp_speculative_sampling_follows_the_target_law(target):
    prompt = PROMPTS[1]
    law = target_law(target, prompt)
    assert float(law[3].max()) < 0.95
    mtp = mtp_from_tensors(target.config, target.extra_tensors)
    eng = SpecEngine(target, MTPDrafter(mtp, target), SpecConfig(draft_len=3))
    assert_follows_target_law(eng, prompt, law, n=400, tv_bound=0.45)


def test_draft_mtp_uses_the_target_checkpoint_and_refuses_a_target_without_one(target, tmp_path):
    from specquant.model.checkpoint import save_model

    assert parse_draft("mtp") == (KINDS["mtp"], None)
    save_model(target, tmp_path / "hybrid")
    eng = build_engine(tmp_path / "hybrid", "mtp", spec=SpecConfig(draft_len=3))
    assert isinstance(eng.drafter, MTPDrafter)
    prompt = PROMPTS[1]
    assert eng.generate(prompt, 20, stop_on_eos=False).token_ids[0] == \
        generate(target, prompt, 20, stop_on_eos=False).token_ids[0]
    bare = ours(hf_model(SHAPE, LAYERS, seed=11, scale=0.35))
    with pytest.raises(SpecquantError, match="has none") as e:
        build_engine(bare, "mtp")
    assert "\n" not in str(e.value)


def test_mtp_drafter_directory_round_trips_and_is_detected(target, tmp_path):
    mtp = mtp_from_tensors(target.config, target.extra_tensors)
    save_mtp_drafter(mtp, tmp_path / "mtp")
    assert kind_of_checkpoint(tmp_path / "mtp").name == "mtp"
    loaded = load_mtp_dense(tmp_path / "mtp")
    h = torch.randn(1, 6, target.config.hidden_size)
    e = torch.randn(1, 6, target.config.hidden_size)
    with torch.no_grad():
        assert torch.equal(loaded(h, e), mtp(h, e))
    eng = build_engine(target, str(tmp_path / "mtp"), spec=SpecConfig(draft_len=3))
    assert isinstance(eng.drafter, MTPDrafter)
    prompt = PROMPTS[2]
    assert eng.generate(prompt, 20, stop_on_eos=False).token_ids[0] == \
        generate(target, prompt, 20, stop_on_eos=False).token_ids[0]
    with pytest.raises(SpecquantError, match="hidden size"):
        other = ModelConfig.from_hf(dict(target.config.to_hf(), hidden_size=48, head_dim=24))
        MTPDrafter(MTPModel(other), target)


@pytest.mark.parametrize("head", ["shared", "w8"])
def test_w4_mtp_is_lossless_and_saves_and_loads(target, tmp_path, head):
    from specquant.drafter_loader import load_mtp_drafter, quantize_mtp
    from specquant.quant.linear import QuantLinear, set_backend

    dense = mtp_from_tensors(target.config, target.extra_tensors)
    w4 = mtp_from_tensors(target.config, target.extra_tensors)
    report = quantize_mtp(w4, bits=4, group_size=-1 if target.config.hidden_size % 32 else 32)
    linears = [m for m in w4.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 8 and not any(isinstance(m, torch.nn.Linear) for m in w4.modules())  # fc + 4 + 3
    assert all(r["sqnr_db"] > 10 for r in report["layers"])
    h, e = torch.randn(1, 6, target.config.hidden_size), torch.randn(1, 6, target.config.hidden_size)
    fake = mtp_from_tensors(target.config, target.extra_tensors)  # dense, holding the W4 grid's values
    with torch.no_grad():
        for name, m in w4.named_modules():
            if isinstance(m, QuantLinear):
                fake.get_submodule(name).weight.copy_(m.dequantized_weight())
        set_backend(w4, "reference")  # the plain dequantize-then-matmul path (fast paths: tests/test_quant_linear.py)
        got = w4(h, e)
        set_backend(w4, "auto")
        assert not torch.allclose(dense(h, e), got, atol=1e-2)
        torch.testing.assert_close(got, fake(h, e), atol=1e-4, rtol=1e-4)
    save_mtp_drafter(w4, tmp_path / "w4", extra_config={"specquant_mtp_head": head})
    loaded = load_mtp_drafter(tmp_path / "w4")
    assert loaded.quantization and loaded.head_precision == head
    set_backend(loaded, "reference")
    with torch.no_grad():
        assert torch.equal(loaded(h, e), got)
    eng = build_engine(target, str(tmp_path / "w4"), spec=SpecConfig(draft_len=3))
    assert (eng.drafter.head is target.lm_head) == (head == "shared")
    for prompt in PROMPTS:
        assert eng.generate(prompt, 30, stop_on_eos=False).token_ids[0] == \
            generate(target, prompt, 30, stop_on_eos=False).token_ids[0]
    with pytest.raises(SpecquantError, match="does not divide hidden_size 40"):
        MTPDrafter(w4, target, "w4")


def test_w4_head_drafts_through_its_own_head_and_stays_lossless():
    cfg = dict(hidden_size=64)
    torch.manual_seed(5)
    reference = randomize(HFReferenceMTP(hf_config(SHAPE, LAYERS, **cfg)), 0.35).eval()
    target = ours(hf_model(SHAPE, LAYERS, seed=3, scale=0.35, **cfg))
    mtp = MTPModel(target.config)
    mtp.load_state_dict({k: v for k, v in reference.state_dict().items() if "rotary_emb" not in k})
    drafter = MTPDrafter(mtp, target, "w4")
    from specquant.quant.linear import QuantLinear

    assert isinstance(drafter.head, QuantLinear) and drafter.head is not target.lm_head
    g = torch.randn(1, 4, 64)
    with torch.no_grad():  # a head of the same matrix, on the W4 grid
        assert torch.nn.functional.cosine_similarity(drafter.head(g), target.lm_head(g), -1).min() > 0.95
    eng = SpecEngine(target, drafter, SpecConfig(draft_len=3))
    for prompt in PROMPTS[:2]:
        assert eng.generate(prompt, 30, stop_on_eos=False).token_ids[0] == \
            generate(target, prompt, 30, stop_on_eos=False).token_ids[0]


def test_training_replay_of_chained_drafts_is_the_drafter_serving_path(target):
    """train/mtp.py's chained_outputs: level s at anchor a equals the drafter's s-th chained output of a step whose
    last exact position is a, when its drafts are the data's tokens (the cache then holds exactly the same)."""
    from specquant.train.mtp import chained_outputs

    mtp = mtp_from_tensors(target.config, target.extra_tensors)
    tokens = PROMPTS[2][:, :24]
    h = post_norm_hidden(target, tokens)
    embed = target.model.embed_tokens
    with torch.no_grad():
        levels = chained_outputs(mtp, h, tokens, embed, steps=3)
        assert [g.shape[1] for g in levels] == [23, 22, 21]
        mtp.setup_cache(1, 32)
        for a in (0, 5, 20):
            mtp.rollback(0)
            g = mtp(h[:, : a + 1], embed(tokens[:, 1 : a + 2]), 0)[:, -1:]  # exact entries 0..a
            torch.testing.assert_close(g[:, 0], levels[0][:, a], atol=2e-5, rtol=1e-4)
            for s in (1, 2):
                g = mtp(g, embed(tokens[:, a + s + 1 : a + s + 2]), a + s)
                torch.testing.assert_close(g[:, 0], levels[s][:, a], atol=2e-5, rtol=1e-4)
        mtp.clear_cache()
