"""Small models for the quantization tests (imported by tests/test_quant_*.py)."""

from pathlib import Path

import torch

from specquant.model.config import ModelConfig
from specquant.model.decoder import Transformer

TINY_TARGET = Path(__file__).resolve().parent.parent / "src" / "specquant" / "models" / "tiny-target"
HAS_TINY_TARGET = (TINY_TARGET / "model.safetensors").exists()


def small_config(**kw) -> ModelConfig:
    base = dict(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=32)
    base.update(kw)
    return ModelConfig(**base)


def gaussian_model(seed=0, **kw) -> Transformer:
    """Random model with N(0, 1/in) Linear weights (so the Gaussian SQNR estimates apply) and untied lm_head."""
    torch.manual_seed(seed)
    m = Transformer(small_config(tie_word_embeddings=False, **kw)).eval()
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.Linear):
                mod.weight.normal_(0, mod.in_features ** -0.5)
    return m


def outlier_model(seed=0, kv_heads=4, head_std=3.0) -> Transformer:
    """Random model with AWQ's premise built in: a few input channels of every Linear carry large activations.

    Each RMSNorm gets 4 channels with weight 20 (outliers into q/k/v and gate/up) and 4 rows of up_proj are
    ×10 (outliers into down_proj). lm_head std 3/√hidden gives peaked, text-like next-token distributions.
    """
    cfg = small_config(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                       num_key_value_heads=kv_heads, head_dim=64, tie_word_embeddings=False)
    torch.manual_seed(seed)
    m = Transformer(cfg).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        m.lm_head.weight.normal_(0, head_std * cfg.hidden_size ** -0.5, generator=g)
        for layer in m.model.layers:
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight[torch.randperm(cfg.hidden_size, generator=g)[:4]] = 20.0
            layer.mlp.up_proj.weight[torch.randperm(cfg.intermediate_size, generator=g)[:4]] *= 10
    return m


@torch.no_grad()
def sample_text(model, n: int, length: int, seed: int) -> torch.Tensor:
    """[n, length] tokens sampled at T=1 from the model itself: "text" the full-precision model predicts best,
    so perplexity on it means something even for a random model."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, model.config.vocab_size, (n, 1), generator=g)
    model.setup_cache(n, length)
    for t in range(length - 1):
        probs = torch.softmax(model(tokens[:, -1:], start_pos=t)[:, -1].float(), dim=-1)
        tokens = torch.cat([tokens, torch.multinomial(probs, 1, generator=g)], dim=1)
    model.clear_cache()
    return tokens


def hybrid_checkpoint(path: Path, seed: int = 0, layers: int = 4, **over) -> Path:
    """A random Qwen3.5 hybrid written by transformers (Qwen3_5ForCausalLM.save_pretrained) with the bundled
    tokenizer, so calibration text tokenizes within its vocabulary (8192). Every quantized Linear reads 64 (or 128)
    inputs, so g32 / g64 apply; the "gva" pattern: three Gated DeltaNet layers, then gated full attention, with key
    heads != value heads."""
    import shutil

    from _qwen35_models import hf_model

    from specquant.model.checkpoint import BUNDLED_DIR

    kw = dict(vocab_size=8192, hidden_size=64, intermediate_size=128, linear_key_head_dim=16,
              linear_value_head_dim=16, head_dim=16, num_attention_heads=4, num_key_value_heads=2,
              partial_rotary_factor=0.25, eos_token_id=0)
    kw.update(over)
    hf_model("gva", layers, seed=seed, **kw).save_pretrained(path, safe_serialization=True)
    for f in (BUNDLED_DIR / "tiny-target").glob("tokenizer*"):
        shutil.copy(f, path / f.name)
    return path


def noisy_copy(src: Path, dst: Path, rel: float = 0.1, seed: int = 1) -> Path:
    """A copy of checkpoint src whose matrices (embeddings excepted) carry rel x their std of Gaussian noise: a draft
    that agrees with src often but not always, so speculation both accepts and rolls back."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    tensors = load_file(dst / "model.safetensors")
    for name, t in tensors.items():
        if t.dim() == 2 and "embed" not in name:
            tensors[name] = t + rel * t.std() * torch.randn(t.shape, generator=g)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst
