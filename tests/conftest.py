"""Shared helpers: tiny random HF configs, an HF model and our decoder holding the same weights, bundled-model checks.

Random weights are drawn at "trained-model" scale (unit-variance activations, non-zero biases, norm weights away
from 1) rather than HF's 0.02-std init, which leaves logits near zero and would let real differences hide under a
1e-4 tolerance.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import weakref
from pathlib import Path

# Without CUDA, Triton kernels (quant/triton_w4.py) can run only under Triton's interpreter, which triton reads
# when it is first imported: set it before anything imports triton. On a CUDA machine they run compiled.
import torch  # noqa: E402  (imports no triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from specquant.decode.compile_cache import compile_cache_dir
from specquant.kernels.build import cache_dir as kernels_dir
from specquant.model.checkpoint import BUNDLED_DIR, load_dense_into, save_model
from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer

# One inductor cache for the whole run, both workers and their subprocesses: the one a compiling process of ours
# picks (decode/compile_cache.py), fixed here before any test moves SPECQUANT_CACHE. Without it each process kept
# the directory of the first test in it that compiled (a test's own SPECQUANT_CACHE, often), and every fresh one
# redid inductor's CPU-feature probes (C++ builds of their own) and the kernels other tests had compiled. The tests of
# where compiled code lands unset it in their own scope; a user's own TORCHINDUCTOR_CACHE_DIR is kept.
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(compile_cache_dir()))
KERNELS = kernels_dir()  # where `scripts/setup.sh` built the native kernels, fixed before any test moves it


def own_cache(path: Path) -> Path:
    """A SPECQUANT_CACHE of a test's own, for what it checks about compiled graphs and AOT packages, holding the
    run's native kernels (a link): otherwise each such test compiled them again (a C++ build each). Those are
    keyed by source, flags and CPU (kernels/build.py), so sharing them is what a second process of a user does."""
    path.mkdir(parents=True, exist_ok=True)
    KERNELS.mkdir(parents=True, exist_ok=True)
    if not (path / "kernels").is_symlink():
        (path / "kernels").symlink_to(KERNELS, target_is_directory=True)
    return path


VOCAB = 101
TINY = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-6,
            tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)


# The test command runs two workers with a test file per worker (`--dist loadfile`, README), handing out files in
# collection order. A long file handed out last keeps one worker busy while the other has nothing left: these
# files, the longest (tests/ durations in docs/BENCH.md, "CI time"), go first, and the short ones fill in after.
LONGEST_FIRST = ("test_vllm.py", "test_aot.py", "test_qwen35_steps.py", "test_compiled.py", "test_serve.py",
                 "test_qwen35_spec.py", "test_trainer.py", "test_quant_trained.py", "test_tree.py", "test_bench.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def tiny_config(model_type: str, **overrides):
    """A small transformers config (vocab 101, hidden 64, 2 layers, 4 heads / 2 kv heads, head_dim 16)."""
    return AutoConfig.for_model(model_type, **{**TINY, **overrides})


def randomize_(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter in place: matrices ~ N(0, 1/fan_in), embeddings ~ N(0, 1), biases ~ N(0, 0.1^2),
    norm weights ~ 1 + N(0, 0.1^2). Tied weights are visited once."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():  # duplicates (tied lm_head) are skipped by default
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("bias"):
                p.copy_(0.1 * noise)
            elif p.dim() == 1:  # RMSNorm weights
                p.copy_(1.0 + 0.1 * noise)
            elif "embed_tokens" in name:
                p.copy_(noise)
            else:
                p.copy_(noise / math.sqrt(p.shape[1]))
    return model


def ours_from_hf(hf_model, dtype=torch.float32, **config_changes) -> Transformer:
    """Our decoder built from the HF model's config.json dict, holding its weights (via load_dense_into)."""
    cfg = dataclasses.replace(ModelConfig.from_hf(hf_model.config.to_dict()), **config_changes)
    model = Transformer(cfg)
    load_dense_into(model, hf_model.state_dict())
    return model.to(dtype).eval()


def build_pair(model_type: str, seed: int = 0, dtype=torch.float32, attn_implementation: str = "eager", **overrides):
    """(transformers model, our Transformer) with identical random weights, both in eval mode and `dtype`.

    HF's eager attention is the reference: plain softmax(QK^T/sqrt(d) + mask) V.
    """
    hf_cfg = tiny_config(model_type, **overrides)
    hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.float32, attn_implementation=attn_implementation)
    randomize_(hf, seed)
    ours = ours_from_hf(hf)
    return hf.to(dtype).eval(), ours.to(dtype).eval()


def random_model(model_type: str = "qwen3", seed: int = 0, **config_changes) -> Transformer:
    """Our decoder alone with tiny random weights (for tests that need no HF reference)."""
    cfg = ModelConfig.from_hf(tiny_config(model_type).to_dict())
    model = Transformer(dataclasses.replace(cfg, **config_changes))
    return randomize_(model, seed).eval()


def bundled_available(name: str) -> bool:
    """True when the bundled model has both its config and its weights (tiny-target may still be training)."""
    path = BUNDLED_DIR / name
    return (path / "config.json").exists() and (path / "model.safetensors").exists()


def needs_bundled(name: str):
    return pytest.mark.skipif(not bundled_available(name), reason=f"bundled {name} not built yet (no config/weights)")


def save_tiny_checkpoint(path):
    """A 2-layer random Qwen3 with the bundled tokenizer's 8192-token vocabulary, saved with its tokenizer files at
    `path` (quantizes and generates in well under a second): the CLI tests' model."""
    cfg = ModelConfig(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256)
    return save_model(randomize_(Transformer(cfg), seed=0), path, tokenizer_from=BUNDLED_DIR / "tiny-target")


def small_block_draft(target: Transformer, block_size: int = 6, target_layer_ids=(1, 2), seed: int = 2,
                      copy_norm: bool = True):
    """A one-layer block drafter (DFlash-style) for target, its weights scaled by 0.3 so its drafts agree with the
    target only sometimes; copy_norm: its final norm is the target's (it leans on the last layer's features)."""
    from specquant.model.block_draft import BlockDraftConfig, BlockDraftModel

    dcfg = BlockDraftConfig.for_target(target.config, num_hidden_layers=1, block_size=block_size,
                                       target_layer_ids=list(target_layer_ids), mask_token_id=5)
    torch.manual_seed(seed)
    draft = BlockDraftModel(dcfg).eval()
    with torch.no_grad():
        for p in draft.parameters():
            p.mul_(0.3)
        if copy_norm:
            draft.norm.weight.copy_(target.model.norm.weight)
    return draft


@pytest.fixture(scope="session")
def w4_block_draft(tmp_path_factory):
    """The bundled block drafter as GPTQ W4 (group 32, bf16 scales: fp16-exact, so the GGUF is exact), quantized
    once per session into a directory its users only read (test_export_dflash, test_export_llama_cpp)."""
    from specquant.drafter_loader import load_block_draft
    from specquant.loader import load_model
    from specquant.model.checkpoint import save_block_drafter
    from specquant.quant.block_draft_gptq import gptq_block_drafter
    from specquant.quant.checkpoint import quantization_config
    from specquant.quant.config import QuantConfig

    torch.manual_seed(0)
    target = load_model("tiny-target", torch.float32)
    draft = load_block_draft("tiny-block-draft", torch.float32)
    cfg = QuantConfig(method="gptq", bits=4, group_size=32)
    gptq_block_drafter(draft, target, torch.randint(4, 8000, (2, 64)), cfg)
    draft.to(torch.bfloat16)
    return save_block_drafter(draft, tmp_path_factory.mktemp("w4_block_draft") / "w4",
                              extra_config={"quantization_config": quantization_config(draft, cfg)},
                              tokenizer_from="tiny-block-draft")


BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(script: str):
    """A script under benchmarks/ imported as a module, for tests of its functions: the scripts are not a package
    (each imports only specquant, never a sibling)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"bench_script_{script[:-3]}", BENCHMARKS / script)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(params=["native", "fallback"])
def native_kernels(request, monkeypatch):
    """Runs a test twice: with the native kernels this machine builds, and with SPECQUANT_NATIVE=off, the path every
    CPU without them takes (torch's int4 kernel), so both are tested on every machine in one pytest run."""
    from specquant import kernels

    if request.param == "fallback":
        monkeypatch.setenv("SPECQUANT_NATIVE", "off")
    kernels.reset()  # the families cache their choice: read the switch again
    yield request.param
    kernels.reset()


@contextlib.contextmanager
def native_switch(monkeypatch, value: str):
    """SPECQUANT_NATIVE=value inside the block, every kernel family's choice read again on the way in and out; the
    switch the run had before (none, or SPECQUANT_NATIVE=avx2,portable for the whole suite) is back after it."""
    from specquant import kernels

    before = os.environ.get("SPECQUANT_NATIVE")
    monkeypatch.setenv("SPECQUANT_NATIVE", value)
    kernels.reset()
    try:
        yield
    finally:
        if before is None:
            monkeypatch.delenv("SPECQUANT_NATIVE")
        else:
            monkeypatch.setenv("SPECQUANT_NATIVE", before)
        kernels.reset()


def need_kernel(family, variant=None):
    """Skip the calling test, with the reason, unless the family's chosen variant (or the one named) loads here."""
    lib, why = (family.library(), family.why()) if variant is None else family.load(variant)
    if lib is None:
        pytest.skip(f"native {family.name} kernel{' ' + variant.name if variant else ''} unavailable: {why}")
    return lib


def kernel_variants(family):
    """Parameters for a test to run on every variant of a kernel family (each one skips where it does not load)."""
    return [pytest.param(v, id=v.name) for v in family.variants]


_GREEDY: "weakref.WeakKeyDictionary[torch.nn.Module, dict]" = weakref.WeakKeyDictionary()


def target_greedy(target, prompt: torch.Tensor, n: int) -> list[int]:
    """The target's own greedy continuation, `generate(target, prompt, n, stop_on_eos=False).token_ids[0]`,
    computed once per model, prompt and n: the parametrized lossless tests compare every drafter setting (k,
    window, kind) against the same reference, which the target alone produces the same way each time. Keyed by the
    model object and each parameter's storage and in-place version counter, so a model whose weights changed
    (quantized, trained, reloaded) is run again. Only for references nothing else changes (the native switch
    is part of what a test sets, not of this key: call generate directly in a test that toggles it)."""
    from specquant.spec_decode.engine import generate

    weights = tuple((name, p.data_ptr(), p._version) for name, p in target.named_parameters())
    key = (weights, tuple(prompt.flatten().tolist()), tuple(prompt.shape), n)
    cache = _GREEDY.setdefault(target, {})
    if key not in cache:
        cache[key] = generate(target, prompt, n, stop_on_eos=False).token_ids[0]
    return list(cache[key])


def target_law(target, prompt):
    """(temperature, first_probs, top, second_probs): the target's sampling law at the first two new positions,
    with the temperature set from the logits' spread so both positions have a few likely tokens; second_probs is
    conditioned on the first token being `top`. Scored cache-free."""
    from specquant.decode.sampling import SamplingConfig, logits_to_probs

    target.clear_cache()
    with torch.no_grad():
        temperature = float(target(prompt)[0, -1].std()) / 2
        law = SamplingConfig(temperature=temperature)
        first_probs = logits_to_probs(target(prompt)[0, -1], law)
        top = int(first_probs.argmax())
        second_probs = logits_to_probs(target(torch.cat([prompt, torch.tensor([[top]])], 1))[0, -1], law)
    return temperature, first_probs, top, second_probs


def assert_follows_target_law(engine, prompt, law, n: int, tv_bound: float):
    """Sample 3 tokens n times (seeds 0..n-1) and check the first two against `law` (from target_law).

    First token: binomial z-test on P(top); |z| > 4.5 has probability < 1e-5 under the target's law. Second
    token, given the first was `top`: total variation of its histogram against the law, with a bound the caller
    sets far above the sampling noise of a few hundred hits (expected TV ~ sqrt(vocab / hits) / 2).
    Returns the second-token probabilities, for the caller's own spread checks."""
    from specquant.decode.sampling import SamplingConfig

    temperature, first_probs, top, second_probs = law
    hits, counts = 0, torch.zeros(second_probs.shape[-1])
    for seed in range(n):
        toks = engine.generate(prompt, 3, SamplingConfig(temperature, seed=seed), stop_on_eos=False).token_ids[0]
        if toks[0] == top:
            hits += 1
            counts[toks[1]] += 1
    p = float(first_probs[top])
    assert 0.05 < p < 0.95, p  # the law has spread: the test can fail
    assert abs(hits - n * p) / math.sqrt(n * p * (1 - p)) < 4.5
    tv = 0.5 * float((counts / counts.sum() - second_probs).abs().sum())
    assert tv < tv_bound, tv


def peaky_model(layers: int, seed: int, vocab: int = 96, eos: int | None = None) -> Transformer:
    """A small random model with its weights scaled 3x: peaky distributions, so a draft's acceptance is neither
    0 nor 1."""
    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
                      eos_token_id=eos)
    m = Transformer(cfg).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.mul_(3.0)
    return m


def peaky_pair(vocab: int = 96) -> tuple[Transformer, Transformer]:
    """(3-layer target, 1-layer draft sharing its embedding): a pair that agrees only in part."""
    target, draft = peaky_model(3, 0, vocab), peaky_model(1, 1, vocab)
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target.model.embed_tokens.weight)
    return target, draft
