"""The model owns its caches: the cache protocol (model/cache.py), the layer-kind table (model/layers.py), and the
Transformer's cache methods, on attention alone and on a hybrid with a toy recurrent layer kind."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from conftest import randomize_
from torch import nn

from specquant.decode import aot
from specquant.errors import SpecquantError
from specquant.model import layers
from specquant.model.cache import Cache, KVCache
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.layers import LayerKind

CFG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
           num_key_value_heads=2, head_dim=8, max_position_embeddings=128)


class SumState(Cache):
    """A toy recurrent state: the running sum [batch, dim] of the mixer's inputs, plus the per-position sums of the
    last forward, so `rollback` can restore the state after any position of that forward (the protocol's way)."""

    kind = "running_sum"

    def __init__(self, batch, capacity, dim, dtype, device):
        super().__init__(batch, capacity)
        self.register_buffer("state", torch.zeros(batch, dim, dtype=dtype, device=device), persistent=False)
        self.length, self.last_start, self.last = 0, 0, None

    def fits(self, batch, capacity, dtype, device, window, static, max_block=None):
        return self.batch == batch and self.state.dtype == dtype and self._same_device(device) and not static

    def reset(self):
        self.state.zero_()
        self.length, self.last = 0, None

    def update(self, start: int, u: torch.Tensor) -> torch.Tensor:
        """u [batch, T, dim] at positions start.. -> the running sums after each of them [batch, T, dim]."""
        assert start == self.length, "a recurrent state continues where it stopped (rollback first)"
        before = self.state.clone()
        sums = before[:, None] + u.cumsum(1)
        self.last_start, self.last = start, torch.cat([before[:, None], sums], 1)  # [batch, T + 1, dim]
        self.state.copy_(sums[:, -1])
        self.length = start + u.shape[1]
        return sums

    def rollback(self, length: int):
        if length >= self.length:
            return
        i = length - self.last_start
        if self.last is None or i < 0:
            raise ValueError(f"running sum kept positions {self.last_start}.. only; asked to roll back to {length}")
        self.state.copy_(self.last[:, i])
        self.length = length


class RunningSum(nn.Module):
    """A toy mixer: y_t = out(tanh(sum_{s<=t} in(x_s))); no RoPE, no plan (it ignores cos, sin and plan)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.in_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.cache = None

    def make_cache(self, batch, capacity, dtype, device, window, static, max_block=None):
        return SumState(batch, capacity, self.in_proj.in_features, dtype, device)

    def forward(self, x, cos, sin, start_pos, input_pos=None, plan=None):
        u = self.in_proj(x)
        sums = u.cumsum(1) if self.cache is None else self.cache.update(start_pos, u)
        return self.out_proj(torch.tanh(sums))


@pytest.fixture
def hybrid(monkeypatch):
    """A 3-layer model whose first and last layers are the toy recurrent kind: one table row, nothing else."""
    monkeypatch.setitem(layers.LAYER_KINDS, "running_sum", LayerKind(attr="mixer_sum", mixer=RunningSum))
    cfg = ModelConfig(**CFG, layer_types=("running_sum", "full_attention", "running_sum"))
    return randomize_(Transformer(cfg), seed=1).eval()


def _ids(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, CFG["vocab_size"], (1, n), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def test_hybrid_decode_with_rollback_matches_cache_free_forward(hybrid):
    """Prefill, single steps, verify-like blocks rolled back part way: every logit equals the cache-free forward of
    the sequence as it stands (layer 0 is not attention, so the step's attention plan comes from layer 1)."""
    assert [type(m).__name__ for m in hybrid.mixers()] == ["RunningSum", "Attention", "RunningSum"]
    assert "model.layers.0.mixer_sum.in_proj.weight" in hybrid.state_dict()  # the kind's checkpoint name
    seq = _ids(40)
    hybrid.setup_cache(1, 40)
    got = [hybrid(seq[:, :10], 0)]
    n = 10
    for block, keep in [(1, 1), (4, 2), (1, 1), (5, 0), (3, 3), (4, 1)]:
        out = hybrid(seq[:, n : n + block], n)
        got.append(out[:, :keep])
        hybrid.rollback(n + keep)  # the rejected tail of the block is forgotten
        n += keep
    with pytest.raises(ValueError, match="roll back to"):
        hybrid.rollback(n - 2)  # before the last forward: more than the toy state kept
    hybrid.clear_cache()
    torch.testing.assert_close(torch.cat(got, 1), hybrid(seq[:, :n]), atol=1e-5, rtol=1e-5)


@torch.no_grad()
def test_caches_follow_the_protocol_on_a_hybrid(hybrid):
    layout = hybrid.cache_layout(1, 32)
    assert [x["kind"] for x in layout["layers"]] == ["running_sum", "kv", "running_sum"]
    assert hybrid.caches() == [None] * 3 and hybrid.cache_batch() is None
    hybrid.setup_cache(1, 32)
    caches = hybrid.caches()
    assert [c.layout() for c in caches] == layout["layers"]  # made on the meta device, the same description
    assert hybrid.cache_batch() == 1 and hybrid.cache_capacity() == 32
    first = hybrid(_ids(6), 0)
    hybrid.setup_cache(1, 16)  # fits: the same caches, reset (the state is zero again, the sequence starts anew)
    assert all(a is b for a, b in zip(caches, hybrid.caches())) and not caches[0].state.any()
    torch.testing.assert_close(hybrid(_ids(6), 0), first)
    hybrid.setup_cache(2, 16)  # another batch: new caches
    assert not any(a is b for a, b in zip(caches, hybrid.caches())) and hybrid.cache_batch() == 2
    hybrid.clear_cache()
    assert hybrid.caches() == [None] * 3


@pytest.mark.parametrize("kw", [{}, {"window": 8, "max_block": 4}, {"static": True}, {"dtype": torch.bfloat16}],
                         ids=["full", "ring", "static", "bf16"])
def test_cache_layout_describes_the_caches_setup_cache_makes(kw):
    model = Transformer(ModelConfig(**CFG))
    layout = model.cache_layout(2, 48, **kw)
    model.setup_cache(2, 48, **kw)
    assert all(isinstance(c, KVCache) for c in model.caches())
    assert [c.layout() for c in model.caches()] == layout["layers"] and layout["device"] == "cpu"
    assert model.cache_capacity() == (8 + 4 - 1 if "window" in kw else 48) and model.cache_batch() == 2
    assert model.mixers()[0].window == kw.get("window")
    model.clear_cache()
    assert model.mixers()[0].window is None  # the config's again


def test_a_full_cache_larger_than_needed_is_reused_but_a_ring_is_not():
    model = Transformer(ModelConfig(**CFG))
    model.setup_cache(1, 64)
    full = model.caches()
    model.setup_cache(1, 32)
    assert all(a is b for a, b in zip(full, model.caches())) and model.cache_capacity() == 64
    model.setup_cache(1, 64, window=8, max_block=4)
    ring = model.caches()
    model.setup_cache(1, 64, window=8, max_block=8)  # another slot count: a new ring
    assert not any(a is b for a, b in zip(ring, model.caches()))


def test_package_key_does_not_depend_on_whether_caches_exist(hybrid):
    """Keyed before setup_cache (a fresh process) and after it (a later request): one key, for both models."""
    for model in (Transformer(ModelConfig(**CFG)), hybrid):
        layout = model.cache_layout(1, 64, static=model is not hybrid)
        before = aot.package_key(model, 1, True, layout)
        model.setup_cache(1, 64, static=model is not hybrid)
        assert aot.package_key(model, 1, True, layout) == before
        model.clear_cache()


def test_layer_types_are_validated_and_round_trip():
    # the names are checked where layers are built (the layer-kind table), the count by the config itself
    with pytest.raises(SpecquantError, match=r"unsupported layer_types \['mamba'\] in config.json; supported: "
                                             "full_attention, linear_attention"):
        Transformer(ModelConfig(**CFG, layer_types=("full_attention", "mamba", "full_attention")))
    with pytest.raises(SpecquantError, match="gated_attention"):  # internal kinds are not config.json's to name
        layers.layer_kinds(ModelConfig(**CFG, layer_types=("full_attention", "gated_attention", "full_attention")))
    with pytest.raises(SpecquantError, match="lists 2 layers but num_hidden_layers is 3"):
        ModelConfig(**CFG, layer_types=("full_attention",) * 2)
    cfg = ModelConfig(**CFG)
    assert layers.layer_kinds(cfg) == ("full_attention",) * 3 and "layer_types" not in cfg.to_hf()
    spelled = ModelConfig.from_hf({**cfg.to_hf(), "layer_types": ["full_attention"] * 3})
    assert spelled == cfg  # transformers' all-full list is the default


def test_nothing_outside_model_names_the_kv_cache():
    """The seam: code outside model/ reaches caches through the Transformer's methods only."""
    src = Path(__file__).resolve().parent.parent / "src"
    res = subprocess.run(["git", "grep", "-n", "--untracked", "-e", "KVCache", "-e", "self_attn.cache", "--", "."],
                         cwd=src, capture_output=True, text=True, check=False)
    if res.returncode > 1:
        pytest.skip(f"git grep unavailable: {res.stderr.strip()[:200]}")
    outside = [line for line in res.stdout.splitlines() if not line.startswith("specquant/model/")]
    assert outside == []
