"""AOTInductor-packaged steps (decode.aot) against the eager reference; the on-disk package cache across processes."""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import native_switch, own_cache, randomize_

from specquant.decode import aot
from specquant.decode.compiled import Stepper
from specquant.spec_decode.engine import generate
from specquant.errors import SpecquantError
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer
from specquant.model.fuse import fuse_projections
from specquant.spec_decode.config import SpecConfig
from specquant.spec_decode.engine import SpecEngine

CFG = dict(vocab_size=80, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
           num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, qk_norm=True,
           tie_word_embeddings=False)  # tied, a random model only repeats its last input token


def _model(seed: int, noise: float = 0.0, **overrides) -> Transformer:
    """A random model (varied greedy tokens, unlike default init's), fused as `specquant generate` runs it;
    noise > 0: seed 0's weights plus that much relative noise from `seed` (a draft that agrees only in part)."""
    model = randomize_(Transformer(ModelConfig(**{**CFG, **overrides})), 0 if noise else seed).eval()
    if noise:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1 + noise * torch.randn(p.shape, generator=gen))
    fuse_projections(model)
    return model


PROMPT = torch.randint(0, 80, (1, 17), generator=torch.Generator().manual_seed(2))


def _step_logits(step, model, tokens: int = 12) -> tuple[torch.Tensor, list[int]]:
    """Greedy decode driven by hand: logits [tokens, vocab] of every one-token step, and the tokens."""
    with torch.no_grad():
        step.setup(1, PROMPT.shape[1] + tokens)
        tok = step(PROMPT, 0, last_only=True)[:, -1].argmax(-1)
        logits, out = [], [int(tok)]
        for i in range(tokens - 1):
            row = step(tok[:, None], PROMPT.shape[1] + i, last_only=True)[:, -1]
            logits.append(row)
            tok = row.argmax(-1)
            out.append(int(tok))
    return torch.cat(logits), out


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory):
    """A compile cache holding the one-token package for _model's layout (built once: ~15 s of C++ compile)."""
    root = tmp_path_factory.mktemp("aot-cache")
    old = os.environ.get("SPECQUANT_CACHE")
    os.environ["SPECQUANT_CACHE"] = str(own_cache(root))
    stepper = Stepper(_model(0), aot="build")
    stepper.setup(1, PROMPT.shape[1] + 24)
    assert stepper.aot_steps and len(list((root / "compile" / "aot").glob("*.pt2"))) == 1
    yield root
    if old is None:
        del os.environ["SPECQUANT_CACHE"]
    else:
        os.environ["SPECQUANT_CACHE"] = old


def test_packaged_step_matches_eager(cache_dir):
    model = _model(0)
    ref_logits, ref_tokens = _step_logits(Stepper(model), model)
    stepper = Stepper(model, aot="cached")
    logits, tokens = _step_logits(stepper, model)
    assert stepper.aot_steps, "the package built by the fixture was not found"
    assert model.static_cache and model.cache_capacity() == aot.MIN_CAPACITY
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # the same through generate, twice on one stepper (the second request reuses the loaded package and cache)
    eager = generate(model, PROMPT, 24, stop_on_eos=False).token_ids
    assert generate(stepper, PROMPT, 24, stop_on_eos=False).token_ids == eager
    assert generate(stepper, PROMPT, 24, stop_on_eos=False).token_ids == eager


def test_package_reads_the_models_own_weights_and_cache(cache_dir):
    """Weights are not baked in: a model with other weights (same layout) loads the same package and gets its own
    eager logits; a larger cache kept from an earlier request is replaced by one of the package's capacity."""
    other = _model(1)
    other.setup_cache(1, 1024, static=True)
    stepper = Stepper(other, aot="cached")
    logits, tokens = _step_logits(stepper, other)
    assert stepper.aot_steps and other.cache_capacity() == aot.MIN_CAPACITY
    ref_logits, ref_tokens = _step_logits(Stepper(other), other)
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(logits, _step_logits(Stepper(_model(0)), _model(0))[0])


def test_cached_mode_without_a_package_runs_the_eager_reference(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECQUANT_CACHE", str(own_cache(tmp_path)))
    model = _model(0, rms_norm_eps=1e-5)  # another config: another key, not in the fixture's cache either
    stepper = Stepper(model, aot="cached")
    out = generate(stepper, PROMPT, 8, stop_on_eos=False).token_ids
    assert not stepper.aot_steps and not model.static_cache  # the sliced cache of the plain eager path
    assert out == generate(_model(0, rms_norm_eps=1e-5), PROMPT, 8, stop_on_eos=False).token_ids
    assert not (tmp_path / "compile" / "aot").exists()  # "cached" never builds


def test_later_requests_reuse_the_package_lookup(tmp_path, monkeypatch):
    """A Stepper settles and keys its model once per cache layout and thread count, not on every request (a
    server's requests repeat the layout): the paths are the uncached reference's, a new capacity bucket or thread
    count works them out again, and the tokens stay the eager ones."""
    monkeypatch.setenv("SPECQUANT_CACHE", str(own_cache(tmp_path)))
    model = _model(0, rms_norm_eps=1e-5)  # no package of its layout anywhere: "cached" decodes eagerly
    calls = {"settle": 0, "key": 0}
    settle, key = aot.settle, aot.package_key

    def counted(name, fn):
        def wrapper(*a, **k):
            calls[name] += 1
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(aot, "settle", counted("settle", settle))
    monkeypatch.setattr(aot, "package_key", counted("key", key))
    stepper = Stepper(model, aot="cached")
    eager = generate(_model(0, rms_norm_eps=1e-5), PROMPT, 8, stop_on_eos=False).token_ids
    for _ in range(3):
        assert generate(stepper, PROMPT, 8, stop_on_eos=False).token_ids == eager
    assert calls == {"settle": 1, "key": 1}
    [paths] = stepper.aot_keys.values()
    layout = model.cache_layout(1, aot.capacity_for(PROMPT.shape[1] + 8, 1024), static=True)
    assert paths == aot.package_paths(model, ((1, True),), 1, layout)  # the reference, worked out again
    calls.update(settle=0, key=0)
    generate(stepper, PROMPT, aot.MIN_CAPACITY, stop_on_eos=False)  # needs the next capacity bucket
    assert calls == {"settle": 1, "key": 1} and len(stepper.aot_keys) == 2
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)  # packages are per thread count (inductor bakes it in)
        generate(stepper, PROMPT, 8, stop_on_eos=False)
    finally:
        torch.set_num_threads(threads)
    assert calls == {"settle": 2, "key": 2} and len(stepper.aot_keys) == 3


def test_speculative_engine_with_packaged_steps_matches_eager(cache_dir):
    """The engine's target verify step and the LM draft's one-token step as packages, with rejections and rollbacks
    between them: the same tokens and acceptance as the eager engine. The draft has the fixture model's layout
    and cache, so it loads the fixture's package (asked for with other setup_cache keywords: keys follow the
    buffers made, not the arguments); only the verify step is built here."""
    target, draft = _model(0), _model(1, noise=0.1)
    cfg = SpecConfig(draft_len=3)
    eager = SpecEngine(target, draft, cfg).generate(PROMPT, 24, stop_on_eos=False)
    before = set((cache_dir / "compile" / "aot").iterdir())
    engine = SpecEngine(target, draft, cfg, aot="build")
    packaged = engine.generate(PROMPT, 24, stop_on_eos=False)
    assert len(set((cache_dir / "compile" / "aot").iterdir()) - before) == 1
    assert set(engine.target_step.aot_steps) == {(4, False)} and set(engine.drafter.step.aot_steps) == {(1, True)}
    assert packaged.token_ids == eager.token_ids
    assert packaged.stats["num_accepted_tokens"] == eager.stats["num_accepted_tokens"]
    assert 0 < eager.stats["num_accepted_tokens"] < eager.stats["num_draft_tokens"]  # rejections happened


def test_cached_mode_with_an_unloadable_package_warns_and_runs_eagerly(tmp_path, monkeypatch, caplog):
    """The default mode must never make decoding fail: a package this machine cannot load (here: not a package
    at all) is reported once in the log and the request runs on the eager reference; "build" says what to do."""
    monkeypatch.setenv("SPECQUANT_CACHE", str(own_cache(tmp_path)))
    model = _model(0)
    need = PROMPT.shape[1] + 8
    layout = model.cache_layout(1, aot.capacity_for(need, CFG["max_position_embeddings"]), static=True)
    path = aot.package_path(aot.package_key(model, 1, True, layout))
    path.parent.mkdir(parents=True)
    path.write_bytes(b"not a zip archive")
    stepper = Stepper(model, aot="cached")
    with caplog.at_level("WARNING", logger="specquant.decode.aot"):
        out = generate(stepper, PROMPT, 8, stop_on_eos=False).token_ids
    assert not stepper.aot_steps and not model.static_cache
    assert out == generate(_model(0), PROMPT, 8, stop_on_eos=False).token_ids
    assert "could not be loaded" in caplog.text and path.name in caplog.text
    with pytest.raises(SpecquantError, match="delete it and build again"):
        Stepper(model, aot="build").setup(1, need)


CHILD = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
from test_aot import PROMPT, _model
from specquant.decode.compiled import Stepper
from specquant.spec_decode.engine import generate
stepper = Stepper(_model(0), aot="cached")
tokens = generate(stepper, PROMPT, 24, stop_on_eos=False).token_ids
print(json.dumps({"tokens": tokens, "packaged": bool(stepper.aot_steps),
                  "inductor_imported": "torch._inductor" in sys.modules}))
"""


def test_a_fresh_process_only_loads_the_package(cache_dir):
    """The point of packaging: a new process finds the package, never imports inductor, and decodes the same."""
    files = sorted((cache_dir / "compile" / "aot").iterdir())
    env = dict(os.environ, SPECQUANT_CACHE=str(cache_dir))
    res = subprocess.run([sys.executable, "-c", CHILD, os.path.dirname(__file__)], env=env, capture_output=True,
                         text=True, check=False)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got["packaged"] and not got["inductor_imported"]
    assert got["tokens"] == generate(_model(0), PROMPT, 24, stop_on_eos=False).token_ids
    assert sorted((cache_dir / "compile" / "aot").iterdir()) == files  # nothing built or rewritten


def test_package_key_covers_what_the_compiled_code_depends_on(monkeypatch):
    model = _model(0)
    layout = model.cache_layout(1, 256, static=True)
    key = aot.package_key(model, 1, True, layout)
    assert aot.package_key(_model(3), 1, True, layout) == key  # weights are bound at load, not compiled in
    others = [aot.package_key(model, 2, True, layout), aot.package_key(model, 1, False, layout),
              aot.package_key(model, 1, True, model.cache_layout(1, 512, static=True)),
              aot.package_key(model, 1, True, model.cache_layout(1, 256, window=8, static=True)),
              aot.package_key(model, 1, True, model.cache_layout(2, 256, static=True)),
              aot.package_key(model, 1, True, model.cache_layout(1, 256, dtype=torch.bfloat16, static=True)),
              aot.package_key(_model(0, rms_norm_eps=1e-5), 1, True, layout),  # config
              aot.package_key(Transformer(ModelConfig(**CFG)).eval(), 1, True, layout)]  # unfused layout
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)  # inductor bakes the thread count into kernels
    others.append(aot.package_key(model, 1, True, layout))
    monkeypatch.setattr(aot, "_source_digest", lambda m: "changed model code")
    others.append(aot.package_key(model, 1, True, layout))
    assert len({key, *others}) == 1 + len(others)


def test_capacity_buckets_and_bad_modes():
    assert aot.capacity_for(1, 2048) == 256 and aot.capacity_for(256, 2048) == 256
    assert aot.capacity_for(257, 2048) == 512 and aot.capacity_for(1500, 2048) == 2048
    assert aot.capacity_for(1500, 1600) == 1600 and aot.capacity_for(100, 120) == 120
    with pytest.raises(SpecquantError, match="aot mode 'yes'"):
        Stepper(_model(0), aot="yes")
    with pytest.raises(SpecquantError, match="pick one"):
        Stepper(_model(0), compile=True, aot="cached")


@pytest.mark.parametrize("activations", ["float", "int8"])
def test_w4_model_packages_with_its_native_kernel(tmp_path, monkeypatch, activations, native_kernels):
    """A W4 model's step packages too: the build runs it once eagerly (a QuantLinear prepares its kernel layout
    lazily, which a trace cannot), and the package calls the native kernel as a torch operator on the model's own
    codes and scales, or, without native kernels (native_kernels == "fallback"), torch's int4 kernel on the
    layer's derived buffers. Packaged logits match eager; tokens are the same."""
    from specquant.quant import QuantConfig, quantize
    from specquant.kernels import w4a8
    from specquant.quant.linear import set_w4_activations

    if activations == "int8" and w4a8.FAMILY.library() is None:
        pytest.skip(f"W4A8 kernel unavailable: {w4a8.FAMILY.why()}")
    monkeypatch.setenv("SPECQUANT_CACHE", str(own_cache(tmp_path)))

    def w4_model():
        model = randomize_(Transformer(ModelConfig(**CFG)), 0).eval()
        quantize(model, QuantConfig(method="rtn", bits=4, group_size=32), scale_dtype=torch.bfloat16)
        set_w4_activations(model, activations)
        fuse_projections(model)
        return model

    model = w4_model()
    ref_logits, ref_tokens = _step_logits(Stepper(model), model)
    stepper = Stepper(model, aot="build")
    logits, tokens = _step_logits(stepper, model)
    assert stepper.aot_steps, "no package was built for the W4 model"
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)
    # as in a fresh process: a model that never ran (codes still in the checkpoint's layout) finds and binds the
    # package only after settling into the kernel's layout, and gets the same logits
    fresh = w4_model()
    stepper = Stepper(fresh, aot="cached")
    logits, tokens = _step_logits(stepper, fresh)
    assert stepper.aot_steps and len(list((tmp_path / "compile" / "aot").glob("*.pt2"))) == 1
    assert tokens == ref_tokens
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=1e-4)


def test_w4_activations_are_part_of_the_package_key():
    """A W4 model's float- and int8-activation steps are different graphs over the same tensors: different keys,
    so one is never loaded for the other."""
    from specquant.quant import QuantConfig, quantize
    from specquant.kernels import w4a8
    from specquant.quant.linear import set_w4_activations

    if w4a8.FAMILY.library() is None:  # int8 activations exist only on the W4A8 kernel
        pytest.skip(f"W4A8 kernel unavailable: {w4a8.FAMILY.why()}")

    model = randomize_(Transformer(ModelConfig(**CFG)), 0).eval()
    quantize(model, QuantConfig(method="rtn", bits=4, group_size=32))
    fuse_projections(model)
    layout = model.cache_layout(1, 256, static=True)
    keys = set()
    for mode in ("float", "int8", "float"):
        set_w4_activations(model, mode)
        aot.settle(model, 1)
        keys.add(aot.package_key(model, 1, True, layout))
    assert len(keys) == 2


def test_native_and_fallback_w4_steps_have_different_package_keys(monkeypatch):
    """A package built where the native W4 kernel runs reads other buffers (the kernel's layout) than one built on
    torch's int4 fallback (SPECQUANT_NATIVE=off, or a CPU without the kernel): different keys, never mixed up."""
    from specquant.quant import QuantConfig, quantize
    from specquant.kernels import w4_bf16

    if w4_bf16.FAMILY.library() is None:
        pytest.skip(f"native W4 kernel unavailable: {w4_bf16.FAMILY.why()}")

    def key():
        model = randomize_(Transformer(ModelConfig(**CFG)), 0).eval()
        quantize(model, QuantConfig(method="rtn", bits=4, group_size=32))
        fuse_projections(model)
        aot.settle(model, 1)
        return aot.package_key(model, 1, True, model.cache_layout(1, 256, static=True))

    native = key()
    with native_switch(monkeypatch, "off"):
        assert key() != native
    assert key() == native
