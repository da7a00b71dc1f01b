"""Fast paths against their references: the shape-static cache vs the sliced cache, compiled vs eager steps."""

import pytest
import torch
from conftest import own_cache

from specquant.decode.compiled import Stepper
from specquant.spec_decode.engine import generate
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine


def _model(seed, layers=2, window=None):
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=80, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      sliding_window=window)
    return Transformer(cfg).eval()


@pytest.mark.parametrize("window", [None, 12])
def test_static_cache_matches_sliced_cache_with_rollback(window):
    m = _model(0, window=window)
    tokens = torch.randint(0, 80, (1, 60), generator=torch.Generator().manual_seed(1))
    outs = {}
    for static in (False, True):
        with torch.no_grad():
            m.setup_cache(1, 128, max_block=16, static=static)
            logits = [m(tokens[:, :20], 0)]
            logits += [m(tokens[:, i : i + 1], i) for i in range(20, 35)]
            logits += [m(tokens[:, 35:40], 35)]  # a verify-shaped block ...
            logits += [m(tokens[:, 37:45], 37)]  # ... rolled back by 3 positions and overwritten
            logits += [m(tokens[:, i : i + 1], i) for i in range(45, 60)]
        outs[static] = torch.cat(logits, 1)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)


def test_compiled_generate_and_spec_match_eager():
    target, draft = _model(0, layers=2), _model(1, layers=1)
    prompt = torch.randint(0, 80, (1, 17), generator=torch.Generator().manual_seed(2))
    eager = generate(target, prompt, 24, stop_on_eos=False).token_ids
    # requests of other lengths (other token-buffer strides; the last one longer than the first request) reuse the
    # one decode graph: the cache's size is a bucket (decode/aot.capacity_for). Their eager runs first, since an
    # eager run gives the model eager caches, a compiled one static caches
    others = [(prompt[:, :n], new) for n, new in ((17, 10), (9, 20), (17, 60))]
    others_eager = [generate(target, p, new, stop_on_eos=False).token_ids for p, new in others]
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stepper = Stepper(target, compile=True)
    compiled = generate(stepper, prompt, 24, stop_on_eos=False).token_ids
    assert compiled == eager
    assert [generate(stepper, p, new, stop_on_eos=False).token_ids for p, new in others] == others_eager
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1
    cfg = SpecConfig(draft_len=3, draft_window=8)
    spec_eager = SpecEngine(target, draft, cfg).generate(prompt, 24, stop_on_eos=False)
    spec_compiled = SpecEngine(target, draft, cfg, compile=True).generate(prompt, 24, stop_on_eos=False)
    assert spec_compiled.token_ids == spec_eager.token_ids == eager
    assert spec_compiled.stats["num_accepted_tokens"] == spec_eager.stats["num_accepted_tokens"]


def test_kv_cache_is_allocated_once_and_grown_only_when_needed():
    """Requests that fit reuse the same K/V tensors (what keeps compiled steps from recompiling per request); a
    longer request grows the cache; results match a fresh cache."""
    target, draft = _model(0, layers=2), _model(1, layers=1)
    engine = SpecEngine(target, draft, SpecConfig(draft_len=3, draft_window=8))
    long_prompt = torch.randint(0, 80, (1, 40), generator=torch.Generator().manual_seed(4))
    first = engine.generate(long_prompt, 16, stop_on_eos=False).token_ids
    caches = [m.caches() for m in (target, draft)]
    buffers = [[b.data_ptr() for c in cs for b in c.buffers()] for cs in caches]
    short = engine.generate(long_prompt[:, :9], 16, stop_on_eos=False).token_ids  # fits: same buffers
    assert all(a is b for cs, m in zip(caches, (target, draft)) for a, b in zip(cs, m.caches()))
    assert [[b.data_ptr() for c in cs for b in c.buffers()] for cs in caches] == buffers
    assert engine.generate(long_prompt, 16, stop_on_eos=False).token_ids == first  # stale K/V never read
    target.clear_cache()
    draft.clear_cache()
    assert SpecEngine(target, draft, SpecConfig(draft_len=3, draft_window=8)).generate(
        long_prompt[:, :9], 16, stop_on_eos=False).token_ids == short
    longer = torch.randint(0, 80, (1, 100), generator=torch.Generator().manual_seed(5))
    engine.generate(long_prompt, 16, stop_on_eos=False)
    ring = draft.caches()
    engine.generate(longer, 16, stop_on_eos=False)  # needs more positions: the target's cache grows
    assert target.cache_capacity() >= 100 + 16
    assert all(a is b for a, b in zip(draft.caches(), ring))  # the windowed draft's ring: one size for any length


CACHE_CHILD = r"""
import json, sys
import torch
import torch.nn.functional as F
from specquant.decode.compiled import Stepper
from specquant.spec_decode.engine import generate
from specquant.model import decoder
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.fuse import fuse_projections
silu = decoder.MLP.forward
out = []
for variant in sys.argv[1:]:  # each variant traced afresh in this process, its counters apart
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    # "gelu": a code change, the same model with its MLP computing something else
    decoder.MLP.forward = silu if variant == "silu" else (
        lambda self, x: self.down_proj(F.gelu(self.gate_up_proj(x).chunk(2, -1)[0])))
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=80, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    model = Transformer(cfg).eval()
    fuse_projections(model)
    prompt = torch.arange(5)[None] + 3
    eager = generate(model, prompt, 8, stop_on_eos=False).token_ids
    compiled = generate(Stepper(model, compile=True), prompt, 8, stop_on_eos=False).token_ids
    c = torch._dynamo.utils.counters["inductor"]
    out.append({"eager": eager, "compiled": compiled, "hit": c["fxgraph_cache_hit"], "miss": c["fxgraph_cache_miss"]})
print(json.dumps(out))
"""


def _cache_child(tmp_path, *variants: str) -> list[dict]:
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, SPECQUANT_CACHE=str(own_cache(tmp_path)), OMP_NUM_THREADS="1")
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    res = subprocess.run([sys.executable, "-c", CACHE_CHILD, *variants], env=env, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_compile_cache_on_disk_serves_a_second_process_and_never_a_stale_graph(tmp_path):
    """Compiled graphs land under $SPECQUANT_CACHE/compile; a second process hits them (no inductor compile);
    changed model code misses (the key includes the traced graph) and still equals its own eager run. The changed
    code is traced in the second process after its hit (dynamo reset in between: nothing traced is kept in memory,
    so the graph is looked up on disk as a fresh process would), which saves a third process start."""
    [first] = _cache_child(tmp_path, "silu")
    assert first["miss"] >= 1 and first["hit"] == 0 and first["compiled"] == first["eager"]
    assert any((tmp_path / "compile").rglob("*")), "nothing written under $SPECQUANT_CACHE/compile"
    second, changed = _cache_child(tmp_path, "silu", "gelu")
    assert second["hit"] >= 1 and second["miss"] == 0 and second["compiled"] == first["eager"]
    assert changed["miss"] >= 1 and changed["compiled"] == changed["eager"]
